"""`fp8route generate` on a CPU: SmolLM2-135M FP8 against its bf16 folder, tok/s and TTFT (issue 25).

Each arm is the real command in a fresh process (load, plan, prefill, decode, as a user runs it);
arms take turns inside every round, so a machine shared with other jobs slows them alike. An extra
arm runs the same command from another source tree (`--before`, e.g. `git archive <commit>`
unpacked), to compare with the code before a change. Prints every run's summary line and, last,
medians and ranges per (prompt, arm).

    python benchmarks/cpu_generate.py --rounds 5 --before /tmp/base
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from fp8route.checkpoint.smollm2 import smollm2_folder

PROMPTS = ("What is the capital of France?", "Tell me about Paris.")
SUMMARY = re.compile(r"(\d+) prompt tokens, (\d+) new; TTFT (\d+) ms, ([\d.]+|nan) tokens/s")
ROOT = Path(__file__).resolve().parents[1]


def fingerprint() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (
        f"cpu: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"python {platform.python_version()}\ndate: {datetime.datetime.now().isoformat(timespec='seconds')}, "
        f"commit {commit}{' + uncommitted changes' if dirty else ''}"
    )


def run(source: Path, model: str, prompt: str, max_new_tokens: int) -> tuple[str, tuple[int, int, float, float]]:
    command = [sys.executable, "-m", "fp8route", "generate", model, "--chat", "--prompt", prompt]
    command += ["--max-new-tokens", str(max_new_tokens), "--device", "cpu"]
    env = {**os.environ, "PYTHONPATH": str(source)}
    # cwd too: `python -m` puts the working directory ahead of PYTHONPATH on sys.path.
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, check=True, timeout=900)
    lines = [line for line in done.stderr.splitlines() if line.startswith("plan:") or SUMMARY.search(line)]
    match = SUMMARY.search(done.stderr)
    assert match is not None, done.stderr
    prompt_tokens, new, ttft, rate = match.groups()
    return "\n    ".join(lines), (int(prompt_tokens), int(new), float(ttft), float(rate))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--before", type=Path, help="another source tree of fp8route: its FP8 run is one more arm")
    parser.add_argument("--prompt", action="append", help=f"default: {' / '.join(PROMPTS)}")
    args = parser.parse_args()
    arms = {"fp8": (ROOT, str(smollm2_folder(fp8=True))), "bf16": (ROOT, str(smollm2_folder(fp8=False)))}
    if args.before:
        arms["fp8 before"] = (args.before.resolve(), arms["fp8"][1])
    print(fingerprint(), flush=True)
    results: dict[tuple[str, str], list[tuple[int, int, float, float]]] = {}
    for round_ in range(args.rounds):
        for prompt in args.prompt or PROMPTS:
            for arm, (source, model) in arms.items():
                # The machine is shared: the load before each run says how much it was.
                load = Path("/proc/loadavg").read_text().split()[0]
                lines, numbers = run(source, model, prompt, args.max_new_tokens)
                results.setdefault((prompt, arm), []).append(numbers)
                print(f"round {round_} | {prompt} | {arm} | load average {load} before\n    {lines}", flush=True)
    print("\nprompt | arm | prompt tokens | new tokens | TTFT ms median [min, max] | tok/s median [min, max]")
    for (prompt, arm), runs in results.items():
        ttft, rate = [r[2] for r in runs], [r[3] for r in runs]
        print(
            f"{prompt} | {arm} | {runs[0][0]} | {runs[0][1]} | {statistics.median(ttft):.0f} [{min(ttft):.0f}, "
            f"{max(ttft):.0f}] | {statistics.median(rate):.1f} [{min(rate):.1f}, {max(rate):.1f}]"
        )
    for prompt in args.prompt or PROMPTS:
        fp8, bf16 = results[(prompt, "fp8")], results[(prompt, "bf16")]
        # Per round, so that a slow spell on the shared machine hits both sides of a ratio.
        rate = [b[3] / f[3] for f, b in zip(fp8, bf16)]
        ttft = [f[2] / b[2] for f, b in zip(fp8, bf16)]
        print(
            f"{prompt}: bf16 tok/s over FP8 tok/s per round, median {statistics.median(rate):.2f} "
            f"[{min(rate):.2f}, {max(rate):.2f}]; FP8 TTFT over bf16 TTFT {statistics.median(ttft):.2f} "
            f"[{min(ttft):.2f}, {max(ttft):.2f}]"
        )


if __name__ == "__main__":
    main()
