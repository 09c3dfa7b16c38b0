"""Every fp8route Triton kernel compiles for the H200 (sm_90), specialized as a GPU run specializes
it, on a machine without a GPU: benchmarks/compile_check.py reaches each kernel through its real
entry point with CPU tensors of Llama-3.1-8B's shapes, under a Triton driver that compiles to a
cubin with Triton's bundled ptxas and launches nothing.

This catches what only a GPU run caught before: a kernel that fails to compile in one of its
variants (a constexpr branch, a dtype, PDL on), or that asks for more shared memory than an SM has.
CI installs triton for it (the `triton` extra); elsewhere it is skipped without triton.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

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
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compile_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return compile_check, compile_check.compile_all()


def test_every_kernel_compiles_for_sm90_in_every_variant_the_sweep_reaches(compiled):
    compile_check, rows = compiled
    kernels = {r.kernel for r in rows}
    # Every @triton.jit kernel fp8route launches (helpers called from kernels are inlined into them).
    assert kernels == {
        "decode_mma_kernel", "decode_cuda_core_kernel", "_quantize_kernel",
        "_rms_norm_kernel", "_add_rms_norm_kernel", "_rope_kernel", "_rope_store_kernel", "_silu_mul_kernel",
        "_split_kernel", "_combine_kernel", "_chunk_max_kernel", "_row_max_kernel", "_push_add_rms_norm_kernel",
    }  # fmt: skip
    for r in rows:
        assert r.shared <= compile_check.H200_SHARED, r
        assert r.num_warps * 32 <= 1024, r


def test_nothing_compiled_here_stays_where_a_gpu_run_could_launch_it(compiled):
    compile_check, _ = compiled  # its kernels launch nothing: a GPU test after it must compile its own
    assert not any(compile_check.FAKE_DEVICE in fn.device_caches for fn in compile_check._kernel_functions())
    assert not any(launcher._compiled for launcher in compile_check._launchers())


def test_pdl_variants_wait_for_their_inputs_and_the_others_do_not(compiled):
    _, rows = compiled
    pdl = [r for r in rows if "USE_PDL=1" in r.constexprs]
    assert pdl, "the sweep compiled no kernel with PDL on"
    for r in rows:
        assert r.pdl_wait == ("USE_PDL=1" in r.constexprs), r


def test_the_decode_gemm_runs_silu_in_down_on_both_kernels_and_tensor_cores_from_16_tokens(compiled):
    _, rows = compiled
    gemm = [r for r in rows if r.kernel in ("decode_mma_kernel", "decode_cuda_core_kernel")]
    assert {r.kernel for r in gemm if "GATED=1" in r.constexprs} == {"decode_mma_kernel", "decode_cuda_core_kernel"}
    assert all(r.wgmma for r in gemm if r.kernel == "decode_mma_kernel")
    assert not any(r.wgmma for r in gemm if r.kernel == "decode_cuda_core_kernel")


def test_the_prefill_quantize_past_2_31_elements_compiles_with_64_bit_sizes(compiled):
    _, rows = compiled
    quantize = [r for r in rows if r.kernel == "_quantize_kernel"]
    assert any(r.wide_ints == ["numel"] for r in quantize) and any(not r.wide_ints for r in quantize)
