"""kv_cache_dtype="fp8" on CPU: the pool holds e4m3 (twice the tokens per byte), writes quantize and
reads dequantize within e4m3's rounding, and the engine's greedy decode over it stays close to the
fp32 full forward (a stated bound, not exact tokens: the cache rounds K and V to 3 mantissa bits).
The Triton paths are tests/gpu/test_fp8_kv_gpu.py."""

import argparse

import pytest
import torch
from checkpoint_helpers import TINY, llama_tensors
from helpers import build_lm, generate_with_logits

from fp8route import Fp8InputError
from fp8route.engine import CausalLM, EngineConfig
from fp8route.engine.attention import gather_rows
from fp8route.engine.config import check_setting, sweep_values
from fp8route.engine.kv_pool import KVPool
from fp8route.engine.kv_quant import FP8_KV, KVScales, dequantize_kv, quantize_kv
from fp8route.engine.sampling import SamplingParams
from fp8route.models import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig.from_hf(TINY)
TENSORS = {k: v.float() for k, v in llama_tensors().items()}
E4M3_STEP = 2.0**-3  # 3 mantissa bits: a normal value rounds within half of this, relative


def scales(k: float = 0.02, v: float = 0.01) -> KVScales:
    return KVScales((k,) * CFG.num_hidden_layers, (v,) * CFG.num_hidden_layers, "test")


def test_an_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_bytes():
    dims = (CFG.num_hidden_layers, 16, CFG.num_key_value_heads, CFG.head_size)
    bf16, fp8 = KVPool.bytes_per_block(*dims, torch.bfloat16), KVPool.bytes_per_block(*dims, FP8_KV)
    assert bf16 == 2 * fp8
    budget = 1 << 20
    cpu = torch.device("cpu")
    pools = {
        s is not None: KVPool(dims[0], 1 + budget // per, 16, *dims[2:], 4, 64, torch.bfloat16, cpu, s)
        for s, per in ((None, bf16), (scales(), fp8))
    }
    assert pools[True].dtype == FP8_KV and pools[False].dtype == torch.bfloat16
    assert pools[True].capacity_tokens == 2 * pools[False].capacity_tokens
    assert pools[True].nbytes <= budget + fp8 and pools[False].nbytes <= budget + bf16
    # What a decode step reads per cached position (the benches' floors count it): a block's worth / 16.
    assert pools[False].bytes_per_token == bf16 // 16 == 2 * pools[True].bytes_per_token


def test_quantize_round_trip_is_within_e4m3_rounding_and_saturates():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3
    scale = 0.05  # |x| / scale: up to ~250, all in e4m3's normal range but for a few near 0
    back = dequantize_kv(quantize_kv(x, scale), scale, torch.float32)
    normal = x.abs() / scale >= 2.0**-6
    assert ((back - x).abs()[normal] <= x.abs()[normal] * E4M3_STEP / 2).all()
    assert ((back - x).abs()[~normal] <= scale * 2.0**-10).all()  # subnormals: absolute steps of 2^-9
    big = dequantize_kv(quantize_kv(torch.tensor([1e4, -1e4]), 1.0), 1.0, torch.float32)
    assert big.tolist() == [448.0, -448.0]  # saturated, never NaN


def test_pool_stores_quantized_and_gathers_dequantized():
    pool = KVPool(2, 9, 4, 2, 16, 2, 32, torch.float32, torch.device("cpu"), scales(0.01, 0.004))
    pool.set_rows([0], [[3, 7]])
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(6, 2, 16, generator=g), 0.3 * torch.randn(6, 2, 16, generator=g)
    slots = pool.slots(torch.zeros(6, dtype=torch.long), torch.arange(6))
    pool.store(1, slots, k, v)
    assert pool.k.dtype == FP8_KV and not pool.k[0].float().any()  # layer 0 untouched
    k_rows, v_rows = gather_rows(pool, 1, torch.tensor([0]), 2)  # [1, Hkv, 8, D] in the model's dtype
    assert k_rows.dtype == torch.float32
    assert torch.equal(k_rows[0, :, :6].transpose(0, 1), dequantize_kv(quantize_kv(k, 0.01), 0.01, torch.float32))
    torch.testing.assert_close(v_rows[0, :, :6].transpose(0, 1), v, rtol=E4M3_STEP / 2, atol=0.004 * 2.0**-9)


def reference_logits(tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """The fp32 full forward's next-token logits at each generated step, on the same tokens."""
    reference = LlamaForCausalLM(CFG, {}, TENSORS)
    with torch.no_grad():
        full = reference(tokens)
    return full[:, prompt - 1 : -1]


def tiny(kv_scales: KVScales, **settings) -> CausalLM:
    config = EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=64, **settings)
    return build_lm(CFG, {}, TENSORS, config, kv_scales=kv_scales)


@pytest.mark.parametrize("kv_scales", [scales(), KVScales.ones(CFG.num_hidden_layers)])
def test_generate_over_fp8_kv_stays_within_its_bound_of_the_fp32_forward(kv_scales):
    model = tiny(kv_scales)
    assert model.engine.kv_cache.dtype == FP8_KV
    ids = torch.randint(0, TINY["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    tokens, logits = generate_with_logits(model, ids, 16)
    ref = reference_logits(tokens, 9)
    # Bound: K and V rounded to e4m3 (relative step 1/8) move the tiny model's logits by ~0.3% here;
    # 2% allows ~6x that, and the argmax must agree on nearly every step.
    assert ((logits - ref).norm() / ref.norm()).item() < 2e-2
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95
    assert not torch.equal(logits, ref)  # the cache really rounds


def test_engine_with_chunked_prefill_and_prefix_hits_over_fp8_kv():
    """Continuation chunks and prefix-cache hits read K/V back from the fp8 cache."""
    engine = tiny(scales(), num_kv_blocks=80, block_size=4, max_num_batched_tokens=8).engine
    g = torch.Generator().manual_seed(2)
    shared = torch.randint(0, TINY["vocab_size"], (12,), generator=g).tolist()
    prompts = [shared + torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for n in (3, 9, 5)]
    params = SamplingParams(max_tokens=8, temperature=0)
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished:
        engine.step()
    assert engine.leaked() is None and sum(r.num_cached_tokens for r in requests) > 0
    agree = total = 0
    for request in requests:
        tokens = torch.tensor([request.token_ids])
        with torch.no_grad():
            ref = LlamaForCausalLM(CFG, {}, TENSORS)(tokens)[0, len(request.prompt_token_ids) - 1 : -1].argmax(-1)
        agree += int((ref == tokens[0, len(request.prompt_token_ids) :]).sum())
        total += len(request.output_token_ids)
    assert agree >= 0.95 * total  # the same bound on top-1 agreement, along each request's own tokens


def test_bad_kv_cache_dtypes_are_refused_in_one_line():
    with pytest.raises(Fp8InputError, match=r"^kv_cache_dtype must be one of auto, fp8, got 'int8'$"):
        check_setting("kv_cache_dtype", "int8")
    with pytest.raises(Fp8InputError, match="--kv-cache-dtype must be one of auto, fp8"):
        check_setting("kv_cache_dtype", "fp8_e5m2", "--kv-cache-dtype")

    def arms(text: str) -> list[str]:
        return sweep_values(argparse.Namespace(kv_cache_dtype=text), "kv_cache_dtype")

    assert arms(" fp8,auto,fp8") == ["fp8", "auto"]
    with pytest.raises(Fp8InputError, match=r"--kv-cache-dtype ',': one or more of auto, fp8"):
        arms(",")
    with pytest.raises(Fp8InputError, match="layers of scales"):
        KVPool(3, 4, 4, 2, 16, 1, 16, torch.float32, torch.device("cpu"), scales())


def test_llm_with_an_fp8_kv_cache_says_so_and_generates(tmp_path, capsys):
    from checkpoint_helpers import text_model_folder

    from fp8route import LLM

    folder = text_model_folder(tmp_path / "m")
    llm = LLM(folder, max_num_seqs=4, max_num_batched_tokens=32, device="cpu", kv_cache_dtype="fp8", num_kv_blocks=33)
    line = [s for s in capsys.readouterr().err.splitlines() if "KV cache" in s][0]
    assert "512 tokens (32 blocks of 16, 0.00 GiB float8_e4m3fn)" in line
    out = llm.generate(["the theme"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(Fp8InputError, match="kv_cache_dtype must be one of auto, fp8"):
        LLM(folder, device="cpu", kv_cache_dtype="float8")
