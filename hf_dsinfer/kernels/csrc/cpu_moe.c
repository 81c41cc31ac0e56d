/* bf16 expert MLPs for few rows per expert (MoE decode, small batches, short prompts) on x86.
 *
 * Built with cpu_quant.c into one library by hf_dsinfer/kernels/_native.py, called through
 * ctypes from kernels/moe.py. With up to ~100 routed rows per expert the expert MLPs are bound by
 * reading the expert weights (at a few rows) or by how well the tile units are fed; torch's CPU
 * grouped GEMM and oneDNN's per-expert GEMMs leave 12-20% on the table there (numbers in
 * kernels/moe.py). One call computes every routed expert, in two phases (gate/up, then down),
 * each split into equal tasks of TASK weight rows of one expert:
 *
 *   AMX (AMX-BF16 CPUs, granted by Linux): TDPBF16PS with A tiles loaded straight from the
 *       stored row-major weights and B tiles from the expert's rows packed once per call in
 *       16-row panels of bf16 pairs; a task's weight block is read from memory once and from L2
 *       for its further panels.
 *   AVX-512 BF16 otherwise: vdpbf16ps dot products, WR weight rows x XR expert rows per
 *       register tile.
 *
 * Products of bf16 are exact and sums are fp32 in both; the rounding between ops is HF's:
 *
 *   g = bf16(x @ Wg^T), u = bf16(x @ Wu^T), a = bf16(bf16(silu(g)) * u), y = bf16(a @ Wd^T)
 *
 * gate_up is transformers 5's fused expert tensor [E, 2I, H] (gate rows first, then up rows),
 * down is [E, H, I]; x holds the routed rows sorted by expert, rows offsets[e]:offsets[e+1]
 * belong to expert e, rows from offsets[E] on are left alone.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "hfd_simd.h"

#define WR 4         /* weight rows dotted together */
#define XR 4         /* expert rows dotted together (registers: WR * XR accumulators) */
#define TASK 32      /* weight rows per task (a multiple of WR) */
#ifndef AMX_PREFETCH
#define AMX_PREFETCH 0 /* none: the hardware prefetchers do better (see amx_block) */
#endif

/* out[i * ldo + r] = sum_k x[i, k] * w[r, k] for r < nw (<= WR), i < NX; rows of w are ldw
   apart, rows of x ldx apart; columns past K are masked. NX is a literal at every call site, so
   the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots(
    const uint16_t *w, int64_t ldw, int nw, const uint16_t *x, int64_t ldx, const int NX,
    int64_t K, float *out, int64_t ldo) {
    __m512 acc[WR][XR];
    const uint16_t *wr[WR];
    for (int r = 0; r < WR; r++) {
        wr[r] = w + (r < nw ? r : 0) * ldw;
        for (int i = 0; i < XR; i++) acc[r][i] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i xv[XR];
        for (int i = 0; i < NX; i++) xv[i] = _mm512_loadu_si512(x + i * ldx + k);
        for (int r = 0; r < WR; r++) {
            _mm_prefetch((const char *)(wr[r] + k) + PREFETCH, _MM_HINT_T0);
            __m512i wv = _mm512_loadu_si512(wr[r] + k);
            for (int i = 0; i < NX; i++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], as_bh(xv[i]), as_bh(wv));
        }
    }
    if (k < K) {
        __mmask32 mk = (__mmask32)((1ull << (K - k)) - 1);
        __m512i xv[XR];
        for (int i = 0; i < NX; i++) xv[i] = _mm512_maskz_loadu_epi16(mk, x + i * ldx + k);
        for (int r = 0; r < WR; r++) {
            __m512i wv = _mm512_maskz_loadu_epi16(mk, wr[r] + k);
            for (int i = 0; i < NX; i++)
                acc[r][i] = _mm512_dpbf16_ps(acc[r][i], as_bh(xv[i]), as_bh(wv));
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < nw; r++) out[i * ldo + r] = _mm512_reduce_add_ps(acc[r][i]);
}

/* dots() over all n rows of x, XR at a time (the weight rows come from L1 after the first). */
static void dots_rows(const uint16_t *w, int64_t ldw, int nw, const uint16_t *x, int64_t n,
                      int64_t K, float *out, int64_t ldo) {
    int64_t i = 0;
    for (; i + XR <= n; i += XR) dots(w, ldw, nw, x + i * K, K, XR, K, out + i * ldo, ldo);
    switch (n - i) {
        case 1: dots(w, ldw, nw, x + i * K, K, 1, K, out + i * ldo, ldo); break;
        case 2: dots(w, ldw, nw, x + i * K, K, 2, K, out + i * ldo, ldo); break;
        case 3: dots(w, ldw, nw, x + i * K, K, 3, K, out + i * ldo, ldo); break;
        default: break;
    }
}

/* ---- AMX (tiles of 16 x 64 bytes; TDPBF16PS) -------------------------------------------------
 * C[16 weight rows x 16 expert rows] += A[16 weight rows x 32 k] . B[16 k-pairs x 16 rows]:
 * A is loaded straight from the row-major weight (row stride K * 2 bytes), B from the expert's
 * rows packed once per call in pairs (xp[k / 2][row] = x[row][k] | x[row][k + 1] << 16, rows past
 * the expert's zero), so compute is ~free and the weight is read once at the memory's pace. */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

static int amx_state = -1; /* -1 unknown, 0 unusable, 1 usable */

/* AMX-BF16 present and the kernel lets this process use tile data (Linux asks every process to
   request it once: arch_prctl(ARCH_REQ_XCOMP_PERM)). Called outside parallel regions. */
static int amx_usable(void) {
    if (amx_state < 0) {
        unsigned a, b, c, d;
        int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
        amx_state = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
}

static void amx_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Panels of 16 rows of x [n, K] (K even), each [K / 2][16] pairs: panels * K * 32 bytes. */
static void pack_pairs(const uint16_t *x, int64_t n, int64_t K, uint32_t *xp) {
    int64_t panels = (n + 15) / 16;
    memset(xp, 0, (size_t)(panels * K * 32));
    for (int64_t i = 0; i < n; i++) {
        uint32_t *panel = xp + (i / 16) * (K / 2) * 16 + i % 16;
        const uint32_t *row = (const uint32_t *)(x + i * K);
        for (int64_t k2 = 0; k2 < K / 2; k2++) panel[k2 * 16] = row[k2];
    }
}

/* Every expert's rows of x (row r of expert e at x + r * K, r in offsets[e]..offsets[e+1]) into
   its panels, from panel panel_at[e] of xp on. */
static void pack_experts(const uint16_t *x, const int64_t *offsets, int64_t E, int64_t K,
                         const int64_t *panel_at, uint32_t *xp) {
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] > offsets[e])
            pack_pairs(x + offsets[e] * K, offsets[e + 1] - offsets[e], K,
                       xp + panel_at[e] * (K / 2) * 16);
}

/* Software prefetch is compiled out (AMX_PREFETCH 0): prefetching each tile row 1 KiB ahead took
   the 8 experts at 1 row each from 6.87-7.02 ms to 8.07-8.15 ms (2 KiB: 7.21-7.33, 4 KiB: 7.28);
   the 32 row streams of a task are left to the hardware prefetchers. */
/* out[i * ldo + r] = W[r] . x[i] for the 32 weight rows from w (row stride K), one 16-row panel
   of packed x; NB = 1 or 2 blocks of 32 rows (w, w2) into out, out2. */
static inline void amx_block(const uint16_t *w, const uint16_t *w2, int64_t K,
                             const uint32_t *panel, float *out, float *out2, int64_t ldo,
                             int64_t n) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t stride = K * 2;
    for (int64_t k = 0; k < K; k += 32) {
#if AMX_PREFETCH > 0
        for (int r = 0; r < 16; r++) {
            _mm_prefetch((const char *)(w + r * K + k) + AMX_PREFETCH, _MM_HINT_T0);
            _mm_prefetch((const char *)(w + (r + 16) * K + k) + AMX_PREFETCH, _MM_HINT_T0);
        }
#endif
        _tile_loadd(6, panel + (k / 2) * 16, 64);
        _tile_loadd(4, w + k, stride);
        _tile_loadd(5, w + 16 * K + k, stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (w2) {
#if AMX_PREFETCH > 0
            for (int r = 0; r < 16; r++) {
                _mm_prefetch((const char *)(w2 + r * K + k) + AMX_PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)(w2 + (r + 16) * K + k) + AMX_PREFETCH, _MM_HINT_T0);
            }
#endif
            _tile_loadd(4, w2 + k, stride);
            _tile_loadd(5, w2 + 16 * K + k, stride);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 5, 6);
        }
    }
    float c[32][16];
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[16], 64);
    for (int64_t i = 0; i < n; i++)
        for (int r = 0; r < 32; r++) out[i * ldo + r] = c[r][i];
    if (w2) {
        _tile_stored(2, c[0], 64);
        _tile_stored(3, c[16], 64);
        for (int64_t i = 0; i < n; i++)
            for (int r = 0; r < 32; r++) out2[i * ldo + r] = c[r][i];
    }
}

/* Tasks of one phase: for each expert with rows, ceil(N / TASK) tasks. task -> (expert, row0). */
static int64_t list_tasks(const int64_t *offsets, int64_t E, int64_t N, int32_t *task_expert,
                          int32_t *task_chunk) {
    int64_t chunks = (N + TASK - 1) / TASK, t = 0;
    for (int64_t e = 0; e < E; e++) {
        if (offsets[e + 1] <= offsets[e]) continue;
        for (int64_t c = 0; c < chunks; c++) {
            task_expert[t] = (int32_t)e;
            task_chunk[t] = (int32_t)c;
            t++;
        }
    }
    return t;
}

/* act: 0 = silu (the only gated activation of the MoE families we inject); allow_amx: 0 keeps
   the AVX-512 dot products even where AMX runs. a: [offsets[E] - offsets[0], I] scratch.
   Returns 0, -1 for an unknown act, -2 when out of memory. */
int hfd_moe_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                 const int64_t *offsets, int64_t E, int64_t H, int64_t I, uint16_t *a,
                 uint16_t *y, int act, int allow_amx, int nthreads) {
    if (act != 0) return -1;
    int64_t rows = offsets[E] - offsets[0];
    if (rows <= 0) return 0;
    const int amx = allow_amx && H % 32 == 0 && I % 32 == 0 && amx_usable();
    int64_t most = ((I > H ? I : H) + TASK - 1) / TASK;
    int32_t *te = (int32_t *)malloc((size_t)(E * most) * sizeof(int32_t));
    int32_t *tc = (int32_t *)malloc((size_t)(E * most) * sizeof(int32_t));
    int64_t *panel_at = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t)); /* in panels */
    int64_t nmax = 0;
    panel_at[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t n = offsets[e + 1] - offsets[e];
        if (n > nmax) nmax = n;
        panel_at[e + 1] = panel_at[e] + (n + 15) / 16;
    }
    int64_t kmax = I > H ? I : H;
    uint32_t *xp = amx ? (uint32_t *)aligned_alloc(64, (size_t)(panel_at[E] * kmax * 32)) : NULL;
    int nt = nthreads > 0 ? nthreads : 1;
    int64_t nround = (nmax + 15) / 16 * 16;
    float *scratch = (float *)malloc((size_t)(nt * 2 * nround * TASK) * sizeof(float));
    if (!te || !tc || !panel_at || !scratch || (amx && !xp)) {
        free(te); free(tc); free(panel_at); free(scratch); free(xp);
        return -2;
    }

    /* phase 1: gate and up rows c*TASK.. of each expert, then a = bf16(bf16(silu(g)) * u);
       phase 2: down rows c*TASK.. of each expert, y = bf16(a @ Wd^T) */
    for (int down_phase = 0; down_phase < 2; down_phase++) {
        const int64_t N = down_phase ? H : I, K = down_phase ? I : H;
        /* row r (offsets[0] <= r < offsets[E]) of this phase's input is at src + r * K */
        const uint16_t *src = down_phase ? a - offsets[0] * I : x;
        int64_t tasks = list_tasks(offsets, E, N, te, tc);
        if (amx) pack_experts(src, offsets, E, K, panel_at, xp);
#pragma omp parallel num_threads(nt)
        {
            if (amx) amx_configure();
            float *f0 = scratch + (int64_t)omp_get_thread_num() * 2 * nround * TASK;
            float *f1 = f0 + nround * TASK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t e = te[t], j0 = (int64_t)tc[t] * TASK;
                int64_t n = offsets[e + 1] - offsets[e], cols = N - j0 < TASK ? N - j0 : TASK;
                const uint16_t *xe = src + offsets[e] * K;
                /* phase 1: w0 gate rows, w1 up rows; phase 2: w0 down rows, no w1 */
                const uint16_t *w0 = down_phase ? down + (e * H + j0) * I
                                                : gate_up + (e * 2 * I + j0) * H;
                const uint16_t *w1 = down_phase ? NULL : w0 + I * H;
                if (amx) {
                    for (int64_t p = 0; p * 16 < n; p++)
                        amx_block(w0, w1, K, xp + (panel_at[e] + p) * (K / 2) * 16,
                                  f0 + p * 16 * TASK, f1 + p * 16 * TASK, TASK,
                                  n - p * 16 < 16 ? n - p * 16 : 16);
                } else {
                    for (int64_t r = 0; r < cols; r += WR) {
                        int nw = (int)(cols - r < WR ? cols - r : WR);
                        dots_rows(w0 + r * K, K, nw, xe, n, K, f0 + r, TASK);
                        if (w1) dots_rows(w1 + r * K, K, nw, xe, n, K, f1 + r, TASK);
                    }
                }
                for (int64_t i = 0; i < n; i++) {
                    if (down_phase)
                        round_row(f0 + i * TASK, y + (offsets[e] + i) * H + j0, cols);
                    else
                        gated_silu_row(f0 + i * TASK, f1 + i * TASK,
                                       a + (offsets[e] - offsets[0] + i) * I + j0, cols);
                }
            }
            if (amx) _tile_release();
        }
    }
    free(te);
    free(tc);
    free(panel_at);
    free(scratch);
    free(xp);
    return 0;
}

/* 1 when hfd_moe_bf16 may run on AMX tiles here (CPU and kernel permit it), else 0. */
int hfd_amx_available(void) { return amx_usable(); }
