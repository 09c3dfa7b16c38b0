"""The all-reduce choice: its names, and what a CPU process gets."""

import os

import pytest
import torch

from fp8route import Fp8InputError
from fp8route.kernels.fused import rms_norm_reference
from fp8route.models.collectives import MULTICAST_OFF, AllReduce, keep_multicast_off


def test_unknown_method_is_one_clear_error():
    with pytest.raises(Fp8InputError, match="nccl, symm_mem"):
        AllReduce(torch.device("cpu"), torch.bfloat16, 1024, "auto")


@pytest.mark.parametrize("method", ["symm_mem", "fused"])
def test_peer_memory_on_a_cpu_says_why_it_runs_nccl(method):
    reduce = AllReduce(torch.device("cpu"), torch.bfloat16, 1024, method, width=64)
    assert reduce.method == "nccl" and "not a CUDA device" in reduce.describe()


def test_a_cpu_group_names_gloo_not_nccl(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert AllReduce(torch.device("cpu"), torch.bfloat16, 1024).describe() == "gloo (the process group's own)"
    finally:
        dist.destroy_process_group()


def test_add_rms_norm_without_the_fused_path_is_the_sum_then_the_add_and_norm(monkeypatch):
    summed = []
    monkeypatch.setattr(AllReduce, "__call__", lambda self, t: summed.append(t) or 2 * t)  # as if two ranks
    reduce = AllReduce(torch.device("cpu"), torch.float32, 1024, "fused", width=8)
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    normed, total = reduce.add_rms_norm(x, r, w, 1e-5, phase=1)
    assert len(summed) == 1 and summed[0] is x  # the partial alone is summed, before the residual
    assert torch.equal(total, 2 * x + r)
    torch.testing.assert_close(normed, rms_norm_reference(2 * x + r, w, 1e-5))


def test_fused_needs_the_width_of_its_rows():
    with pytest.raises(Fp8InputError, match="width"):
        AllReduce(torch.device("cpu"), torch.bfloat16, 1024, "fused")


def test_multicast_stays_off_unless_the_user_set_it(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    keep_multicast_off()
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
