"""Token ids to calibrate static input scales with: read from a file, or generated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fp8route.errors import Fp8InputError


def load_token_ids(path: str | os.PathLike[str], vocab_size: int) -> list[torch.Tensor]:
    """Sequences of token ids from a file, each a 1-D int64 tensor.

    .json: a list of ints (one sequence) or a list of lists; .safetensors: a tensor
    `input_ids` of shape [T] or [B, T]; anything else: text, one sequence per line of ints
    separated by spaces or commas.
    """
    file = Path(path)
    try:
        if file.suffix == ".json":
            data = json.loads(file.read_text())
            rows = [data] if data and all(isinstance(x, int) for x in data) else data
        elif file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                ids = f.get_tensor("input_ids")
            rows = ids.reshape(-1, ids.shape[-1]).tolist()
        else:
            rows = [
                [int(x) for x in line.replace(",", " ").split()]
                for line in file.read_text().splitlines()
                if line.strip()
            ]
    except (OSError, ValueError, SafetensorError) as e:
        raise Fp8InputError(f"calibration file {file}: cannot read token ids: {e}") from None
    if (
        not isinstance(rows, list)
        or not rows
        or not all(isinstance(r, list) and r and all(isinstance(x, int) for x in r) for r in rows)
    ):
        raise Fp8InputError(f"calibration file {file}: expected one or more non-empty sequences of integer token ids")
    sequences = [torch.tensor(r, dtype=torch.int64) for r in rows]
    for i, seq in enumerate(sequences):
        bad = seq[(seq < 0) | (seq >= vocab_size)]
        if bad.numel():
            raise Fp8InputError(
                f"calibration file {file}: sequence {i} has token id {int(bad[0])}, "
                f"outside the vocabulary [0, {vocab_size})"
            )
    return sequences


def generated_token_ids(vocab_size: int, sequences: int = 4, length: int = 128, seed: int = 0) -> list[torch.Tensor]:
    """Uniformly random token ids: a fallback that needs no data. Real text gives scales that
    fit real activations better; pass --calib with tokenized text when you have it."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g) for _ in range(sequences)]
