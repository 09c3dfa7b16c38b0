"""The deterministic mode's promise on a model's real shapes: the same prompts alone and inside batches of
16, 64 and 256 other prompts give the same tokens and logprobs (greedy and seeded), and the same again
with the mode off (how many differ: what the mode fixes).

    PYTHONPATH=$PWD python3 benchmarks/scripts/deterministic_equality.py CHECKPOINT [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from pathlib import Path

import torch

from fp8route import LLM, SamplingParams

PROBES = 8  # prompts run alone, then inside each batch
OUTPUT = 32


def _params(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True, logprobs=1)
    return SamplingParams(max_tokens=OUTPUT, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True, logprobs=1)


def _key(output) -> tuple:  # type: ignore[no-untyped-def]
    completion = output.outputs[0]
    return tuple(completion.token_ids), repr(completion.logprobs)


def run(folder: str, deterministic: bool, batches: list[int], longest: int, **settings: object) -> dict[str, object]:
    """How many of the probes' results differ from their runs alone, in each batch size."""
    llm = LLM(folder, deterministic=deterministic, max_num_seqs=max(batches), skip_tokenizer_init=True, **settings)
    vocab = json.loads((llm.folder / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(16, longest))] for _ in range(max(batches))]
    probes, others = prompts[:PROBES], prompts[PROBES:]
    alone = [_key(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(probes)]
    differ: dict[int, int] = {}
    for batch in batches:
        if batch <= 1:
            got = [_key(llm.generate([p], _params(i), use_tqdm=False)[0]) for i, p in enumerate(probes)]
        else:  # the probes in the middle of batch - PROBES others, each with params of its own
            fill = others[: max(batch - PROBES, 0)]
            half = len(fill) // 2
            batch_prompts = fill[:half] + probes + fill[half:]
            params = [_params(1000 + i) for i in range(len(fill))]
            params[half:half] = [_params(i) for i in range(PROBES)]
            outs = llm.generate(batch_prompts, params, use_tqdm=False)
            got = [_key(o) for o in outs[half : half + PROBES]]
        differ[batch] = sum(a != b for a, b in zip(alone, got, strict=True))
    return {"deterministic": deterministic, "probes": PROBES, "differ_by_batch": differ}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--longest", type=int, default=1500, help="prompts of 16 to this many tokens")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    settings = {"device": args.device} if args.device else {}
    rows = []
    for mode in (True, False):
        rows.append(run(args.checkpoint, mode, batches, args.longest, **settings))
        print(rows[-1], flush=True)  # a run cut short keeps the mode it finished
        gc.collect()  # the engine's graphs hold it in reference cycles: free its KV pool before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if args.out:
        (args.out / "deterministic_equality.json").write_text(json.dumps(rows, indent=1))
    head = "".join(f"{'batch ' + str(b):>10}" for b in batches)
    print(f"{'mode':<14}{head}   (of {PROBES} probes, how many differ from their runs alone)")
    for row in rows:
        differ = row["differ_by_batch"]
        assert isinstance(differ, dict)
        name = "deterministic" if row["deterministic"] else "default"
        print(f"{name:<14}" + "".join(f"{differ[b]:>10}" for b in batches))


if __name__ == "__main__":
    main()
