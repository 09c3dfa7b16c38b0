"""transformers' own generate with fp8route's layers against bf16: TTFT and time per decoded token.

A random ModelOpt FP8 checkpoint of the model's dimensions (fp8route.checkpoint.random.write_random)
is loaded with fp8route.hf.from_pretrained; the bf16 arm is the same architecture built by
transformers with random bf16 weights (no checkpoint to write). Both run
`model.generate(..., cache_implementation="static")` at batch 1, greedy, every new token forced
(min_new_tokens), so the timings do not depend on what the random weights say:

  TTFT        generate with max_new_tokens=1 on a --prompt-token prompt (prefill + first token)
  per token   (generate of --new tokens - TTFT) / (--new - 1), on the same prompt

transformers compiles the static-cache decode step itself when it can (both arms alike; the first,
untimed call pays the compilation); --no-compile passes disable_compile=True instead.

    python3 benchmarks/hf_generate.py --out DIR [--model llama-3.1-8b] [--prompt 4096] [--new 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import fp8route
import fp8route.hf
from fp8route.checkpoint.random import write_random
from fp8route.models.shapes import MODELS


def timed(model: torch.nn.Module, ids: torch.Tensor, new: int, compile_: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(
        ids,
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        cache_implementation="static",
        disable_compile=not compile_,
    )
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(model: torch.nn.Module, ids: torch.Tensor, new: int, reps: int, compile_: bool) -> dict[str, float]:
    timed(model, ids, new, compile_)  # warm-up: compilation, autotuning, the static cache's allocation
    timed(model, ids, 1, compile_)
    ttft = statistics.median(timed(model, ids, 1, compile_) for _ in range(reps))
    total = statistics.median(timed(model, ids, new, compile_) for _ in range(reps))
    return {"ttft_ms": 1e3 * ttft, "per_token_ms": 1e3 * (total - ttft) / (new - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for results.json (and the scratch checkpoint)")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama-3.1-8b")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens (TTFT is measured at this length)")
    parser.add_argument("--new", type=int, default=128, help="tokens decoded for the per-token figure")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="generate(disable_compile=True) in both arms")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hf_generate.py needs a CUDA GPU (an H200 for the figures in the issue)")
    if args.new < 2:
        raise SystemExit("--new must be at least 2")
    args.out.mkdir(parents=True, exist_ok=True)
    config = MODELS[args.model]
    ids = torch.randint(0, int(config["vocab_size"]), (1, args.prompt), device="cuda")  # type: ignore[call-overload]
    compile_ = not args.no_compile
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        folder = write_random(Path(tmp) / "fp8", config, fp8=True)
        model = fp8route.hf.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
        print(fp8route.explain(model))
        results["fp8route"] = measure(model, ids, args.new, args.reps, compile_)
        print(f"fp8route: {results['fp8route']}", flush=True)  # kept if the bf16 arm does not finish
        del model
        torch.cuda.empty_cache()
        hf_config = AutoConfig.from_pretrained(folder)
        del hf_config.quantization_config
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    results["bf16"] = measure(model.eval(), ids, args.new, args.reps, compile_)
    base = results["bf16"]
    print(f"\n{args.model}, batch 1, prompt {args.prompt}, {args.new} new tokens, static cache, "
          f"{'compiled by transformers' if compile_ else 'eager'} ({torch.cuda.get_device_name()})")  # fmt: skip
    print(f"{'arm':<10} {'TTFT ms':>9} {'vs bf16':>8} {'ms/token':>9} {'vs bf16':>8}")
    for arm, r in results.items():
        print(f"{arm:<10} {r['ttft_ms']:>9.2f} {base['ttft_ms'] / r['ttft_ms']:>7.2f}x "
              f"{r['per_token_ms']:>9.3f} {base['per_token_ms'] / r['per_token_ms']:>7.2f}x")  # fmt: skip
    meta = {
        **{k: getattr(args, k) for k in ("model", "prompt", "new", "reps")},
        "compile": compile_,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "fp8route": fp8route.__version__,
    }
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
