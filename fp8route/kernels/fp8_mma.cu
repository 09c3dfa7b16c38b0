// Decode-size static per-tensor FP8 linear on Hopper's wgmma (sm_90a), the weight as the A operand
// straight from registers:
//
//     out[M, N] = (q(x) @ w^T) * in_scale * w_scale + bias,   q(x) = e4m3(clamp(x / in_scale, +-448))
//
// Compiled at run time by NVRTC (fp8_mma.py, which also writes the wgmma call for the token count).
// Each warpgroup streams 64 weight rows per row group from global memory into registers, the A
// fragments of its wgmmas; no shared-memory staging of the weight and no barrier in the main loop, so
// every warp keeps its next loads in flight while the tensor cores work. That is what the Triton
// kernels could not do: their weight tiles pass through shared memory with a CTA-wide wait per tile
// (benchmarks/DECODE.md). (mma.sync is no way around wgmma here: on SM90 ptxas turns its fp8 form
// into fp16 HMMAs plus conversions, 2-4x slower than our Triton kernel at M 16-64.)
//
// The trick that makes 128-bit weight loads possible: a dot product does not care in which order
// it walks K, as long as both operands walk it alike. The 4 lanes of a row each load 16 contiguous
// bytes of every 64-byte chunk of K and use them as their A registers for two k32 wgmmas; x is
// written to shared memory with the same permutation of K.
//
// x is quantized once per CTA for its K slice (bit-identical to the standalone quantizer) into
// shared memory. Split-K over CTAs writes fp32 partials; the last CTA of a row tile (a counter says
// which) sums them in split order and resets the counter: deterministic and CUDA-graph safe.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;


__device__ __forceinline__ float bf16_to_f32(u16 v) { return __uint_as_float(((u32)v) << 16); }

__device__ __forceinline__ float f16_to_f32(u16 v) {
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
    return f;
}

// RN(x / s) from r = RN(1 / s) and two FMA corrections (Markstein), as fp8_gemv.py's _quantize:
// quotients past 2^16 saturate anyway and skip the correction (inf stays inf, not NaN); so does
// zero (keeps -0).
__device__ __forceinline__ float div_rn(float x, float s, float r) {
    float q = __fmul_rn(x, r);
    float q1 = __fmaf_rn(__fmaf_rn(-q, s, x), r, q);
    float q2 = __fmaf_rn(__fmaf_rn(-q1, s, x), r, q1);
    return (fabsf(q) < 65536.0f && q != 0.0f) ? q2 : q;
}

// Two floats to two e4m3 bytes, round to nearest even, saturating to +-448 (NaN stays NaN).
__device__ __forceinline__ u32 to_e4m3x2(float lo, float hi) {
    u16 d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

// 16 x values as they sit in memory: 16 fp8 bytes, or 32 bytes of bf16/fp16.
template <int XMODE>
struct XRaw {
    uint4 v[XMODE == 2 ? 1 : 2];
};

template <int XMODE>
__device__ __forceinline__ XRaw<XMODE> load_x(const void* p) {
    XRaw<XMODE> raw;
#pragma unroll
    for (int i = 0; i < (XMODE == 2 ? 1 : 2); ++i) raw.v[i] = __ldg((const uint4*)p + i);
    return raw;
}

// The 16 values quantized, as 16 bytes.
template <int XMODE>
__device__ __forceinline__ uint4 quantize(const XRaw<XMODE>& raw, float s, float r) {
    if (XMODE == 2) return raw.v[0];
    const u16* h = (const u16*)raw.v;
    u32 out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float f[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            float v = XMODE == 0 ? bf16_to_f32(h[4 * i + j]) : f16_to_f32(h[4 * i + j]);
            f[j] = div_rn(v, s, r);
        }
        out[i] = to_e4m3x2(f[0], f[1]) | (to_e4m3x2(f[2], f[3]) << 16);
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}

// Weight bytes are read once: no L1 allocation.
__device__ __forceinline__ uint4 load_weight(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

typedef unsigned long long u64;

// A shared-memory matrix descriptor for a K-major tile without swizzle, laid out in 8-row x 16-byte
// core matrices: the next core matrix along K 128 bytes on, the next 8 rows (tokens) 256 bytes on.
__device__ __forceinline__ u64 smem_desc(const u8* p) {
    u32 addr;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(addr) : "l"(p));
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from touching accumulators while a wgmma may still write them.
__device__ __forceinline__ void fence_operand(float& v) { asm volatile("" : "+f"(v)::"memory"); }

__device__ __forceinline__ void store_out(void* out, int i, float v, bool bf16) {
    if (bf16) {
        u16 b;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(v));
        ((u16*)out)[i] = b;
    } else {
        u16 b;
        asm("{ .reg .f16 h; cvt.rn.f16.f32 h, %1; mov.b16 %0, h; }" : "=h"(b) : "f"(v));
        ((u16*)out)[i] = b;
    }
}

// d (+)= A * B for one k32 step: A the warpgroup's 64 weight rows from registers (a0..a3 as in
// mma.m16n8k32), B the x tile at desc; written per NT by fp8_mma.py (the asm operand list grows with N).
template <int NT>
__device__ void wgmma_k32(float (&d)[NT * 4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc);
WGMMA_SPECIALIZATIONS

constexpr int CHUNK = 64;  // bytes of K per step of a row's 4 lanes: 4 x 16 bytes, two k32 wgmmas

// NT: token groups of 8 (the wgmma's N is 8 * NT; wgmma_k32<NT> is written by fp8_mma.py);
// RG: 64-row groups per warpgroup; WG: warpgroups per CTA, each on its own rows, all sharing the
// CTA's quantized x; U: 64-byte K chunks per load batch (two batches in flight). Each batch's
// wgmmas sum into fresh registers, added to the fp32 accumulators after it (the tensor cores' fp8
// sums keep fewer bits than fp32; cuBLASLt's default promotes likewise).
template <int NT, int RG, int WG, int U, int XMODE, int OUT_BF16, int HAS_BIAS>
__global__ void __launch_bounds__(WG * 128) fp8_wgmma_gemv(
    const void* __restrict__ x, const u8* __restrict__ w, void* __restrict__ out, const void* __restrict__ bias,
    float* __restrict__ ws, int* __restrict__ counters, const float* __restrict__ w_scale,
    const float* __restrict__ in_scale, int M, int N, int K, int stride_xm, int stride_om, int chunks_per_split) {
    // Per (chunk, half): [NT token groups][2 core matrices along K][8 tokens][16 bytes].
    extern __shared__ __align__(128) u8 xs[];
    __shared__ int arrived_last;
    constexpr int HALF_BYTES = NT * 8 * 32;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int split = blockIdx.x, splits = gridDim.x, tile = blockIdx.y;
    const int c_beg = split * chunks_per_split;
    const int c_end = min(c_beg + chunks_per_split, K / CHUNK);
    // Warp w of warpgroup q holds rows 16w..16w+15 of each of its warpgroup's 64-row groups.
    const int row0 = tile * (64 * RG * WG) + (warp >> 2) * (64 * RG) + (warp & 3) * 16;

    const u8* wrow[RG][2];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int row = min(row0 + rg * 64 + h * 8 + g, N - 1);  // rows past N load row N-1, never stored
            wrow[rg][h] = w + (size_t)row * K + t4 * 16;
        }

    uint4 buf_a[U][RG][2], buf_b[U][RG][2];
    auto load = [&](uint4(&buf)[U][RG][2], int c) {
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c + u < c_end)
#pragma unroll
                for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                    for (int h = 0; h < 2; ++h) buf[u][rg][h] = load_weight(wrow[rg][h] + (size_t)(c + u) * CHUNK);
    };

    // The first two batches of weight loads go out before x is staged, so their latency hides the staging.
    load(buf_a, c_beg);
    load(buf_b, c_beg + U);

    const float s = *in_scale;
    const float r = __frcp_rn(s);
    {
        // Lane t's 16 bytes of a chunk are words 4t..4t+3; word i feeds wgmma i >> 1 as its A register
        // a0 (k 4t..4t+3 of that wgmma, i even) or a2 (k 16+4t.., i odd). x goes where those k are.
        // STAGE_BATCH segments per thread have their loads in flight together: one at a time, each
        // waited on before the next, the staging took longer than the weight stream at M=32.
        constexpr int STAGE_BATCH = 4;
        const int segs = (c_end - c_beg) * (CHUNK / 16);  // 16-byte segments per token
        const int total = NT * 8 * segs, step = WG * 128;
        const int elem = XMODE == 2 ? 1 : 2;
        for (int first = threadIdx.x; first < total; first += STAGE_BATCH * step) {
            XRaw<XMODE> raw[STAGE_BATCH];
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) {
                const int i = first + b * step, m = i / segs, seg = i - m * segs;
                if (i < total && m < M)
                    raw[b] = load_x<XMODE>((const u8*)x + ((size_t)m * stride_xm + (size_t)c_beg * CHUNK + seg * 16) * elem);
            }
#pragma unroll
            for (int b = 0; b < STAGE_BATCH; ++b) {
                const int i = first + b * step, m = i / segs, seg = i - m * segs;
                if (i >= total) break;
                const uint4 q = m < M ? quantize<XMODE>(raw[b], s, r) : make_uint4(0, 0, 0, 0);
                u8* base = xs + (seg >> 2) * 2 * HALF_BYTES + (m >> 3) * 256 + (m & 7) * 16 + (seg & 3) * 4;
                const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                for (int wi = 0; wi < 4; ++wi) *(u32*)(base + (wi >> 1) * HALF_BYTES + (wi & 1) * 128) = words[wi];
            }
        }
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // x, written by plain stores, read by wgmma
    __syncthreads();

    float acc[RG][NT * 4];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int j = 0; j < NT * 4; ++j) acc[rg][j] = 0.0f;

    auto compute = [&](const uint4(&buf)[U][RG][2], int c) {
        float part[RG][NT * 4];
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int j = 0; j < NT * 4; ++j) part[rg][j] = 0.0f;
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c + u >= c_end) break;
            const u8* half0 = xs + (c + u - c_beg) * 2 * HALF_BYTES;
            const u64 d0 = smem_desc(half0), d1 = smem_desc(half0 + HALF_BYTES);
#pragma unroll
            for (int rg = 0; rg < RG; ++rg) {
                const uint4 lo = buf[u][rg][0], hi = buf[u][rg][1];
                wgmma_k32<NT>(part[rg], lo.x, hi.x, lo.y, hi.y, d0);
                wgmma_k32<NT>(part[rg], lo.z, hi.z, lo.w, hi.w, d1);
            }
        }
        wgmma_commit();
        wgmma_wait_all();
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int j = 0; j < NT * 4; ++j) {
                fence_operand(part[rg][j]);
                acc[rg][j] += part[rg][j];
            }
    };

    // Two batches in flight while one is multiplied: each buffer is refilled as soon as its wgmmas end.
    for (int c = c_beg;;) {
        compute(buf_a, c);
        c += U;
        if (c >= c_end) break;
        load(buf_a, c + U);
        compute(buf_b, c);
        c += U;
        if (c >= c_end) break;
        load(buf_b, c + U);
    }

    // Accumulator j of row group rg: row row0 + rg*64 + g + 8*((j >> 1) & 1), token 8*(j >> 2) + 2*t4 + (j & 1).
#define EACH_OUTPUT                                                                                        \
    _Pragma("unroll") for (int rg = 0; rg < RG; ++rg) _Pragma("unroll") for (int j = 0; j < NT * 4; ++j) \
        if (const int row = row0 + rg * 64 + g + 8 * ((j >> 1) & 1), m = 8 * (j >> 2) + 2 * t4 + (j & 1); \
            row < N && m < M)
    if (splits > 1) {
        float* part = ws + (size_t)split * M * N;
        EACH_OUTPUT part[(size_t)m * N + row] = acc[rg][j];
        __threadfence();  // every partial written and visible before the counter says so
        __syncthreads();
        if (threadIdx.x == 0) arrived_last = atomicAdd(counters + tile, 1) == splits - 1;
        __syncthreads();
        if (!arrived_last) return;
        __threadfence();
        EACH_OUTPUT {
            float sum = 0.0f;
            for (int sp = 0; sp < splits; ++sp) sum += __ldcg(ws + ((size_t)sp * M + m) * N + row);  // split order
            acc[rg][j] = sum;
        }
        if (threadIdx.x == 0) counters[tile] = 0;  // ready for the next call or graph replay
    }

    const float scale = s * *w_scale;
    EACH_OUTPUT {
        float y = acc[rg][j] * scale;
        if (HAS_BIAS) y += OUT_BF16 ? bf16_to_f32(((const u16*)bias)[row]) : f16_to_f32(((const u16*)bias)[row]);
        store_out(out, m * stride_om + row, y, OUT_BF16);
    }
#undef EACH_OUTPUT
}
