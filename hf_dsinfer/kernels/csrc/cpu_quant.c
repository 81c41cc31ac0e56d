/* Weight-only int8 matrix-vector kernel for x86 CPUs with AVX-512 (VNNI, BF16).
 *
 * Built on first use by hf_dsinfer/kernels/_native.py (gcc, -O3, OpenMP against the libgomp that
 * torch already loaded) and called through ctypes. The kernel streams the weight once per call
 * and compute M <= a few rows of x against it: the decode-time shape, bound by memory bandwidth.
 * The weight-only numerics are kept: x is never rounded below what the result can show.
 *
 * int8 (hfd_int8_gemv): y[m, n] = scale[n] * sum_k x[m, k] * in_scale[k] * q[n, k] + bias[n]
 *   q is the row-major [N, K] int8 weight as stored, rowsum[n] = sum_k q[n, k].
 *   Each row of x (times in_scale) becomes 24-bit fixed point relative to its absmax, offset to
 *   unsigned and split into three byte planes; vpdpbusd multiplies a plane (u8) by the weights
 *   (s8) with exact int32 sums, the planes combine in int64 and the offset is removed with the
 *   row sum. 24 bits keep every x element within 2^-16 of the row's absmax exactly (a bf16 x has
 *   8 significant bits), so the result is as accurate as an fp32 dot product.
 *
 * No int4 kernel lives here: a bf16-dot-product int4 kernel (nibbles turned into bf16 by vpermw,
 * vdpbf16ps, per-group scales) ran at the speed of torch's _weight_int4pack_mm_for_cpu at one row
 * (0.39-0.44 ms for a 5632 x 2048 weight, groups 32-128) and slower above, so int4 stays on
 * torch's kernel (see kernels/quant.py).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define ROWS 4 /* weight rows streamed together by one thread */
/* Bytes ahead of the current column that each row is prefetched: from DRAM (weights cycled past
   the L3) a 5632 x 2048 int8 matrix streamed at 14.6 GB/s without, 17.3 GB/s with 1024 (512:
   16.0, 2048: 15.5), 19.1 GB/s with 1024 and transparent huge pages. */
#define PREFETCH 1024

static inline float load_f32(const void *p, int64_t i, int dt) {
    if (dt == DT_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    if (dt == DT_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return _cvtsh_ss(h);
}

/* 16 elements of x from element i on (masked lanes read as 0), as fp32 */
static inline __m512 load16(const void *p, int64_t i, int dt, __mmask16 mk) {
    if (dt == DT_F32) return _mm512_maskz_loadu_ps(mk, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mk, (const uint16_t *)p + i);
    if (dt == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* Round to nearest even, as torch's float -> bf16 / fp16 conversions do. */
static inline void store_f32(void *p, int64_t i, int dt, float v) {
    if (dt == DT_F32) {
        ((float *)p)[i] = v;
    } else if (dt == DT_BF16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) {
            ((uint16_t *)p)[i] = (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
            return;
        }
        u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((uint16_t *)p)[i] = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    }
}

int hfd_int8_gemv(const void *x, int x_dt, const float *in_scale, const int8_t *q,
                  const int32_t *rowsum, const void *scales, int s_dt, const void *bias,
                  int b_dt, void *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t kp = (K + 63) / 64 * 64;
    uint8_t *planes = (uint8_t *)aligned_alloc(64, (size_t)(M * 3 * kp));
    double *unit = (double *)malloc((size_t)M * sizeof(double));
    float *xf = (float *)aligned_alloc(64, (size_t)kp * sizeof(float));
    if (!planes || !unit || !xf) {
        free(planes); free(unit); free(xf);
        return -2;
    }
    for (int64_t m = 0; m < M; m++) {
        /* xf = x[m] * in_scale in fp32 (zero past K), and its absmax */
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t k = 0; k < kp; k += 16) {
            int64_t left = K - k < 16 ? (K - k > 0 ? K - k : 0) : 16;
            __mmask16 mk = (__mmask16)(left == 16 ? 0xFFFF : (1u << left) - 1);
            __m512 v = load16(x, m * K + k, x_dt, mk);
            if (in_scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, in_scale + k));
            _mm512_store_ps(xf + k, v);
            vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        }
        float amax = _mm512_reduce_max_ps(vmax);
        /* x * fx rounds to an integer in [-(2^23 - 1), 2^23 - 1]; + 2^23 makes it unsigned */
        float fx = amax > 0.f ? 8388607.0f / amax : 0.f;
        unit[m] = amax > 0.f ? (double)amax / 8388607.0 : 0.0;
        uint8_t *p0 = planes + m * 3 * kp, *p1 = p0 + kp, *p2 = p1 + kp;
        const __m512 vfx = _mm512_set1_ps(fx);
        const __m512i offset = _mm512_set1_epi32(8388608), byte = _mm512_set1_epi32(255);
        const __m512i lim = _mm512_set1_epi32(8388607); /* fp32 rounding may reach 2^23 */
        for (int64_t k = 0; k < kp; k += 16) {
            __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(xf + k), vfx));
            i = _mm512_max_epi32(_mm512_min_epi32(i, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
            __m512i u = _mm512_add_epi32(i, offset);
            if (k + 16 > K) { /* columns past K are 0 in every plane, so they add nothing */
                int64_t left = K - k > 0 ? K - k : 0;
                u = _mm512_maskz_mov_epi32((__mmask16)((1u << left) - 1), u);
            }
            _mm_store_si128((__m128i *)(p0 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(u, byte)));
            _mm_store_si128((__m128i *)(p1 + k), _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(u, 8), byte)));
            _mm_store_si128((__m128i *)(p2 + k), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 16)));
        }
    }
    free(xf);
    int64_t blocks = (N + ROWS - 1) / ROWS, tail = K % 64;
    __mmask64 tail_mask = tail ? (((__mmask64)1 << tail) - 1) : 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * ROWS;
        int rows = (int)(N - n0 < ROWS ? N - n0 : ROWS);
        const int8_t *wr[ROWS];
        for (int r = 0; r < ROWS; r++) wr[r] = q + (n0 + (r < rows ? r : 0)) * K;
        for (int64_t m = 0; m < M; m++) {
            const uint8_t *p0 = planes + m * 3 * kp, *p1 = p0 + kp, *p2 = p1 + kp;
            __m512i a0[ROWS], a1[ROWS], a2[ROWS];
            for (int r = 0; r < ROWS; r++) a0[r] = a1[r] = a2[r] = _mm512_setzero_si512();
            int64_t k = 0;
            for (; k + 64 <= K; k += 64) {
                __m512i x0 = _mm512_load_si512(p0 + k), x1 = _mm512_load_si512(p1 + k);
                __m512i x2 = _mm512_load_si512(p2 + k);
                for (int r = 0; r < ROWS; r++) {
                    _mm_prefetch((const char *)(wr[r] + k + PREFETCH), _MM_HINT_T0);
                    __m512i w = _mm512_loadu_si512(wr[r] + k);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], x0, w);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], x1, w);
                    a2[r] = _mm512_dpbusd_epi32(a2[r], x2, w);
                }
            }
            if (tail) {
                __m512i x0 = _mm512_load_si512(p0 + k), x1 = _mm512_load_si512(p1 + k);
                __m512i x2 = _mm512_load_si512(p2 + k);
                for (int r = 0; r < ROWS; r++) {
                    __m512i w = _mm512_maskz_loadu_epi8(tail_mask, wr[r] + k);
                    a0[r] = _mm512_dpbusd_epi32(a0[r], x0, w);
                    a1[r] = _mm512_dpbusd_epi32(a1[r], x1, w);
                    a2[r] = _mm512_dpbusd_epi32(a2[r], x2, w);
                }
            }
            for (int r = 0; r < rows; r++) {
                /* |plane sum| <= K * 255 * 127: int32 holds it for K < 66k */
                int64_t s = (int64_t)_mm512_reduce_add_epi32(a0[r])
                          + 256 * (int64_t)_mm512_reduce_add_epi32(a1[r])
                          + 65536 * (int64_t)_mm512_reduce_add_epi32(a2[r])
                          - 8388608LL * rowsum[n0 + r];
                float v = (float)((double)s * unit[m]) * load_f32(scales, n0 + r, s_dt);
                if (bias) v += load_f32(bias, n0 + r, b_dt);
                store_f32(y, m * N + n0 + r, x_dt, v);
            }
        }
    }
    free(planes);
    free(unit);
    return 0;
}

/* Ask for transparent huge pages on the 2 MiB-aligned interior of [p, p + nbytes), before the
   pages are first written: fewer TLB misses while a weight streams (see PREFETCH). Returns 0, or
   -1 when the kernel refuses (THP off), which only costs speed. */
int hfd_advise_hugepages(void *p, int64_t nbytes) {
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)p + (uintptr_t)nbytes) & ~(huge - 1);
    if (end <= start) return 0;
    return madvise((void *)start, end - start, MADV_HUGEPAGE);
}
