"""The issue-45 per-GEMM figures from `fp8route bench gemm --scheme S` JSON files: per shape and M, routed
against the best single backend of the scheme, and against the backend vLLM's fixed order would pick
(where it runs here); printed as a table and a verdict.

    python3 benchmarks/scripts/schemes_gemm_table.py gemm-llama-3.1-8b-tp1-channel.json gemm-...-block.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# What vLLM's CUDA kernel order picks on an H200 that runs here (none of its own CUTLASS builds
# do): channel -> its CUTLASS rowwise kernel, the same CUTLASS sm90 rowwise epilogue as torch's;
# block -> DeepGEMM when installed, else its CUTLASS blockwise kernel, else its Triton kernel
# (x quantized per group by a separate kernel, as our triton_block).
VLLM = {"channel": ("rowwise",), "block": ("deepgemm", "triton_block")}


def main(paths: list[str]) -> None:
    for path in paths:
        doc = json.loads(Path(path).read_text())
        scheme = doc.get("scheme", "tensor")
        rows = [r for r in doc["rows"] if r.get("median_us") is not None and not r.get("error")]
        by = {(r["shape"], r["m"], r["arm"]): r["median_us"] for r in rows}
        vllm = next((b for b in VLLM.get(scheme, ()) if any(r["arm"] == b for r in rows)), None)
        print(f"\n{scheme}: routed / best single backend, and the vLLM pick ({vllm}) / routed")
        worst, wins, points = 9.0, 0, 0
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for m in doc["m_values"]:
                routed = by.get((shape, m, "routed"))
                singles = {a: t for (s, mm, a), t in by.items() if s == shape and mm == m and a != "routed"}
                if routed is None or not singles:
                    continue
                best = min(singles, key=singles.get)  # type: ignore[arg-type]
                ratio = singles[best] / routed
                vs = by.get((shape, m, vllm)) if vllm else None
                speedup = vs / routed if vs else float("nan")
                worst, points = min(worst, ratio), points + 1
                wins += speedup >= 1.05
                print(
                    f"  {shape:<28} M={m:<5} routed {routed:8.1f} us  best {best:<19} {ratio:5.3f}x"
                    f"  vs {vllm} {speedup:5.2f}x"
                )
        print(
            f"  worst routed/best {worst:.3f} (target >= 0.97); "
            f">= 1.05x the vLLM pick on {wins} of {points} (target >= 1/3)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
