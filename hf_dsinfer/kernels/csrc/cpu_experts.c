/* bf16 products of a few rows of x (decode) with a weight, read once at the memory's pace:
 *
 * hfd_matmul_kn_bf16: a weight stored [K, N] (the input's features along the weight's rows), the
 * layout of gpt-oss's experts, which HF applies as `x @ gate_up_proj[e] + gate_up_proj_bias[e]`.
 * hfd_gemv_bf16: nn.Linear's [N, K] weight (F.linear), for the linears of blocks the native
 * decode layer does not take (MoE and latent-attention blocks, output heads); below.
 *
 * Built with the other csrc/ files into one library by hf_dsinfer/kernels/_native.py, called
 * through ctypes from kernels/matmul_kn.py. oneDNN's bf16 GEMM for a few rows of x against such
 * a weight reads it at a fraction of the memory's pace; decode (a row or a few per expert) is
 * bound by reading the weight once, which is what this does: each thread owns a run of output
 * columns and streams the weight's rows through that run, four rows at a time, accumulating
 * y[m, c] += x[m, k] * w[k, c] in fp32 lanes kept in `acc` (the caller's [M, N] fp32 scratch,
 * in L1 / L2 for the rows of decode).
 *
 * Numerics: products of bf16 are exact in fp32; each output sums its K products in ascending k
 * by fused multiply-adds (one rounding each, on every tier: hfd_simd.h), so the result does not
 * depend on the thread count or the ISA tier. Then torch's bf16 rounding where HF's ops round:
 *
 *   y = bf16(bf16(x @ w) + bias)     (y = bf16(x @ w) without bias)
 *
 * oneDNN sums the same products in another order: the fp32 sums can differ in their last bits,
 * so a bf16 output can differ from torch's by one unit in the last place (the bf16 tolerance).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "hfd_api.h"
#include "hfd_simd.h"

#define KN_UNROLL 4 /* weight rows per pass over the column run */
/* Weight bytes per thread below which fewer threads run: waking a thread costs microseconds
   (far more on a loaded machine), reading 256 KiB about 10 us. */
#define THREAD_MIN_BYTES (256 * 1024)

static inline int threads_for(int64_t weight_bytes, int64_t parts, int nthreads) {
    int64_t nt = nthreads > 0 ? nthreads : 1;
    int64_t by_size = weight_bytes / THREAD_MIN_BYTES;
    if (nt > by_size) nt = by_size > 0 ? by_size : 1;
    if (nt > parts) nt = parts;
    return (int)nt;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline __m512 load16_bf16(const uint16_t *p) {
    __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* acc[m, c0:c1] = sum_k x[m, k] * w[k, c0:c1] for m < M, in ascending k. */
static void kn_columns(const uint16_t *x, const uint16_t *w, float *acc, int64_t M, int64_t K,
                       int64_t N, int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < M; m++) memset(acc + m * N + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    for (int64_t k = 0; k < K; k += KN_UNROLL) {
        int rows = K - k < KN_UNROLL ? (int)(K - k) : KN_UNROLL;
        const uint16_t *w0 = w + k * N;
        for (int64_t m = 0; m < M; m++) {
            __m512 xs[KN_UNROLL];
            for (int j = 0; j < rows; j++) xs[j] = _mm512_set1_ps(bf16_to_f32(x[m * K + k + j]));
            float *a = acc + m * N;
            for (int64_t c = c0; c < c1; c += 16) {
                __m512 s = _mm512_loadu_ps(a + c);
                for (int j = 0; j < rows; j++)
                    s = _mm512_fmadd_ps(xs[j], load16_bf16(w0 + j * N + c), s);
                _mm512_storeu_ps(a + c, s);
            }
        }
    }
}

/* y[m, c0:c1] = bf16(bf16(acc) + bias) (bf16(acc) without bias). */
static void kn_round(const float *acc, const uint16_t *bias, uint16_t *y, int64_t M, int64_t N,
                     int64_t c0, int64_t c1) {
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = c0; c < c1; c += 16) {
            __m512 v = bf16_round(_mm512_loadu_ps(acc + m * N + c));
            if (bias) v = _mm512_add_ps(v, load16_bf16(bias + c));
            store16_bf16(y + m * N + c, 0xffff, v);
        }
    }
}

/* y [M, N] = bf16(bf16(x [M, K] @ w [K, N]) + bias [N]), bias optional; acc: [M, N] fp32
 * scratch. Threads split the columns in runs of 16. Returns 0, or -3 when N is not a multiple
 * of 16 (use another kernel). */
int hfd_matmul_kn_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       float *acc, int64_t M, int64_t K, int64_t N, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 16 || K <= 0) return -3;
    const int64_t blocks = N / 16;
    int nt = threads_for(K * N * 2, blocks, nthreads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t c0 = 16 * (blocks * me / nth), c1 = 16 * (blocks * (me + 1) / nth);
        if (c1 > c0) {
            kn_columns(x, w, acc, M, K, N, c0, c1);
            kn_round(acc, bias, y, M, N, c0, c1);
        }
    }
    return 0;
}

/* ---- hfd_gemv_bf16: y [M, N] = bf16(x [M, K] @ w [N, K]^T + bias [N]), M <= NK_XR ----------
 *
 * F.linear's layout and rounding (the bias added to the fp32 sum, one rounding), as vdpbf16ps dot
 * products: per block of NK_WR weight rows, each row's K products summed in 16 fp32 lanes (pairs
 * of products per step, the instruction's order; hfd_simd.h emulates it below avx512_bf16 with
 * the same bits), then the lanes in gcc's reduction order. Threads split the weight rows in
 * blocks; each output is computed by one thread whatever their number, so the result depends on
 * neither the thread count nor the tier. oneDNN sums in another order: a bf16 output may differ
 * from F.linear's by one unit in the last place. */
#define NK_WR 4                 /* weight rows dotted together */
#define NK_XR 4                 /* rows of x (the accumulators: NK_WR x NK_XR registers) */
#define NK_PREFETCH 1024        /* bytes ahead in each weight row */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN: quiet */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* out[i][r] = sum_k x[i, k] * w[r, k] for r < nw, i < NX (a literal at each call site). */
static inline __attribute__((always_inline)) void nk_dots(const uint16_t *w, int64_t K, int nw,
                                                          const uint16_t *x, const int NX,
                                                          float out[NK_XR][NK_WR]) {
#if HFD_AVX2_DOTS
    bf16_dots_avx2(w, K, nw, x, K, NX, K, NK_PREFETCH, out[0], NK_WR); /* NK_WR == 4 */
    return;
#endif
    if (NX == 1) { /* one row of x: the weight rows streamed one at a time (see above) */
        for (int r = 0; r < nw; r++) {
            const uint16_t *wn = w + r * K;
            __m512 a = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 32 <= K; k += 32) {
                _mm_prefetch((const char *)(wn + k) + NK_PREFETCH, _MM_HINT_T0);
                a = _mm512_dpbf16_ps(a, as_bh(_mm512_loadu_si512(x + k)),
                                     as_bh(_mm512_loadu_si512(wn + k)));
            }
            if (k < K) {
                __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);
                a = _mm512_dpbf16_ps(a, as_bh(_mm512_maskz_loadu_epi16(mk, x + k)),
                                     as_bh(_mm512_maskz_loadu_epi16(mk, wn + k)));
            }
            out[0][r] = _mm512_reduce_add_ps(a);
        }
        return;
    }
    __m512 acc[NK_WR][NK_XR];
    const uint16_t *wr[NK_WR];
    for (int r = 0; r < NK_WR; r++) {
        wr[r] = w + (r < nw ? r : 0) * K;
        for (int i = 0; i < NK_XR; i++) acc[r][i] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i xv[NK_XR];
        for (int i = 0; i < NX; i++) xv[i] = _mm512_loadu_si512(x + i * K + k);
        for (int r = 0; r < NK_WR; r++) {
            _mm_prefetch((const char *)(wr[r] + k) + NK_PREFETCH, _MM_HINT_T0);
            __m512i wv = _mm512_loadu_si512(wr[r] + k);
            for (int i = 0; i < NX; i++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], as_bh(xv[i]), as_bh(wv));
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);
        __m512i xv[NK_XR];
        for (int i = 0; i < NX; i++) xv[i] = _mm512_maskz_loadu_epi16(mk, x + i * K + k);
        for (int r = 0; r < NK_WR; r++) {
            __m512i wv = _mm512_maskz_loadu_epi16(mk, wr[r] + k);
            for (int i = 0; i < NX; i++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], as_bh(xv[i]), as_bh(wv));
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < nw; r++) out[i][r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* Rows n0 .. n1 of y for all M rows of x. */
static void nk_rows(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
    float out[NK_XR][NK_WR];
    for (int64_t n = n0; n < n1; n += NK_WR) {
        int nw = n1 - n < NK_WR ? (int)(n1 - n) : NK_WR;
        const uint16_t *wn = w + n * K;
        switch (M) {
            case 1: nk_dots(wn, K, nw, x, 1, out); break;
            case 2: nk_dots(wn, K, nw, x, 2, out); break;
            case 3: nk_dots(wn, K, nw, x, 3, out); break;
            default: nk_dots(wn, K, nw, x, 4, out); break;
        }
        for (int64_t i = 0; i < M; i++)
            for (int r = 0; r < nw; r++)
                y[i * N + n + r] = f32_to_bf16(out[i][r] + (bias ? bf16_to_f32(bias[n + r]) : 0.0f));
    }
}

/* Returns 0, or -3 when M > NK_XR (use another kernel). */
int hfd_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (M > NK_XR || K <= 0) return -3;
    const int64_t blocks = (N + NK_WR - 1) / NK_WR;
    int nt = threads_for(K * N * 2, blocks, nthreads);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t n0 = NK_WR * (blocks * me / nth), n1 = NK_WR * (blocks * (me + 1) / nth);
        if (n1 > N) n1 = N;
        if (n1 > n0) nk_rows(x, w, bias, y, M, N, K, n0, n1);
    }
    return 0;
}
