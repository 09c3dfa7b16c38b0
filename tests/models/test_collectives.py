"""The all-reduce choice: its names, and what a CPU process gets."""

import os

import pytest
import torch

from fp8route import Fp8InputError
from fp8route.models.collectives import MULTICAST_OFF, AllReduce, keep_multicast_off


def test_unknown_method_is_one_clear_error():
    with pytest.raises(Fp8InputError, match="nccl, symm_mem"):
        AllReduce(torch.device("cpu"), torch.bfloat16, 1024, "auto")


def test_symm_mem_on_a_cpu_says_why_it_runs_nccl():
    reduce = AllReduce(torch.device("cpu"), torch.bfloat16, 1024, "symm_mem")
    assert reduce.method == "nccl" and "not a CUDA device" in reduce.describe()


def test_multicast_stays_off_unless_the_user_set_it(monkeypatch):
    for name in MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    keep_multicast_off()
    assert {name: os.environ[name] for name in MULTICAST_OFF} == MULTICAST_OFF
