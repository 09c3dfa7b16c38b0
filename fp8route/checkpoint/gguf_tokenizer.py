"""The tokenizer a GGUF file carries, rebuilt as a Hugging Face `tokenizers.Tokenizer`.

A llama.cpp GGUF stores its tokenizer as metadata: the vocabulary (`tokenizer.ggml.tokens`), the
BPE merges, each token's type (normal, control, user-defined, ...), the special ids and a name for
the pre-tokenizer regex (`tokenizer.ggml.pre`). This module turns that back into the tokenizer.json
and tokenizer_config.json a Hugging Face folder has, so a model converted by `gguf_to_hf` is
evaluated on the tokens it was trained on. Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`,
the GPT-2 / SmolLM / Llama 3 / Qwen family) is built; SentencePiece vocabularies are refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fp8route.errors import CheckpointError, Fp8InputError

# llama.cpp's token types (llama_token_type in llama.h).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# The GPT-2 split: contractions, letter runs, number runs, punctuation runs, whitespace.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# tokenizer.ggml.pre -> (split digits one by one first, the split regex), as llama.cpp's
# llama-vocab.cpp maps them. "smollm" and the StarCoder family split every digit, then GPT-2's regex.
_PRE = {
    "default": (False, GPT2_SPLIT),
    "gpt2": (False, GPT2_SPLIT),
    "gpt-2": (False, GPT2_SPLIT),
    "smollm": (True, GPT2_SPLIT),
    "starcoder": (True, GPT2_SPLIT),
    "refact": (True, GPT2_SPLIT),
    "codeshell": (True, GPT2_SPLIT),
    "llama3": (False, LLAMA3_SPLIT),
    "llama-bpe": (False, LLAMA3_SPLIT),
    "qwen2": (False, QWEN2_SPLIT),
}


def build_tokenizer(metadata: Mapping[str, Any], source: str = "GGUF file") -> Any:
    """A `tokenizers.Tokenizer` equal to the one the GGUF metadata describes.

    Byte-level BPE: the pre-tokenizer regex tokenizer.ggml.pre names, then bytes mapped to
    printable characters (GPT-2's table, which the stored vocabulary is spelled in), the merges in
    rank order, control tokens added as special tokens (never split, skipped on decode) and
    user-defined ones as added tokens. A BOS is prepended only if tokenizer.ggml.add_bos_token says so.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"unsupported: tokenizer.ggml.model={kind!r} in {source}; only byte-level BPE ('gpt2') is rebuilt"
        )
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(metadata.get("tokenizer.ggml.merges") or [])
    if not tokens or not merges:
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing or empty")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise CheckpointError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in _PRE:
        raise CheckpointError(f"unsupported: tokenizer.ggml.pre={pre!r} in {source}; known: {', '.join(sorted(_PRE))}")
    split_digits, regex = _PRE[pre]

    vocab = {token: i for i, token in enumerate(tokens)}
    bad = next((m for m in merges if len(m.split(" ", 1)) != 2), None)
    if bad is not None:
        raise CheckpointError(f"{source}: merge {bad!r} is not two tokens separated by a space")
    pairs = [(left, right) for left, right in (m.split(" ", 1) for m in merges)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ]
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()

    added = [
        AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tokenizer.add_special_tokens([a for a in added if a.special])
    tokenizer.add_tokens([a for a in added if not a.special])

    bos = _token(metadata, tokens, "bos", source)
    if metadata.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def tokenizer_config(metadata: Mapping[str, Any], source: str = "GGUF file") -> dict[str, Any]:
    """tokenizer_config.json's content: the chat template and the special tokens by string."""
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get("llama.context_length", 2048)),
    }
    for role in ("bos", "eos", "unk"):
        config[f"{role}_token"] = _token(metadata, tokens, role, source)
    config["pad_token"] = _token(metadata, tokens, "padding", source)
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config


def write_tokenizer(
    metadata: Mapping[str, Any], folder: str | os.PathLike[str], source: str = "GGUF file"
) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into folder; returns the paths written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(metadata, source)
    tokenizer.save(str(folder / "tokenizer.json"))
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps(tokenizer_config(metadata, source), indent=2) + "\n")
    return [folder / "tokenizer.json", config_path]


def _token(metadata: Mapping[str, Any], tokens: Sequence[str], role: str, source: str) -> str | None:
    key = f"tokenizer.ggml.{role}_token_id" if role != "unk" else "tokenizer.ggml.unknown_token_id"
    if key not in metadata:
        return None
    i = int(metadata[key])
    if not 0 <= i < len(tokens):
        raise CheckpointError(f"{source}: {key}={i} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[i]


def apply_chat_template(
    template_or_config: str | Mapping[str, Any] | os.PathLike[str],
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
) -> str:
    """Render a chat the way Hugging Face's apply_chat_template does (sandboxed Jinja, blocks
    trimmed), from a template string, a tokenizer_config dict, or a path to tokenizer_config.json
    (or its folder). bos_token / eos_token are available to the template when the config names them.
    """
    config: Mapping[str, Any]
    if isinstance(template_or_config, os.PathLike):
        path = Path(template_or_config)
        path = path / "tokenizer_config.json" if path.is_dir() else path
        if not path.is_file():
            raise Fp8InputError(f"{path}: no tokenizer_config.json to read a chat template from")
        config = json.loads(path.read_text())
    elif isinstance(template_or_config, str):
        config = {"chat_template": template_or_config}
    else:
        config = template_or_config
    template = config.get("chat_template")
    if isinstance(template, list):  # the named-templates form: [{"name": "default", "template": ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if not template:
        raise Fp8InputError("no chat_template: the tokenizer config has none (the GGUF had no tokenizer.chat_template)")
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise Fp8InputError("rendering a chat template needs jinja2: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise Fp8InputError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            bos_token=config.get("bos_token") or "",
            eos_token=config.get("eos_token") or "",
        )
    except TemplateError as e:
        raise Fp8InputError(f"chat template does not render: {e}") from None
