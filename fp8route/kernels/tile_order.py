"""The order GEMM programs take their output tiles in: the same for every Triton GEMM of fp8route."""

from __future__ import annotations

from fp8route.kernels.triton_support import tl, triton

if triton is not None:

    @triton.jit
    def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Program pid's (token block, weight column block): GROUP_M token blocks walk the weight's column
        blocks together, so the column blocks they share are read from L2, not from memory, again."""
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_size = tl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (pid % in_group) % group_size, (pid % in_group) // group_size
