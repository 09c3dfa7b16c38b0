// Decode-size static per-tensor FP8 linear on mma.sync (m16n8k32, e4m3; SM89 and later):
//
//     out[M, N] = (q(x) @ w^T) * in_scale * w_scale + bias,   q(x) = e4m3(clamp(x / in_scale, +-448))
//
// Compiled at run time by NVRTC (fp8_mma.py). Each warp streams 16 weight rows per row group from
// global memory straight into registers, the A fragments of its MMAs; no shared-memory staging of
// the weight and no barrier in the main loop, so every warp keeps its next loads in flight while it
// multiplies. That is what the Triton kernels could not do: their weight tiles pass through shared
// memory with a CTA-wide wait per tile (benchmarks/DECODE.md).
//
// The trick that makes 128-bit weight loads possible: a dot product does not care in which order
// it walks K, as long as both operands walk it alike. The 4 lanes of a row each load 16 contiguous
// bytes of every 64-byte chunk of K and use them as their A registers for two k32 MMAs; x is read
// from shared memory with the same permutation (16 contiguous bytes per lane and token), so lane
// (g, t) holds k = 16t..16t+15 of the chunk on both sides.
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

// 16 x values starting at p, quantized, as 16 bytes.
template <int XMODE>
__device__ __forceinline__ uint4 load_quantized(const void* p, float s, float r) {
    if (XMODE == 2) return __ldg((const uint4*)p);
    uint4 raw[2] = {__ldg((const uint4*)p), __ldg((const uint4*)p + 1)};
    const u16* h = (const u16*)raw;
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

__device__ __forceinline__ void mma_e4m3(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

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

constexpr int CHUNK = 64;  // bytes of K per lane group step: 4 lanes x 16 bytes, two k32 MMAs

// NT: token tiles of 8 (M <= 8 NT); RG: 16-row groups per warp; WARPS per CTA, all along N;
// U: 64-byte K chunks loaded per batch (two batches in flight); PROMOTE: add each batch's MMA sums
// into the fp32 accumulator separately (the tensor cores' fp8 sums keep fewer bits than fp32).
template <int NT, int RG, int WARPS, int U, int XMODE, int OUT_BF16, int HAS_BIAS, int PROMOTE>
__global__ void __launch_bounds__(WARPS * 32) fp8_mma_gemv(
    const void* __restrict__ x, const u8* __restrict__ w, void* __restrict__ out, const void* __restrict__ bias,
    float* __restrict__ ws, int* __restrict__ counters, const float* __restrict__ w_scale,
    const float* __restrict__ in_scale, int M, int N, int K, int stride_xm, int stride_om, int chunks_per_split,
    int x_row_bytes) {
    extern __shared__ __align__(16) u8 xs[];  // [NT * 8][x_row_bytes]: quantized x of this K slice
    __shared__ int arrived_last;

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int split = blockIdx.x, splits = gridDim.x, tile = blockIdx.y;
    const int c_beg = split * chunks_per_split;
    const int c_end = min(c_beg + chunks_per_split, K / CHUNK);
    const int row0 = tile * (16 * RG * WARPS) + warp * (16 * RG);

    const u8* wrow[RG][2];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int row = min(row0 + rg * 16 + h * 8 + g, N - 1);  // rows past N load row N-1, never stored
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

    // The first weight loads go out before x is staged, so their latency hides the staging.
    load(buf_a, c_beg);

    const float s = *in_scale;
    const float r = __frcp_rn(s);
    {
        const int segs = (c_end - c_beg) * (CHUNK / 16);  // 16-element segments per token row
        const int elem = XMODE == 2 ? 1 : 2;
        for (int i = threadIdx.x; i < NT * 8 * segs; i += WARPS * 32) {
            const int m = i / segs, seg = i - m * segs;
            uint4 q = make_uint4(0, 0, 0, 0);
            if (m < M) {
                const u8* p = (const u8*)x + ((size_t)m * stride_xm + (size_t)c_beg * CHUNK + seg * 16) * elem;
                q = load_quantized<XMODE>(p, s, r);
            }
            *(uint4*)(xs + m * x_row_bytes + seg * 16) = q;
        }
    }
    __syncthreads();

    float acc[RG][NT][4];
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[rg][t][j] = 0.0f;

    auto compute = [&](const uint4(&buf)[U][RG][2], int c) {
        float part[RG][NT][4];
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 4; ++j) part[rg][t][j] = 0.0f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (c + u >= c_end) break;
            const u8* xp = xs + g * x_row_bytes + (c + u - c_beg) * CHUNK + t4 * 16;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const uint4 b = *(const uint4*)(xp + t * 8 * x_row_bytes);
#pragma unroll
                for (int rg = 0; rg < RG; ++rg) {
                    const uint4 lo = buf[u][rg][0], hi = buf[u][rg][1];
                    float(&d)[4] = PROMOTE ? part[rg][t] : acc[rg][t];
                    mma_e4m3(d, lo.x, hi.x, lo.y, hi.y, b.x, b.y);
                    mma_e4m3(d, lo.z, hi.z, lo.w, hi.w, b.z, b.w);
                }
            }
        }
        if (PROMOTE)
#pragma unroll
            for (int rg = 0; rg < RG; ++rg)
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int j = 0; j < 4; ++j) acc[rg][t][j] += part[rg][t][j];
    };

    for (int c = c_beg;;) {
        load(buf_b, c + U);
        compute(buf_a, c);
        c += U;
        if (c >= c_end) break;
        load(buf_a, c + U);
        compute(buf_b, c);
        c += U;
        if (c >= c_end) break;
    }

    // Fragment (rg, t, j) holds row row0 + rg*16 + g + 8*(j >> 1), token t*8 + 2*t4 + (j & 1).
    if (splits > 1) {
        float* part = ws + (size_t)split * M * N;
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int row = row0 + rg * 16 + g + 8 * (j >> 1), m = t * 8 + 2 * t4 + (j & 1);
                    if (row < N && m < M) part[(size_t)m * N + row] = acc[rg][t][j];
                }
        __threadfence();  // every partial written and visible before the counter says so
        __syncthreads();
        if (threadIdx.x == 0) arrived_last = atomicAdd(counters + tile, 1) == splits - 1;
        __syncthreads();
        if (!arrived_last) return;
        __threadfence();
#pragma unroll
        for (int rg = 0; rg < RG; ++rg)
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int row = row0 + rg * 16 + g + 8 * (j >> 1), m = t * 8 + 2 * t4 + (j & 1);
                    float sum = 0.0f;
                    if (row < N && m < M)
                        for (int sp = 0; sp < splits; ++sp)  // split order: the bits never depend on timing
                            sum += __ldcg(ws + ((size_t)sp * M + m) * N + row);
                    acc[rg][t][j] = sum;
                }
        if (threadIdx.x == 0) counters[tile] = 0;  // ready for the next call or graph replay
    }

    const float scale = s * *w_scale;
#pragma unroll
    for (int rg = 0; rg < RG; ++rg)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = row0 + rg * 16 + g + 8 * (j >> 1), m = t * 8 + 2 * t4 + (j & 1);
                if (row >= N || m >= M) continue;
                float y = acc[rg][t][j] * scale;
                if (HAS_BIAS)
                    y += OUT_BF16 ? bf16_to_f32(((const u16*)bias)[row]) : f16_to_f32(((const u16*)bias)[row]);
                store_out(out, m * stride_om + row, y, OUT_BF16);
            }
}
