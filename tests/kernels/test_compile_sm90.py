"""Every fp8route Triton kernel compiles for the H200 (sm_90), specialized as a GPU run specializes
it, on a machine without a GPU: fp8route/kernels/compile_check.py reaches each kernel through its real
entry point with CPU tensors of Llama-3.1-8B's, a TP2 rank's and SmolLM2-135M's shapes, under a
Triton driver that compiles to a cubin with Triton's bundled ptxas and launches nothing.

This catches what only a GPU run caught before: a kernel that fails to compile in one of its
variants (a constexpr branch, a dtype, PDL on), or that asks for more shared memory than an SM has.
CI installs triton for it (the `triton` extra); elsewhere it is skipped without triton.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

try:
    import triton  # noqa: F401
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

pytestmark = pytest.mark.skipif(
    not HAVE_TRITON and not os.environ.get("CI"), reason='needs triton (pip install -e ".[triton]")'
)


@pytest.fixture(scope="module")
def compiled():
    from fp8route.kernels import compile_check

    return compile_check, compile_check.compile_all()


def test_the_decode_gemm_sweep_takes_the_batch_sizes_the_decode_graphs_capture():
    from fp8route.engine.decode_graphs import buckets
    from fp8route.kernels import compile_check
    from fp8route.kernels.decode_gemm.configs import M_MAX

    assert tuple(m for m in buckets(4 * M_MAX) if m <= M_MAX) == compile_check.DECODE_BATCHES


def test_every_kernel_compiles_for_sm90_in_every_variant_the_sweep_reaches(compiled):
    compile_check, rows = compiled
    kernels = {r.kernel for r in rows}
    # Every @triton.jit kernel fp8route launches (helpers called from kernels are inlined into them).
    assert kernels == {
        "decode_mma_kernel", "decode_cuda_core_kernel", "_quantize_kernel",
        "_rms_norm_kernel", "_add_rms_norm_kernel", "_rope_kernel", "_rope_store_kernel", "_silu_mul_kernel",
        "_split_kernel", "_combine_kernel", "_attention_kernel", "_merge_kernel",
        "_chunk_max_kernel", "_row_max_kernel", "_push_add_rms_norm_kernel",
        "_process_kernel", "_mask_kernel", "_max_key_kernel", "_kth_kernel", "_gather_kernel", "_search_kernel",
        "_draw_kernel", "_draw_top_k_kernel", "_stats_kernel", "_stats_sum_kernel",
        "_quantize_rows_kernel", "_quantize_groups_kernel", "block_gemm_kernel",
        "fixed_gemm_kernel", "_norm_quant_kernel", "_silu_mul_quant_kernel",
    }  # fmt: skip
    for r in rows:
        assert r.shared <= compile_check.H200_SHARED, r
        assert r.num_warps * 32 <= 1024, r


def test_nothing_compiled_here_stays_where_a_gpu_run_could_launch_it(compiled):
    compile_check, _ = compiled  # its kernels launch nothing: a GPU test after it must compile its own
    assert not any(compile_check.FAKE_DEVICE in fn.device_caches for fn in compile_check._kernel_functions())
    assert not any(launcher._compiled for launcher in compile_check._launchers())


def test_pdl_variants_wait_for_their_inputs_and_the_others_do_not(compiled):
    from fp8route.kernels.options import triton_compiles_pdl

    _, rows = compiled
    pdl = [r for r in rows if "USE_PDL=1" in r.constexprs]
    assert bool(pdl) == triton_compiles_pdl(), "PDL compiled where this Triton cannot, or not where it can"
    for r in rows:
        assert r.pdl_wait == ("USE_PDL=1" in r.constexprs), r


def test_the_decode_gemm_runs_both_kernels_and_tensor_cores_from_16_tokens(compiled):
    _, rows = compiled
    gemm = [r for r in rows if r.kernel in ("decode_mma_kernel", "decode_cuda_core_kernel")]
    assert {r.kernel for r in gemm} == {"decode_mma_kernel", "decode_cuda_core_kernel"}
    assert all(r.wgmma for r in gemm if r.kernel == "decode_mma_kernel")
    assert not any(r.wgmma for r in gemm if r.kernel == "decode_cuda_core_kernel")


def test_the_prefill_quantize_past_2_31_elements_compiles_with_64_bit_sizes(compiled):
    _, rows = compiled
    quantize = [r for r in rows if r.kernel == "_quantize_kernel"]
    assert any(r.wide_ints == ["numel"] for r in quantize) and any(not r.wide_ints for r in quantize)


def test_the_fused_norms_sum_a_row_in_the_order_the_plain_norms_do(compiled):
    """The quantizing norms (fused_quantize) and rms_norm / add_rms_norm reduce a row's squares in the
    same layout at every activation dtype and width the sweep compiles, so in the same order: the
    fused codes are the unfused pair's. (An e4m3 store once set a 16-wide layout against the bf16
    kernels' 8, and 3-9 of 16.8M codes differed on an H100 at M=4096.)"""
    import re

    _, rows = compiled

    def key(r) -> tuple[str, str, str]:  # (activation dtype, BLOCK, PDL)
        return (r.constexprs.split()[0].split(":")[1], re.search(r"BLOCK=(\d+)", r.constexprs).group(1),
                re.search(r"USE_PDL=(\d)", r.constexprs).group(1))  # fmt: skip

    plain = {
        (r.kernel, *key(r)): r.row_sums[0] for r in rows if r.kernel in ("_rms_norm_kernel", "_add_rms_norm_kernel")
    }
    fused = [r for r in rows if r.kernel == "_norm_quant_kernel"]
    assert fused and all(r.row_sums for r in fused)
    for r in fused:
        base = "_add_rms_norm_kernel" if "ADD=1" in r.constexprs else "_rms_norm_kernel"
        assert r.row_sums[0] == plain[(base, *key(r))], r


def _entry_points(compile_check):
    """One launch of each DirectLauncher-launched kernel (the decode GEMM on both kernels, split and not)."""
    from fp8route.kernels import fused
    from fp8route.kernels.argmax import argmax_rows
    from fp8route.kernels.decode_gemm.launch import launch
    from fp8route.kernels.quantize import quantize_fp8

    fp8, bf16, one = torch.float8_e4m3fn, torch.bfloat16, torch.ones((), dtype=torch.float32)
    w, x = torch.empty((4096, 4096), dtype=fp8), torch.empty((1, 4096), dtype=bf16)
    x16, gate_up = torch.empty((16, 14336), dtype=bf16), torch.empty((16, 2 * 14336), dtype=bf16)
    qkv = torch.empty((2, 1, 48, 128), dtype=bf16)
    cos = torch.empty((2, 1, 128), dtype=torch.float32)
    cache = torch.empty((64, 8, 128), dtype=fp8)
    staged = torch.empty((2, 2, 8, 128), dtype=bf16)
    slots = torch.zeros(2, dtype=torch.int64)

    def rope_store(into: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        fused.rope_into_cache(qkv[:, :, 32:40], qkv[:, :, 40:], cos, cos, cache, cache.clone(), slots, (0.5, 0.5), into)

    return {
        "decode cuda-core, split-K": lambda: launch(x, w, one, one, None, bf16),
        "decode wgmma": lambda: launch(x16, torch.empty((4096, 14336), dtype=fp8), one, one, None, bf16),
        "add_rms_norm": lambda: fused.add_rms_norm(x, x.clone(), x[0], 1e-5),
        "rope": lambda: fused.rope(qkv[:, :, :32], cos, cos),
        "rope_into_cache fp8": functools.partial(rope_store, None),
        "rope_into_cache staged": functools.partial(rope_store, (staged[0], staged[1])),
        "silu_mul": lambda: fused.silu_mul(gate_up, 14336),
        "quantize": lambda: quantize_fp8(x, one),
        "argmax": lambda: argmax_rows(torch.empty((2, 128256), dtype=bf16)),
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
    return type(a) is type(b) and a == b


def test_the_direct_launch_hands_the_launcher_what_tritons_own_launch_hands_it(compiled, monkeypatch):
    """DirectLauncher calls a compiled kernel's launcher itself after the first call: with the same
    arguments Triton's JITFunction.run passes it (grid, stream, function, metadata, every argument
    in order with the constexprs), in this Triton. Outside launcher.DIRECT_VERSIONS it is not used."""
    compile_check, _ = compiled
    import triton

    from fp8route.kernels import launcher

    if not launcher.DIRECT:
        pytest.skip(f"triton {triton.__version__} is outside {launcher.DIRECT_VERSIONS}: its own launch path runs")
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    with compile_check.compile_only_sm90():
        launcher._no_launch_hooks = lambda: True  # nobody listens; compile_only_sm90 restores it
        for name, call in _entry_points(compile_check).items():
            compile_check.LAUNCHED.clear()
            call()  # through JITFunction.run: compiles, launches, and the launcher keeps the kernel
            own = list(compile_check.LAUNCHED)
            compile_check.LAUNCHED.clear()
            call()  # straight to the kernel's launcher
            direct = list(compile_check.LAUNCHED)
            assert own and len(own) == len(direct), name
            for a, b in zip(own, direct):
                assert len(a) == len(b), f"{name}: {len(a)} arguments from Triton, {len(b)} direct"
                assert all(_same(x, y) for x, y in zip(a[:6], b[:6])), name  # grid, stream, function, metadata
                assert b[6:9] == (None, None, None) and all(launcher._idle(hook) for hook in a[7:9]), name
                mismatched = [i for i, (x, y) in enumerate(zip(a[9:], b[9:])) if not _same(x, y)]
                assert not mismatched, f"{name}: arguments {mismatched} differ"


@pytest.mark.parametrize("cold", [True, False])
def test_a_cold_cache_is_filled_by_one_process_per_pass_a_warm_one_read_here(monkeypatch, cold):
    from fp8route.kernels import compile_check, options

    calls = []
    entries = iter([10, 12 if cold else 10])  # Triton's cache before and after the first pass
    monkeypatch.setattr(compile_check, "_cache_entries", lambda: next(entries))
    monkeypatch.setattr(compile_check, "_sweep_pass", lambda pdl, dtype: calls.append(("here", pdl, dtype)))
    monkeypatch.setattr(
        compile_check, "_fill_cache", lambda passes, workers: calls.append(("workers", passes, workers))
    )
    monkeypatch.setattr(options, "triton_compiles_pdl", lambda: True)
    compile_check.compile_all((torch.bfloat16, torch.float16), workers=3)
    rest = [(False, torch.float16), (True, torch.bfloat16), (True, torch.float16)]
    assert calls == [
        ("here", False, torch.bfloat16),
        *([("workers", rest, 3)] if cold else []),
        *(("here", *p) for p in rest),
    ]


def test_the_decode_gemm_compiles_each_scheme_on_both_kernels(compiled):
    _, rows = compiled
    gemm = [r for r in rows if r.kernel in ("decode_mma_kernel", "decode_cuda_core_kernel")]
    for scheme in (1, 2):  # channel, block
        kernels = {r.kernel for r in gemm if f"SCHEME={scheme}," in r.constexprs}
        assert kernels == {"decode_mma_kernel", "decode_cuda_core_kernel"}, scheme
    block = [r for r in gemm if "SCHEME=2," in r.constexprs and r.kernel == "decode_mma_kernel"]
    assert all("BLOCK_K=128," in r.constexprs for r in block)  # one 128-wide group a step
