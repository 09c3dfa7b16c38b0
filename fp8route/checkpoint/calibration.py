"""Token ids to calibrate static input scales with: read from a file, tokenized from text, or generated;
calibration_ids picks among them as `fp8route quantize` is given them."""

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


def calibration_ids(
    src: Path,
    vocab_size: int,
    calib: str | os.PathLike[str] | Sequence[torch.Tensor] | Sequence[str] | None,
    calib_text: str | os.PathLike[str] | None,
    seq_len: int,
    tokens: int,
) -> tuple[list[torch.Tensor], str]:
    """The calibration sequences and a one-line description of where they came from."""
    if calib is not None and calib_text is not None:
        raise Fp8InputError("give calibration data once: token ids (--calib) or text (--calib-text), not both")
    texts: list[str] | None = None
    if calib_text is not None:
        texts, source = read_text(calib_text), f"text {calib_text}"
    elif isinstance(calib, (list, tuple)) and calib and all(isinstance(t, str) for t in calib):
        texts, source = list(calib), f"text ({len(calib)} str)"
    if texts is not None:
        from fp8route.models.tokenizer import load_tokenizer

        try:
            tokenizer = load_tokenizer(src)
        except Fp8InputError as e:
            raise Fp8InputError(f"calibrating on text needs the source's tokenizer: {e}") from None
        sequences = text_token_ids(texts, tokenizer, seq_len, tokens)
        bad = max(int(s.max()) for s in sequences)
        if bad >= vocab_size:
            raise Fp8InputError(f"{src}: the tokenizer gives id {bad}, outside the model's vocabulary {vocab_size}")
        return sequences, source
    if calib is None:
        return generated_token_ids(vocab_size), "generated"
    if isinstance(calib, (str, os.PathLike)):
        return load_token_ids(calib, vocab_size), f"token ids {calib}"
    sequences = [s for s in calib if isinstance(s, torch.Tensor)]
    if not sequences or len(sequences) != len(calib):
        raise Fp8InputError("calib must be a token-id file, token-id tensors or a list of str texts")
    return sequences, f"token ids ({len(sequences)} tensors)"
