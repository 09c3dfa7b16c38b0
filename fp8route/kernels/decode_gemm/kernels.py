"""The decode GEMM's Triton kernels (see the package docstring); launched by `launch.py`."""

from __future__ import annotations

from fp8route.kernels.triton_support import tl, triton

if triton is None:  # CPU-only installs: the module imports, launch.py is never reached
    decode_mma_kernel = decode_cuda_core_kernel = None
else:
    from fp8route.kernels.pdl import wait_for_inputs
    from fp8route.kernels.quantize import dynamic_scale, quantize_e4m3

    @triton.jit
    def _store_out(acc, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS: tl.constexpr):
        y = acc * scale
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _finish(
        acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, scale, pid_k, tile, split_k,
        M, N, stride_om, offs_n, offs_m, n_mask, m_mask,
        HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr, REDUCE_UNROLL: tl.constexpr,
    ):  # fmt: skip
        """Write a [BLOCK_N, BLOCK_M] fp32 tile: directly, or as split pid_k's partial, summed by the last split."""
        if USE_WS:
            mn_mask = n_mask[:, None] & m_mask[None, :]
            mn_offs = offs_m[None, :] * N + offs_n[:, None]
            tl.store(ws_ptr + pid_k * (M * N) + mn_offs, acc, mask=mn_mask)
            # Every thread's partial must be written before the release by the counter atomic.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == split_k - 1:
                total = tl.zeros(acc.shape, dtype=tl.float32)
                # Fixed order s = 0, 1, 2 ... so the bits never depend on which CTA came last.
                for s0 in range(0, split_k, REDUCE_UNROLL):
                    for j in tl.static_range(REDUCE_UNROLL):
                        # tl.where, not mn_mask & (a scalar): Triton's interpreter refuses the latter.
                        part = tl.load(
                            ws_ptr + (s0 + j) * (M * N) + mn_offs,
                            mask=tl.where(s0 + j < split_k, mn_mask, False),
                            other=0.0,
                            cache_modifier=".cg",
                        )
                        total += part
                _store_out(total, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call / graph replay
        else:
            _store_out(acc, out_ptr, bias_ptr, scale, offs_n, offs_m, n_mask, m_mask, stride_om, HAS_BIAS)

    @triton.jit
    def out_scale(w_scale_ptr, x_scale, offs_n, n_mask, SCHEME: tl.constexpr):
        """What the fp32 sum is multiplied by on its way out: both scalars (per tensor), each row's
        weight scale times each token's (channel); nothing more for block, scaled step by step."""
        if SCHEME == 0:
            return x_scale * tl.load(w_scale_ptr)
        elif SCHEME == 1:
            return tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None] * x_scale
        else:
            return 1.0

    @triton.jit
    def token_scales(x_ptr, offs_m, m_mask, K, stride_xm, BLOCK_K: tl.constexpr):
        """Each token's dynamic scale (its row's amax over all K / 448), for the channel scheme: every
        split reads the whole row (small at decode sizes) so that no other kernel runs first, in
        BLOCK_K-wide steps (launch.py makes them wide: each step waits a load's latency)."""
        offs_k = tl.arange(0, BLOCK_K)
        amax = tl.zeros((offs_m.shape[0],), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = m_mask[None, :] & ((k + offs_k) < K)[:, None]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k + offs_k)[:, None], mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(xt.to(tl.float32)), axis=0))
        return dynamic_scale(amax)

    @triton.jit
    def block_dequantized(xt, w_scale_ptr, pid_n, group0, stride_ws, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One token's x chunk [BLOCK_K] quantized per 1x128 group and multiplied back by its group's
        scale times the tile's weight-block scale: what each fp8 weight is multiplied by (block scheme)."""
        groups = tl.reshape(xt.to(tl.float32), (BLOCK_K // 128, 128))
        s = dynamic_scale(tl.max(tl.abs(groups), axis=1))[:, None]
        q = quantize_e4m3(groups, s, tl.math.div_rn(1.0, s)).to(tl.float32)
        g = group0 + tl.arange(0, BLOCK_K // 128)
        w_scale = tl.load(w_scale_ptr + (pid_n * BLOCK_N // 128) * stride_ws + g, mask=g < stride_ws, other=0.0)
        return tl.reshape(q * (s * w_scale[:, None]), (BLOCK_K,))

    # M and split_k vary per call; specializing on them (==1, %16) would only multiply compiles.
    @triton.jit(do_not_specialize=["M", "split_k"])
    def decode_mma_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split, stride_ws,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, IMPRECISE_ACC: tl.constexpr,
        REDUCE_UNROLL: tl.constexpr, SCHEME: tl.constexpr, AMAX_K: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """SCHEME 0: per tensor, x quantized with the static in_scale. 1: per-channel weight scales
        [N], x per token. 2: 128x128 block weight scales (stride_ws per block row), x per 1x128
        group; BLOCK_K is 128, one group a step, each step's product scaled before it is added."""
        wait_for_inputs(USE_PDL)
        pid = tl.program_id(0)
        # The splits of one tile are adjacent pids: launched together, so the last one (which
        # reduces) does not wait on a split scheduled a wave later.
        pid_k = pid % split_k
        tile = pid // split_k
        # Token tiles of one weight tile are adjacent too: they run together and share its bytes
        # through L2, so BLOCK_M below M reads the weight from memory about once.
        num_m_tiles = tl.cdiv(M, BLOCK_M)
        pid_m = tile % num_m_tiles
        pid_n = tile // num_m_tiles

        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_lo = pid_k * k_per_split

        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        # x^T tile [BLOCK_K, BLOCK_M]: K-contiguous, which is what fp8 wgmma wants for its B operand.
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]
        if SCHEME == 0:
            x_scale = tl.load(in_scale_ptr)
        elif SCHEME == 1:
            x_scale = token_scales(x_ptr, offs_m, m_mask, K, stride_xm, AMAX_K)[None, :]
        else:
            x_scale = 1.0
        x_rcp = tl.math.div_rn(1.0, x_scale)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        # EVEN_K: every split covers exactly k_per_split (a multiple of BLOCK_K) inside K.
        for k in range(0, k_per_split, BLOCK_K):
            if EVEN_K:
                if EVEN_N:  # noqa: SIM108 (one load per constexpr branch)
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            else:
                k_mask = (k_lo + k + offs_k) < K
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_mask[None, :] & k_mask[:, None], other=0.0)
            if SCHEME == 2:  # this step's group: its own scales
                g_scale = dynamic_scale(tl.max(tl.abs(xt.to(tl.float32)), axis=0))[None, :]
                xq = quantize_e4m3(xt, g_scale, tl.math.div_rn(1.0, g_scale))
            elif QUANT_X:
                xq = quantize_e4m3(xt, x_scale, x_rcp)
            else:
                xq = xt
            if SCHEME == 2:
                group = (k_lo + k) // 128
                w_scale = tl.load(w_scale_ptr + (offs_n // 128) * stride_ws + group, mask=n_mask, other=0.0)
                acc += tl.dot(w, xq) * (w_scale[:, None] * g_scale)
            else:
                # Promote the tensor cores' reduced-precision fp8 accumulation to fp32 every
                # IMPRECISE_ACC elements of K (cuBLASLt's default, non fast-accum, does likewise).
                acc = tl.dot(w, xq, acc, max_num_imprecise_acc=IMPRECISE_ACC)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        _finish(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, out_scale(w_scale_ptr, x_scale, offs_n, n_mask, SCHEME),
                pid_k, tile, split_k, M, N, stride_om, offs_n, offs_m, n_mask, m_mask,
                HAS_BIAS, USE_WS, REDUCE_UNROLL)  # fmt: skip

    @triton.jit(do_not_specialize=["M", "split_k"])
    def decode_cuda_core_kernel(
        x_ptr, w_ptr, out_ptr, bias_ptr, ws_ptr, cnt_ptr, w_scale_ptr, in_scale_ptr,
        M, N, K, stride_xm, stride_wn, stride_om, split_k, k_per_split, stride_ws,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
        QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, USE_WS: tl.constexpr,
        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, REDUCE_UNROLL: tl.constexpr, NUM_STAGES: tl.constexpr,
        SCHEME: tl.constexpr, AMAX_K: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        """The same product for a few tokens (BLOCK_M <= 8) on the CUDA cores: no shared-memory staging
        of the weight and no MMA padding of the token side to 16. Each weight element is converted once
        (e4m3 -> fp32, exact) and multiplied by every token's x in fp32; the products are exact, so only
        the fp32 sums round. SCHEME as decode_mma_kernel's; for block (BLOCK_K a multiple of 128,
        BLOCK_N dividing 128) each group's x is multiplied by its scale and its block's weight scale
        before the product, so every tile row shares one weight scale per group."""
        wait_for_inputs(USE_PDL)
        pid = tl.program_id(0)
        pid_k = pid % split_k
        pid_n = pid // split_k
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        m_mask = offs_m < M
        k_lo = pid_k * k_per_split

        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + k_lo + offs_k
        if SCHEME == 0:
            x_scale = tl.load(in_scale_ptr)
        elif SCHEME == 1:
            x_scale = token_scales(x_ptr, offs_m, m_mask, K, stride_xm, AMAX_K)[None, :]
        else:
            x_scale = 1.0
        x_rcp = tl.math.div_rn(1.0, x_scale)

        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k in tl.range(0, k_per_split, BLOCK_K, num_stages=NUM_STAGES):
            if EVEN_K:
                k_mask = offs_k < BLOCK_K
                if EVEN_N:  # noqa: SIM108 (one load per constexpr branch)
                    w = tl.load(w_ptrs)
                else:
                    w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
            else:
                k_mask = (k_lo + k + offs_k) < K
                w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            w = w.to(tl.float32)
            # Token by token: a [BLOCK_N, BLOCK_M, BLOCK_K] product would spread K over the threads
            # one element each and move every operand through shared memory.
            for i in tl.static_range(BLOCK_M):
                x_mask = tl.where(i < M, k_mask, False)  # not k_mask & (i < M): see _finish
                xt = tl.load(x_ptrs + i * stride_xm, mask=x_mask, other=0.0)
                if SCHEME == 2:
                    xt = block_dequantized(xt, w_scale_ptr, pid_n, (k_lo + k) // 128, stride_ws, BLOCK_N, BLOCK_K)
                elif SCHEME == 1:
                    s = tl.sum(tl.where(offs_m[None, :] == i, x_scale, 0.0))  # the token's own scale
                    xt = quantize_e4m3(xt, s, tl.math.div_rn(1.0, s))
                elif QUANT_X:
                    xt = quantize_e4m3(xt, x_scale, x_rcp)
                part = tl.sum(w * xt.to(tl.float32)[None, :], axis=1)
                acc += tl.where(offs_m[None, :] == i, part[:, None], 0.0)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K

        _finish(acc, out_ptr, bias_ptr, ws_ptr, cnt_ptr, out_scale(w_scale_ptr, x_scale, offs_n, n_mask, SCHEME),
                pid_k, pid_n, split_k, M, N, stride_om, offs_n, offs_m, n_mask, m_mask,
                HAS_BIAS, USE_WS, REDUCE_UNROLL)  # fmt: skip
