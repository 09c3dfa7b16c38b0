"""The check every entry point that takes token ids makes (generate, model(ids)): what they must be
is said once, in one wording."""

from __future__ import annotations

import torch

from fp8route.errors import Fp8InputError

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_ids(who: str, input_ids: object, vocab_size: int, max_positions: int = 0) -> tuple[int, int]:
    """(B, T) of input_ids, or Fp8InputError unless it is an integer tensor [B, T] with B, T >= 1,
    T <= max_positions (0: no limit) and every id in 0..vocab_size-1.

    Reading the ids' range is one host sync: for calls that take a whole input, never a decode step."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in _INTEGER_DTYPES:
        got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else input_ids
        raise Fp8InputError(f"{who}: input_ids must be an integer tensor [B, T], got {got}")
    batch, width = input_ids.shape
    if batch == 0 or width == 0:
        raise Fp8InputError(f"{who}: input_ids {tuple(input_ids.shape)} has no tokens")
    if max_positions and width > max_positions:
        raise Fp8InputError(
            f"{who}: input_ids has {width} positions, more than the model's max_position_embeddings="
            f"{max_positions}; shorten the input or split it into windows"
        )
    low, high = torch.stack([input_ids.min(), input_ids.max()]).tolist()
    if low < 0 or high >= vocab_size:
        raise Fp8InputError(f"{who}: token ids must be in 0..{vocab_size - 1} (the vocabulary), got {low}..{high}")
    return batch, width
