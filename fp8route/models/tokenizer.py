"""A checkpoint folder's tokenizer (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fp8route.errors import Fp8InputError

TOKENIZER = "tokenizer.json"


def load_tokenizer(folder: str | os.PathLike[str]) -> Any:
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    path = Path(folder) / TOKENIZER
    if not path.is_file():
        raise Fp8InputError(
            f"{path.parent}: no {TOKENIZER}; text in and out needs the model's tokenizer "
            "(folders made by gguf_to_hf or copied from the Hugging Face Hub have one)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type on malformed files
        raise Fp8InputError(f"{path}: not a tokenizers file: {e}") from None
