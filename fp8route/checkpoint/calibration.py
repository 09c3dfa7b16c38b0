"""Token ids to calibrate static input scales with: read from a file, tokenized from text, or generated."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    fit real activations better; pass --calib-text (or --calib with token ids) when you have it."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g) for _ in range(sequences)]


def read_text(path: str | os.PathLike[str], what: str = "calibration text") -> list[str]:
    """A text file's documents: blocks separated by blank lines (a file without blank lines is one)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Fp8InputError(f"{what} {file}: cannot read it as UTF-8 text: {e}") from None
    documents = [block.strip() for block in text.replace("\r\n", "\n").split("\n\n") if block.strip()]
    if not documents:
        raise Fp8InputError(f"{what} {file} is empty")
    return documents


def text_token_ids(
    texts: Sequence[str], tokenizer: Any, seq_len: int = 512, max_tokens: int = 16384
) -> list[torch.Tensor]:
    """Token ids of `texts` for calibration: each text tokenized on its own (with the tokenizer's
    special tokens), the ids concatenated in order and cut into sequences of at most seq_len,
    stopping at max_tokens in all. Packing keeps every sequence but the last full length, so
    attention sees long contexts as it does in serving; seq_len bounds calibration's memory."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise Fp8InputError(f"calibration sequence length must be a positive integer, got {seq_len!r}")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise Fp8InputError(f"calibration token budget must be a positive integer, got {max_tokens!r}")
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise Fp8InputError("calibration texts must be a list of str")
    ids: list[int] = []
    for text in texts:
        if len(ids) >= max_tokens:
            break
        ids.extend(tokenizer.encode(text).ids)
    ids = ids[:max_tokens]
    if not ids:
        raise Fp8InputError("calibration text tokenizes to no tokens")
    flat = torch.tensor(ids, dtype=torch.int64)
    return list(flat.split(seq_len))
