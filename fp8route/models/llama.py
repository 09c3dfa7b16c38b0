"""A compact Llama-family decoder (Llama, Mistral, Qwen2/3): RMSNorm, RoPE, GQA attention, SwiGLU.

Module names follow Hugging Face's (`model.layers.0.self_attn.q_proj`), so checkpoint tensors
and Fp8Linear layers drop in by name; fused `qkv_proj` / `gate_up_proj` layers replace their
members. This module is the model definition and its full (no-cache) forward; attention over a
KV cache comes in through an AttentionContext (fp8route.engine.attention); the runtime that owns
the cache is fp8route.engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from fp8route.backends import custom_ops
from fp8route.errors import CheckpointError
from fp8route.kernels.fused import add_rms_norm, rms_norm, rope, silu_mul
from fp8route.kernels.fused_quantize import (
    QuantizedX,
    XQuant,
    add_rms_norm_quantized,
    fusable,
    rms_norm_quantized,
    silu_mul_quantized,
)
from fp8route.kernels.split_counters import reserve_counters
from fp8route.models.token_ids import check_token_ids
from fp8route.row_tiles import by_row_tiles

# The Hugging Face architectures this definition runs (config.json's "architectures").
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class AttentionContext(Protocol):
    """Where a layer's new K/V go and what its queries attend to (a KV cache, in prefill or decode)."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """q [B, T, H, D] and the new k, v [B, T, Hkv, D], before RoPE (cos/sin as Attention.forward
        takes them: the context applies it, fused with its cache write where it can) -> [B, H, T, D]."""
        ...


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 0  # 0: the config does not say

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], file: str = "config.json") -> LlamaConfig:
        archs = config.get("architectures") or []
        if archs and not any(a in ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"unsupported: architectures={archs} in {file}; the built-in runner knows {', '.join(ARCHITECTURES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported: hidden_act={config['hidden_act']} in {file}")
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
            if k not in config
        ]
        if missing:
            raise CheckpointError(f"{file}: missing {', '.join(missing)}")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else {})
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_key_value_heads=int(config.get("num_key_value_heads") or config["num_attention_heads"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(config.get("head_dim") or 0),
            rope_scaling=tuple(sorted(scaling.items())),
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
        )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    dim = cfg.head_size
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = dict(cfg.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((context / wavelen - low) / (high - low)).clamp(0, 1)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        return blended.float()
    if kind != "default":
        raise CheckpointError(f"unsupported: rope_scaling.rope_type={kind} in config.json")
    return inv_freq.float()


def rope_tables(cfg: LlamaConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.double()[:, None] * rope_inv_freq(cfg).double().to(positions.device)[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


XQuantOf = Callable[[int, torch.dtype], XQuant | None]  # a reading linear's x_quant: rows, dtype -> its ask


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        # The x_quant of the one FP8 linear that reads this norm's output, if any (set by the layer): its
        # backend may take x quantized here, by the norm's own kernel (the kernel option quantize_upstream).
        self.reader: XQuantOf | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedX:
        spec = x_quant_for(self.reader, x)
        return (
            rms_norm(x, self.weight, self.eps) if spec is None else rms_norm_quantized(x, self.weight, self.eps, spec)
        )

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor | QuantizedX, torch.Tensor]:
        """(self(x + residual), x + residual) in one kernel."""
        spec = x_quant_for(self.reader, x)
        if spec is None or not (residual.is_contiguous() and residual.dtype == x.dtype):
            return add_rms_norm(x, residual, self.weight, self.eps)
        return add_rms_norm_quantized(x, residual, self.weight, self.eps, spec)


def x_quant_for(reader: XQuantOf | None, x: torch.Tensor) -> XQuant | None:
    """What the reading linear asks of x where the fused kernels can run on it (None: x as it is)."""
    spec = None if reader is None else reader(x.numel() // x.shape[-1], x.dtype)
    return spec if spec is not None and fusable(x) else None


class FloatLinear(nn.Module):
    """A full-precision linear over given tensors (no copy, no init). batch_invariant: a row's result
    does not depend on the batch: on a GPU through the fixed-tile GEMM (fp8route.kernels.fixed_gemm),
    on a CPU in fixed tiles of rows (fp8route.row_tiles)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_invariant: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.batch_invariant = batch_invariant
        if batch_invariant and weight.is_cuda:
            reserve_counters(weight.device)  # the fixed-tile GEMM's split-K counters, before any graph capture

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        if not self.batch_invariant:
            return F.linear(x, weight, bias)
        rows = x.reshape(-1, x.shape[-1])
        if x.is_cuda:
            out = custom_ops.fixed_gemm(rows.contiguous(), weight, None, None, bias, x.dtype)
        else:
            out = by_row_tiles(lambda tile: F.linear(tile, weight, bias), rows)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class Parts:
    """Looks up a module's pieces by checkpoint name: an Fp8Linear if one was given, else a
    FloatLinear over the tensors."""

    def __init__(
        self,
        linears: Mapping[str, nn.Module],
        tensors: Mapping[str, torch.Tensor],
        batch_invariant: bool = False,
    ) -> None:
        self.linears, self.tensors, self.batch_invariant = linears, tensors, batch_invariant

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"tensor {name} is missing from the checkpoint")
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.linears or f"{name}.weight" in self.tensors

    def linear(self, name: str) -> nn.Module:
        if name in self.linears:
            return self.linears[name]
        return FloatLinear(self.tensor(f"{name}.weight"), self.tensors.get(f"{name}.bias"), self.batch_invariant)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, parts: Parts, prefix: str, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.index = index  # the layer's number: which KV cache slot an AttentionContext uses
        self.widths = [cfg.num_attention_heads * cfg.head_size] + [cfg.num_key_value_heads * cfg.head_size] * 2
        if parts.has(f"{prefix}.qkv_proj"):
            self.qkv_proj = parts.linear(f"{prefix}.qkv_proj")
        else:
            self.q_proj, self.k_proj, self.v_proj = (
                parts.linear(f"{prefix}.{n}") for n in ("q_proj", "k_proj", "v_proj")
            )
        self.o_proj = parts.linear(f"{prefix}.o_proj")
        # Qwen3 normalizes each head's q and k before RoPE.
        self.q_norm = (
            RMSNorm(parts.tensor(f"{prefix}.q_norm.weight"), cfg.rms_norm_eps)
            if parts.has(f"{prefix}.q_norm")
            else None
        )
        self.k_norm = (
            RMSNorm(parts.tensor(f"{prefix}.k_norm.weight"), cfg.rms_norm_eps)
            if parts.has(f"{prefix}.k_norm")
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
        partial: bool = False,
    ) -> torch.Tensor:
        """x [B, T, hidden]; cos/sin [T, D] (positions shared by every row) or [B, T, D] (each row
        at its own positions). Without a context: causal attention over x alone. partial: a
        row-parallel o_proj's own product, before its sum over the ranks (see DecoderLayer)."""
        return self.output(self.attend(x, cos, sin, context), partial)

    def project(self, x: torch.Tensor | QuantizedX) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, T, H, D], k and v [B, T, Hkv, D], before RoPE."""
        b, t, _ = x.shape
        if hasattr(self, "qkv_proj"):
            q, k, v = self.qkv_proj(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        hd = self.cfg.head_size
        q = q.reshape(b, t, -1, hd)
        k = k.reshape(b, t, -1, hd)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.reshape(b, t, -1, hd)

    def attend(
        self,
        x: torch.Tensor | QuantizedX,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
    ) -> torch.Tensor:
        """The attention's output for x [B, T, hidden], before o_proj: [B, H, T, D]."""
        q, k, v = self.project(x)
        if context is not None:
            return context.attend(self.index, q, k, v, cos, sin)
        q, k, v = rope(q, cos, sin), rope(k, cos, sin), v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def output(self, out: torch.Tensor, partial: bool = False) -> torch.Tensor:
        """o_proj of the attention's output [B, H, T, D] -> [B, T, hidden]."""
        b, _, t, _ = out.shape
        o_proj = cast(nn.Module, self.o_proj.linear) if partial else self.o_proj
        return o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: LlamaConfig, parts: Parts, prefix: str) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        if parts.has(f"{prefix}.gate_up_proj"):
            self.gate_up_proj = parts.linear(f"{prefix}.gate_up_proj")
        else:
            self.gate_proj, self.up_proj = parts.linear(f"{prefix}.gate_proj"), parts.linear(f"{prefix}.up_proj")
        self.down_proj = parts.linear(f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor | QuantizedX, partial: bool = False) -> torch.Tensor:
        """partial: a row-parallel down_proj's own product, before its sum over the ranks."""
        down = cast(nn.Module, self.down_proj.linear) if partial else self.down_proj
        if hasattr(self, "gate_up_proj"):
            gate_up = self.gate_up_proj(x)
            spec = x_quant_for(getattr(down, "x_quant", None), gate_up)
            if spec is not None and spec.scheme != "channel":  # per token, no pass would be saved
                return down(silu_mul_quantized(gate_up, self.intermediate, spec))
            return down(silu_mul(gate_up, self.intermediate))
        assert isinstance(x, torch.Tensor), "a norm quantizes only for a fused gate_up_proj"
        return down(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, parts: Parts, prefix: str, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(parts.tensor(f"{prefix}.input_layernorm.weight"), cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, parts, f"{prefix}.self_attn", index)
        self.post_attention_layernorm = RMSNorm(
            parts.tensor(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps
        )
        self.mlp = Mlp(cfg, parts, f"{prefix}.mlp")
        self.input_layernorm.reader = getattr(getattr(self.self_attn, "qkv_proj", None), "x_quant", None)
        self.post_attention_layernorm.reader = getattr(getattr(self.mlp, "gate_up_proj", None), "x_quant", None)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: AttentionContext | None = None
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, context)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_normed(
        self,
        normed: torch.Tensor | QuantizedX,
        residual: torch.Tensor,
        next_norm: RMSNorm,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: AttentionContext | None = None,
    ) -> tuple[torch.Tensor | QuantizedX, torch.Tensor]:
        """forward with each residual add fused into the norm after it: takes
        (input_layernorm(x), x), returns (next_norm(out), out) where out is forward(x).

        A row-parallel o_proj or down_proj (tensor parallelism) offers its own add_rms_norm, which
        sums the ranks' products before the add, or with it in one kernel."""
        return self.after_attention(self.self_attn.attend(normed, cos, sin, context), residual, next_norm)

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, next_norm: RMSNorm
    ) -> tuple[torch.Tensor | QuantizedX, torch.Tensor]:
        """The rest of forward_normed from the attention's output [B, H, T, D]: o_proj, the residual
        add and norm, the MLP, its add and next_norm -> (next_norm(out), out)."""
        attn_add_norm = getattr(self.self_attn.o_proj, "add_rms_norm", None)
        attn = self.self_attn.output(out, partial=attn_add_norm is not None)
        post = self.post_attention_layernorm
        normed, h = attn_add_norm(attn, residual, post.weight, post.eps) if attn_add_norm else post.add(attn, residual)
        mlp_add_norm = getattr(self.mlp.down_proj, "add_rms_norm", None)
        mlp = self.mlp(normed, partial=mlp_add_norm is not None)
        return mlp_add_norm(mlp, h, next_norm.weight, next_norm.eps) if mlp_add_norm else next_norm.add(mlp, h)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, parts: Parts) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(parts.tensor("model.embed_tokens.weight"), freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, parts, f"model.layers.{i}", i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(parts.tensor("model.norm.weight"), cfg.rms_norm_eps)

    def run_layers(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: AttentionContext | None = None
    ) -> torch.Tensor:
        """norm(every layer applied to h): each layer's residual adds fused into the norms after them."""
        layers = cast("list[DecoderLayer]", list(self.layers))
        normed = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            next_norm = self.norm if i == len(layers) - 1 else layers[i + 1].input_layernorm
            normed, h = layer.forward_normed(normed, h, next_norm, cos, sin, context)
        assert isinstance(normed, torch.Tensor), "the final norm feeds no FP8 linear"
        return normed


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        linears: Mapping[str, nn.Module],
        tensors: Mapping[str, torch.Tensor],
        batch_invariant: bool = False,
    ) -> None:
        """batch_invariant: the float linears (lm_head, a bf16 checkpoint's) computed so that a row's
        result does not depend on its batch, for the deterministic mode; the FP8 linears given are
        planned for it by their own policy."""
        super().__init__()
        self.cfg = cfg
        parts = Parts(linears, tensors, batch_invariant)
        self.model = LlamaModel(cfg, parts)
        if parts.has("lm_head"):
            self.lm_head = parts.linear("lm_head")
        elif cfg.tie_word_embeddings:
            self.lm_head = FloatLinear(self.model.embed_tokens.weight, batch_invariant=batch_invariant)
        else:
            raise CheckpointError("lm_head.weight is missing and tie_word_embeddings is false in config.json")

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] for token ids [B, T], computed in dtype (default: the embedding's)."""
        check_token_ids("model(input_ids)", input_ids, self.cfg.vocab_size, self.cfg.max_position_embeddings)
        return self.logits(input_ids, dtype)

    def logits(
        self, input_ids: torch.Tensor, dtype: torch.dtype | None = None, context: AttentionContext | None = None
    ) -> torch.Tensor:
        """forward without the check of input_ids (for callers that made it); context: the layers'
        attention (default: causal over input_ids alone)."""
        h = self.model.embed_tokens(input_ids)
        h = h.to(dtype or h.dtype)
        cos, sin = rope_tables(self.cfg, torch.arange(input_ids.shape[-1], device=input_ids.device))
        return self.lm_head(self.model.run_layers(h, cos, sin, context))
