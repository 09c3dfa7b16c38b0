"""What a tensor-parallel rank reads of channel and block scales, and the splits that would cut a block:
pure, from a Slicer (the two-process runs are tests/models/test_parallel.py)."""

from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TINY, scheme_llama, write_checkpoint

from fp8route import CheckpointError, load_checkpoint
from fp8route.checkpoint.formats import compressed_tensors, modelopt
from fp8route.checkpoint.layout import layout
from fp8route.checkpoint.sharding import ScaleSlices
from fp8route.checkpoint.shards import ShardSet, TensorInfo
from fp8route.models.llama import LlamaConfig
from fp8route.models.parallel import Shard, Slicer

# q 256 rows, one KV head of 128, gate/up 512 rows, down 512 columns, o 256 columns: whole blocks over 2 ranks.
BLOCK_TP = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 512}
FP8 = torch.float8_e4m3fn


def test_a_split_that_cuts_a_block_is_refused_before_any_tensor_is_read(tmp_path, monkeypatch):
    config = {**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    tensors = scheme_llama("block", config)
    qc = compressed_tensors.quantization_config(["lm_head"], scheme="block")
    folder = write_checkpoint(tmp_path / "block", tensors, {**config, "quantization_config": qc})
    monkeypatch.setattr(ShardSet, "read", lambda *args, **kwargs: pytest.fail("a tensor was read"))
    slicer = Slicer.of(LlamaConfig.from_hf(config), Shard(0, 2))  # KV heads of 64 dims, one a rank
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder, device="cpu", slices=slicer)
    assert str(info.value) == (
        "tensor parallel: cannot split model.layers.0.self_attn.k_proj: each rank would hold 64 of its 128 output "
        "rows (N) (this rank [0:64]), not a multiple of 128; quantization_config.config_groups.group_0.weights."
        "strategy=block in config.json scales the weight in 128x128 blocks, one scale per block, so a rank's part "
        "must be whole blocks (use a tensor parallel size that gives every rank a multiple of 128, or a per-tensor "
        "or per-channel checkpoint)"
    )


def headers(tensors: dict[str, torch.Tensor]) -> ShardSet:
    """The shard headers of tensors, without a file: what layout() reads."""
    dtype = {FP8: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}
    infos = {n: TensorInfo(n, "model.safetensors", dtype[t.dtype], tuple(t.shape)) for n, t in tensors.items()}
    return ShardSet(Path("x"), ("model.safetensors",), infos)


Q_PROJ, O_PROJ = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


@pytest.mark.parametrize(
    ("scheme", "config", "shape", "q_scale", "o_scale"),
    [
        ("channel", TINY, None, (slice(32, 64),), None),  # rank 1's 32 q rows; o's rows all stay
        ("block", BLOCK_TP, None, (slice(1, 2),), (slice(None), slice(1, 2))),  # 128 q rows, 128 o columns
        ("block", BLOCK_TP, lambda s: s[:, None, :, None], (slice(1, 2),), (slice(None), slice(None), slice(1, 2))),
    ],
    ids=["channel", "block", "modelopt-block"],
)
def test_scale_slices_follow_the_weights_part(scheme, config, shape, q_scale, o_scale):
    tensors = scheme_llama(scheme, config, scale_shape=shape)
    qc = compressed_tensors.quantization_config(["lm_head"], scheme=scheme)
    parsed = compressed_tensors.parse(qc)
    if shape is not None:
        parsed = modelopt.parse_hf_quant_config(
            {"quantization": {"quant_algo": "FP8_PB_WO", "exclude_modules": ["lm_head"]}}
        )
    slicer = Slicer.of(LlamaConfig.from_hf(config), Shard(1, 2))
    slices = ScaleSlices(slicer, layout(headers(tensors), parsed))
    assert slices.get(f"{Q_PROJ}.weight_scale") == q_scale and slices.get(f"{O_PROJ}.weight_scale") == o_scale
    for name in (f"{Q_PROJ}.weight", f"{O_PROJ}.weight", "model.norm.weight"):
        assert slices.get(name) == slicer.get(name)
