"""The fused all-reduce + RMSNorm's checks without a GPU. Its numerics: test_peer_reduce_interpreted.py
and test_peer_reduce_gpu.py."""

from __future__ import annotations

import pytest
import torch

from fp8route.errors import Fp8InputError
from fp8route.kernels.peer_reduce import push_add_rms_norm


def test_push_add_rms_norm_refuses_rows_past_its_buffer_before_any_launch():
    x = torch.zeros(9, 16, dtype=torch.bfloat16)
    with pytest.raises(Fp8InputError, match="rows <= 8"):
        push_add_rms_norm(x, x, x[0], 1e-5, torch.zeros(2, dtype=torch.int64), 0, 8, 0)
    with pytest.raises(Fp8InputError, match="phase 0 or 1"):
        push_add_rms_norm(x[:8], x[:8], x[0], 1e-5, torch.zeros(2, dtype=torch.int64), 0, 8, 2)
