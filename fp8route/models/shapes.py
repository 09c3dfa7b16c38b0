"""The linear-layer GEMM shapes of a model on one tensor-parallel rank, and the configs of the
models fp8route knows by name.

Column-parallel layers (qkv, gate_up) split N across ranks; row-parallel ones (o, down) split K.
KV heads are replicated when there are more ranks than KV heads, as vLLM and SGLang do.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fp8route.errors import Fp8InputError


@dataclass(frozen=True)
class LayerShape:
    name: str
    n: int
    k: int

    @property
    def label(self) -> str:
        size = f"{self.n}x{self.k}"
        return size if self.name == size else f"{self.name} {size}"


@dataclass(frozen=True)
class ProjectionDims:
    """The sizes of a dense decoder's projections (what the GEMM shapes depend on)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_hf(cls, config: dict[str, object], where: str = "config.json") -> ProjectionDims:
        """From a Hugging Face config.json (Llama, Mistral, Qwen2 and other dense GQA models)."""
        missing = [key for key in ("hidden_size", "intermediate_size", "num_attention_heads") if key not in config]
        if missing:
            raise Fp8InputError(
                f"{where}: lacks {', '.join(missing)}; fp8route reads dense decoder configs (Llama-style)"
            )
        hidden = _size(config, "hidden_size", where)
        heads = _size(config, "num_attention_heads", where)
        kv_heads = _size(config, "num_key_value_heads", where, default=heads)
        head_dim = _size(config, "head_dim", where, default=hidden // heads)
        intermediate = _size(config, "intermediate_size", where)
        return cls(hidden, intermediate, heads, kv_heads, head_dim)


def _size(config: dict[str, object], key: str, where: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise Fp8InputError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


_LLAMA_31 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "head_dim": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
# Hugging Face config.json of the models known by name (the dimensions of the public checkpoints).
MODELS: dict[str, dict[str, object]] = {
    "llama-3.1-8b": {
        **_LLAMA_31,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
    },
    "llama-3.1-70b": {
        **_LLAMA_31,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
    },
}


def llama_shapes(config: ProjectionDims, tp: int = 1) -> list[LayerShape]:
    """qkv, o, gate_up and down of one decoder layer on one of `tp` ranks."""
    if tp < 1:
        raise Fp8InputError(f"tensor parallel size must be >= 1, got {tp}")
    for what, count in (("attention heads", config.heads), ("intermediate size", config.intermediate)):
        if count % tp:
            raise Fp8InputError(f"{what} {count} do not split over tp={tp} ranks; pick a tp that divides it")
    if config.kv_heads >= tp and config.kv_heads % tp:
        raise Fp8InputError(f"{config.kv_heads} KV heads do not split over tp={tp} ranks")
    if config.kv_heads < tp and tp % config.kv_heads:
        raise Fp8InputError(f"{config.kv_heads} KV heads cannot be replicated evenly over tp={tp} ranks")
    heads = config.heads // tp
    kv_heads = max(1, config.kv_heads // tp)
    q_width = config.heads * config.head_dim
    return [
        LayerShape("qkv_proj", (heads + 2 * kv_heads) * config.head_dim, config.hidden),
        LayerShape("o_proj", config.hidden, q_width // tp),
        LayerShape("gate_up_proj", 2 * config.intermediate // tp, config.hidden),
        LayerShape("down_proj", config.hidden, config.intermediate // tp),
    ]


def model_shapes(model: str, tp: int = 1) -> list[LayerShape]:
    """Shapes of a known model name, a config.json, or a directory holding one."""
    known = MODELS.get(model.strip().lower())
    if known is not None:
        config = ProjectionDims.from_hf(known, model)
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise Fp8InputError(
                f"unknown model {model!r}: give one of {', '.join(MODELS)}, a config.json or the folder holding one"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise Fp8InputError(f"{path}: cannot read it as JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise Fp8InputError(f"{path}: expected a JSON object")
        # Multimodal configs nest the language model's config.
        text = raw.get("text_config")
        config = ProjectionDims.from_hf(text if isinstance(text, dict) else raw, str(path))
    return llama_shapes(config, tp)


def parse_shapes(text: str) -> list[LayerShape]:
    """'6144x4096,4096x14336' -> shapes named by their size."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        try:
            n, k = (int(p) for p in parts)
        except ValueError:
            raise Fp8InputError(f"shape {item.strip()!r}: expected NxK, e.g. 6144x4096") from None
        if n <= 0 or k <= 0:
            raise Fp8InputError(f"shape {item.strip()!r}: N and K must be positive")
        shapes.append(LayerShape(f"{n}x{k}", n, k))
    return shapes


def unique_shapes(shapes: list[LayerShape]) -> list[LayerShape]:
    seen: set[tuple[int, int]] = set()
    out = []
    for s in shapes:
        if (s.n, s.k) not in seen:
            seen.add((s.n, s.k))
            out.append(s)
    return out
