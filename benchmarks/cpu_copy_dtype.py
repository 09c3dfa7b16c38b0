"""Which dtype cpu_dequant's weight copy should have: fp32 (what it keeps) or bf16 (half the memory).

In one process: SmolLM2-135M bf16, its FP8 folder on cpu_dequant (fp32 copy), and the same FP8
layers with a bf16 copy swapped in (x quantized the same way; e4m3 values are exact in bf16 too,
but torch's CPU bf16 matmul writes bf16, so each output is rounded before the scales apply).
Arms take turns in every round; each generates a fixed number of tokens greedily (no EOS) from
the same chat prompt. Prints TTFT and decode tok/s per run, medians, and whether the bf16 copy's
greedy tokens are the fp32 copy's (which are the reference backend's: tests/models/test_real_model.py).

    python benchmarks/cpu_copy_dtype.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fp8route.checkpoint.gguf_tokenizer import apply_chat_template
from fp8route.checkpoint.smollm2 import smollm2_folder
from fp8route.engine.causal_lm import CausalLM
from fp8route.engine.load import load_model
from fp8route.linear.layer import Fp8Linear
from fp8route.models.tokenizer import load_tokenizer
from fp8route.quant import quantize


def bf16_copy_forward(layer: Fp8Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight = layer.weight.to(torch.bfloat16)
    assert layer.input_scale is not None
    scale = layer.input_scale * layer.weight_scale

    def forward(x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, layer.in_features)
        out = (quantize(x2d, layer.input_scale).to(torch.bfloat16) @ weight.t()).float() * scale
        if layer.bias is not None:
            out = out + layer.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)

    return forward


def timed(model: CausalLM, ids: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    stamps: list[float] = []
    start = time.perf_counter()
    out = model.generate(ids, new, on_token=lambda step, tokens: stamps.append(time.perf_counter()))
    assert isinstance(out, torch.Tensor)
    return (stamps[0] - start) * 1e3, (new - 1) / (stamps[-1] - stamps[0]), out[0, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Tell me about Paris.")
    args = parser.parse_args()
    fp8_folder = smollm2_folder(fp8=True)
    text = apply_chat_template(fp8_folder, [{"role": "user", "content": args.prompt}])
    ids = torch.tensor([load_tokenizer(fp8_folder).encode(text, add_special_tokens=False).ids])
    size = ids.shape[1] + args.new_tokens
    bf16 = load_model(smollm2_folder(fp8=False), "cpu", max_batch_size=1, max_seq_len=size)
    fp8 = load_model(fp8_folder, "cpu", max_batch_size=1, max_seq_len=size)
    fp8_bf16_copy = load_model(fp8_folder, "cpu", max_batch_size=1, max_seq_len=size)
    for layer in fp8_bf16_copy.modules():
        if isinstance(layer, Fp8Linear):
            layer.forward = bf16_copy_forward(layer)  # type: ignore[method-assign]
    arms = {"bf16 model": bf16, "fp8, fp32 copy": fp8, "fp8, bf16 copy": fp8_bf16_copy}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {ids.shape[1]} tokens")
    runs: dict[str, list[tuple[float, float, list[int]]]] = {arm: [] for arm in arms}
    for round_ in range(args.rounds):
        for arm, model in arms.items():
            runs[arm].append(timed(model, ids, args.new_tokens))
            ttft, rate, _ = runs[arm][-1]
            print(f"round {round_} | {arm} | TTFT {ttft:.0f} ms | {rate:.1f} tok/s", flush=True)
    for arm, results in runs.items():
        ttft, rate = [r[0] for r in results], [r[1] for r in results]
        print(
            f"{arm}: TTFT median {statistics.median(ttft):.0f} ms [{min(ttft):.0f}, {max(ttft):.0f}], "
            f"decode median {statistics.median(rate):.1f} tok/s [{min(rate):.1f}, {max(rate):.1f}]"
        )
    fp32_tokens, bf16_tokens = runs["fp8, fp32 copy"][0][2], runs["fp8, bf16 copy"][0][2]
    same = next((i for i, (a, b) in enumerate(zip(fp32_tokens, bf16_tokens)) if a != b), None)
    print(f"bf16 copy's greedy tokens: {'the same' if same is None else f'first differ at new token {same}'}")


if __name__ == "__main__":
    main()
