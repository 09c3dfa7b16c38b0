"""What the deterministic mode costs on this CPU: SmolLM2 (FP8 per tensor, bf16 activations) through
LLM, a lone request's decode and a batch of 16, the mode off and on, each in its own process.

    python3 benchmarks/scripts/cpu_deterministic_cost.py            # prints one table
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

OUTPUT = 48


def arm(deterministic: bool, batch: int) -> dict[str, float]:
    from fp8route import LLM, SamplingParams

    llm = LLM("smollm2", device="cpu", deterministic=deterministic, max_num_seqs=16)
    params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
    prompts = [f"Tell me a short story about the number {i}." for i in range(batch)]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"deterministic": deterministic, "batch": batch, "wall_s": wall, "output_tok_s": tokens / wall}


def main() -> None:
    if len(sys.argv) == 3:
        print(json.dumps(arm(sys.argv[1] == "on", int(sys.argv[2]))))
        return
    rows = []
    for batch in (1, 16):
        for mode in ("off", "on"):
            command = [sys.executable, __file__, mode, str(batch)]
            out = subprocess.run(command, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("batch  deterministic  output tok/s  wall s")
    for r in rows:
        print(f"{r['batch']:5d}  {str(r['deterministic']):13s}  {r['output_tok_s']:12.1f}  {r['wall_s']:6.2f}")
    for batch in (1, 16):
        off, on = (next(r for r in rows if r["batch"] == batch and r["deterministic"] is d) for d in (False, True))
        slower, speeds = off["output_tok_s"] / on["output_tok_s"], (on["output_tok_s"], off["output_tok_s"])
        print(f"batch {batch}: {slower:.2f}x slower with the mode ({speeds[0]:.1f} vs {speeds[1]:.1f} tok/s)")


if __name__ == "__main__":
    main()
