"""What the HTTP server costs the engine on the host, without a GPU: the real scheduler, block
manager, AsyncLLM, FastAPI app, uvicorn and `bench serve --url` client, with each step's forward
replaced by a sleep of --forward-ms (the GIL released, as a step's sync releases it) that returns
random tokens. The same load runs offline (LLM.generate) and over HTTP; the ratio of their output
tok/s is the server's host overhead at that step time.

    python benchmarks/serve_overhead.py [--forward-ms 12] [--num-prompts 512] [--output-len 128]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def simulate_forward(forward_s: float) -> None:
    """Replace LLMEngine._run: sleep for the forward, return a random token for each request sampled."""
    from fp8route.engine.llm_engine import LLMEngine

    def run(self, plan):  # type: ignore[no-untyped-def]
        sampling = [*plan.decodes, *(r for r, n in plan.prefills if r.num_computed + n == len(r.token_ids))]
        time.sleep(forward_s)
        if not sampling:
            return None, []
        return torch.randint(0, 1000, (len(sampling),)), sampling

    LLMEngine._run = run  # type: ignore[method-assign]


def offline(args: argparse.Namespace) -> float:
    from fp8route.engine.llm import LLM
    from fp8route.engine.sampling import SamplingParams

    simulate_forward(args.forward_ms / 1e3)
    llm = LLM("smollm2", device="cpu", max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks)
    prompts = [[100 + (i * 7 + j) % 900 for j in range(args.input_len)] for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forward-ms", type=float, default=12.0)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--role", choices=("driver", "server"), default="driver")
    args = parser.parse_args()
    if args.role == "server":
        os.environ[FORWARD_ENV] = str(args.forward_ms)  # for the engine's process, which imports this file
        from fp8route.cli import main as cli

        sys.argv = ["fp8route", "serve", "smollm2", "--device", "cpu", "--port", str(args.port)]
        sys.argv += ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
        sys.exit(cli())
    rate = offline(args)
    print(f"offline: {rate:.0f} output tok/s")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    server = subprocess.Popen([sys.executable, __file__, "--role", "server", *sys.argv[1:]], env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{url}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        cmd = [sys.executable, "-m", "fp8route", "bench", "serve", "smollm2", "--url", url, "--num-prompts"]
        cmd += [str(args.num_prompts), "--input-len", f"{args.input_len}:{args.input_len}"]
        cmd += ["--output-len", f"{args.output_len}:{args.output_len}", "--out", "/tmp/serve-overhead"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        row = next(line for line in out.splitlines() if line.startswith("http "))
        http = float(row.split()[-6])  # the out tok/s column
        print(out[out.index("arm ") :].strip())
        print(f"http: {http:.0f} output tok/s = {http / rate:.3f}x offline at a {args.forward_ms} ms forward")
    finally:
        server.terminate()
        server.wait()


# The server runs its engine in a spawned process, which imports this file as __mp_main__: the
# forward is replaced there.
FORWARD_ENV = "SERVE_OVERHEAD_FORWARD_MS"
if __name__ == "__mp_main__" and FORWARD_ENV in os.environ:
    simulate_forward(float(os.environ[FORWARD_ENV]) / 1e3)

if __name__ == "__main__":
    main()
