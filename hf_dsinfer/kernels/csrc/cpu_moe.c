/* bf16 expert MLPs of a MoE layer on x86: all routed experts in one call, any number of rows;
 * and, on the same AMX machinery, the dense bf16 linear of batched decode (hfd_linear_bf16).
 *
 * Built with the other csrc/ files into one library by hf_dsinfer/kernels/_native.py, called
 * through ctypes from kernels/moe.py. One call computes every routed expert in two phases
 * (gate/up with the gated SiLU, then down):
 *
 *   AMX (AMX-BF16 CPUs, granted by Linux): TDPBF16PS in 2 x 2 tile blocks, A tiles loaded
 *       straight from the stored row-major weights (no repacking, no copy of the weights), B
 *       tiles from the expert's rows packed in 16-row panels of bf16 pairs. Decode (a row or a
 *       few per expert) is bound by reading the weights and reads them at the memory's pace;
 *       prefill (hundreds of rows per expert) is bound by feeding the tiles from L2 (details at
 *       moe_amx). Measured against one oneDNN GEMM pair per expert: kernels/moe.py.
 *   AVX-512 BF16 otherwise: vdpbf16ps dot products, WR weight rows x XR expert rows per
 *       register tile (used for about one row per expert, where it is weight-read bound).
 *
 * Products of bf16 are exact and sums are fp32 in both; the rounding between ops is HF's:
 *
 *   g = bf16(x @ Wg^T), u = bf16(x @ Wu^T), a = bf16(bf16(silu(g)) * u), y = bf16(a @ Wd^T)
 *
 * and, with routing weights, y = bf16(y * w) as HF weights each expert's output.
 *
 * gate_up is transformers 5's fused expert tensor [E, 2I, H] (gate rows first, then up rows),
 * down is [E, H, I]; x holds the routed rows sorted by expert, rows offsets[e]:offsets[e+1]
 * belong to expert e, rows from offsets[E] on are left alone.
 */
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hfd_api.h"
#include "hfd_simd.h"

#if HFD_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define WR 4         /* weight rows dotted together */
#define XR 4         /* expert rows dotted together (registers: WR * XR accumulators) */
#define TASK 32      /* weight rows per task (a multiple of WR) */

/* out[i * ldo + r] = sum_k x[i, k] * w[r, k] for r < nw (<= WR), i < NX; rows of w are ldw
   apart, rows of x ldx apart; columns past K are masked. NX is a literal at every call site, so
   the accumulators stay in registers. */
static inline __attribute__((always_inline)) void dots(
    const uint16_t *w, int64_t ldw, int nw, const uint16_t *x, int64_t ldx, const int NX,
    int64_t K, float *out, int64_t ldo) {
#if HFD_AVX2_DOTS
    bf16_dots_avx2(w, ldw, nw, x, ldx, NX, K, PREFETCH, out, ldo); /* WR == 4 */
    return;
#endif
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
 * A is loaded straight from the row-major weight (row stride K * 2 bytes), B from rows packed in
 * pairs (panel[k / 2][row] = x[row][k] | x[row][k + 1] << 16, rows past the expert's zero). */
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
#if HFD_AMX
    if (amx_state < 0) {
        unsigned a, b, c, d;
        int has = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24));
        amx_state = has && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return amx_state;
#else
    return 0; /* a tier without AMX code */
#endif
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

/* ---- AMX, 2 x 2 tiles ------------------------------------------------------------------------
 * Phase 1, task (expert e, intermediate columns j0..j0+16): A tiles are the 16 gate rows and the
 * 16 up rows j0.. of the stored weight (row stride H * 2 bytes), B tiles two 16-row panels of the
 * expert's packed rows, and four C tiles (gate, up) x (panel p, p + 1) accumulate over all of H.
 * Gate and up of the same columns meet in one task, so a = bf16(bf16(silu(g)) * u) is computed
 * from the C tiles as they come out and written straight into phase 2's packed B tiles (rows j,
 * j + 1 of a C tile become one row of bf16 pairs): no [rows, I] intermediate, no packing pass.
 * Phase 2, task (expert e, output columns h0..h0+32): A tiles are down rows h0.. and h0+16..
 * (stride I * 2), B tiles the packed a; the C tiles [16 columns][16 rows] are transposed into y's
 * rows with the bf16 rounding.
 *
 * Each loaded tile feeds two TDPBF16PS. What bounds it is feeding the tiles from L2, so:
 *   - an expert's rows are processed in groups of panels whose packed K fits in about 1 MiB of
 *     L2 (all 512 rows of an expert at H = 1024, 128 rows at I = 3584), every task of the thread
 *     running over one group before the next: the B tiles are re-read from L2, the A rows of a
 *     task (32 x K) once per group;
 *   - the next task's 32 weight rows are prefetched into L2 a few lines per k step;
 *   - the epilogue of a pair of panels (vector code: the gated SiLU or the transposition) runs a
 *     unit per k step of the next pair's TDPBF16PS, which the tile unit executes meanwhile.
 * Measured with 8 experts x 512 rows, H 1024, I 3584, weights cycled past the L3, 2 threads: the
 * first version (epilogues after the tiles, no groups) took 60.8 ms; this one 42.5-43.6 ms, of
 * which the epilogues cost ~8 ms (34.7-36.2 ms with them skipped: the tile work alone runs at
 * ~2.5 TFLOP/s, about 40% of the two cores' TDPBF16PS peak measured with tiles in registers). */

#define GROUP_BYTES (1 << 20) /* packed B bytes of one group of panels (L2: 2 MiB per core) */

/* Panels per group at K columns: an even number, at least 2. */
static inline int64_t panel_group(int64_t K) {
    int64_t group = GROUP_BYTES / (K * 32);
    return group < 2 ? 2 : group & ~(int64_t)1;
}

/* 16 lanes of a = bf16(bf16(silu(bf16(g))) * bf16(u)), as fp32 */
static inline __m512 gated_silu16(__m512 g, __m512 u) {
    __m512 gs = bf16_round_q(g);
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gs));
    __m512 s = bf16_round_q(_mm512_div_ps(gs, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    return _mm512_mul_ps(s, bf16_round_q(u));
}

/* The epilogue of one pair of panels, C tiles stored in c: tile q (panel p + q) of A0 at c[q], of
   A1 at c[2 + q]. EPI_GATED (MoE phase 1) units: 16 per panel, one row of gate/up each; EPI_ROWS
   (MoE phase 2, the dense linear) units: one per panel, its rows[q] rows of y. */
enum { EPI_GATED = 0, EPI_ROWS = 1 };

typedef struct {
    float (*c)[256];
    int kind, units, next;
    uint32_t *a_dst[2]; /* EPI_GATED: panel's 8 rows of 16 pairs, 64 bytes apart */
    uint16_t *y_dst[2]; /* EPI_ROWS: panel's first row of y (ldy apart) at column h0 */
    const float *rw[2]; /* EPI_ROWS: the panel's routing weights (NULL: none) */
    const uint16_t *bias; /* EPI_ROWS: bf16 bias of the 32 columns (NULL: none) */
    int64_t ldy;
    int rows[2];
    __m512i held; /* EPI_GATED: the even row's bf16 bits */
} epilogue;

static inline void epilogue_unit(epilogue *ep) {
    int u = ep->next++;
    if (ep->kind == EPI_GATED) {
        /* units 2r, 2r + 1 of panel q: rows r, r + 1 of the gate and up tiles, one per unit (the
           first is held until the second makes a row of pairs) */
        int q = u >> 4, r = u & 15;
        __m512i bits = bf16_bits_q(gated_silu16(_mm512_load_ps(ep->c[q] + r * 16),
                                              _mm512_load_ps(ep->c[2 + q] + r * 16)));
        if (r & 1)
            _mm512_store_si512(ep->a_dst[q] + (r - 1) * 8,
                               _mm512_or_si512(ep->held, _mm512_slli_epi32(bits, 16)));
        else
            ep->held = bits;
    } else {
        /* panel u: column i of its tiles (A0's at c[u], A1's at c[2 + u]) is y row i's 32
           values, 16 from each; a tile transposed in registers gives all 16 columns at once,
           where a gather per column did each (same bits) */
        const int q = u;
        for (int h = 0; h < 2; h++) {
            __m512i t[16];
            for (int r = 0; r < 16; r++) t[r] = _mm512_load_si512(ep->c[2 * h + q] + 16 * r);
            transpose16_epi32(t);
            const __m512 b = ep->bias ? load16(ep->bias, 16 * h, DT_BF16, 0xFFFF)
                                      : _mm512_setzero_ps();
            for (int i = 0; i < ep->rows[q]; i++) {
                __m512 v = _mm512_castsi512_ps(t[i]);
                if (ep->bias) v = _mm512_add_ps(v, b); /* y = bf16(x @ W^T + bias), one rounding */
                if (ep->rw[q]) /* y = bf16(bf16(a @ Wd^T) * w) */
                    v = _mm512_mul_ps(bf16_round_q(v), _mm512_set1_ps(ep->rw[q][i]));
                _mm256_storeu_si256((__m256i *)(ep->y_dst[q] + i * ep->ldy + 16 * h),
                                    _mm512_cvtepi32_epi16(bf16_bits_q(v)));
            }
        }
    }
}

static inline void epilogue_finish(epilogue *ep) {
    while (ep->next < ep->units) epilogue_unit(ep);
}

/* One thread's tile outputs: two buffers of four stored C tiles (one being written while the
   pending epilogue reads the other) and that epilogue. */
typedef struct {
    float cbuf[2][4][256] __attribute__((aligned(64)));
    int flip;
    epilogue ep;
} tile_state;

/* Stores the C tiles of a pair of panels into the buffer the pending epilogue does not read (the
   epilogue of the previous pair has finished inside amx_2x2) and returns it. */
static inline float (*store_tiles(tile_state *ts, int nb))[256] {
    float (*c)[256] = ts->cbuf[ts->flip];
    ts->flip ^= 1;
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    if (nb == 2) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
    }
    return c;
}

/* The row epilogue of tiles c (32 columns x nb panels) into y rows from y0 (ldy apart): left
   rows remain from the pair's first row on; rw: routing weights of those rows or NULL; bias:
   the 32 columns' bias or NULL. */
static inline void epilogue_rows(epilogue *ep, float (*c)[256], uint16_t *y0, int64_t ldy,
                                 int64_t left, int nb, const float *rw, const uint16_t *bias) {
    ep->c = c;
    ep->kind = EPI_ROWS;
    ep->next = 0;
    ep->rows[0] = (int)(left < 16 ? left : 16);
    ep->rows[1] = nb == 2 ? (int)(left - 16 < 16 ? left - 16 : 16) : 0;
    ep->y_dst[0] = y0;
    ep->y_dst[1] = y0 + 16 * ldy;
    ep->rw[0] = rw;
    ep->rw[1] = rw ? rw + 16 : NULL;
    ep->bias = bias;
    ep->ldy = ldy;
    ep->units = ep->rows[1] > 0 ? 2 : 1;
}

/* L2 prefetch of the 32 weight rows the next task reads (rows 0..15 from a, 16..31 from b, ld
   elements apart, K each), `per` lines per k step in the order they will be read. */
typedef struct {
    const uint16_t *a, *b;
    int64_t ld, lines, next, per;
} prefetcher;

static inline void prefetch_step(prefetcher *pf) {
    for (int64_t s = 0; s < pf->per && pf->next < pf->lines; s++, pf->next++) {
        int64_t row = pf->next & 31, col = (pf->next >> 5) * 32; /* 32 bf16 = one line */
        const uint16_t *base = row < 16 ? pf->a + row * pf->ld : pf->b + (row - 16) * pf->ld;
        _mm_prefetch((const char *)(base + col), _MM_HINT_T1);
    }
}

/* Plans the prefetch of the next task's rows (rows 0..15 from a, rows 16..31 from a + b_off;
   ld apart, K each) over the k steps of this task's panels (pairs of panels times K / 32);
   a NULL: none. */
static inline prefetcher prefetch_plan(const uint16_t *a, int64_t b_off, int64_t ld, int64_t K,
                                       int64_t panels) {
    prefetcher pf = {0};
    if (a) {
        int64_t steps = (panels + 1) / 2 * (K / 32);
        pf.a = a;
        pf.b = a + b_off;
        pf.ld = ld;
        pf.lines = K; /* 32 rows of K / 32 lines */
        pf.per = (pf.lines + steps - 1) / steps;
    }
    return pf;
}

/* The dequantization of a 4-bit weight's next 32-row block into a bf16 buffer, a quad of rows
   (TILE_ROWS) per unit, run between the k steps of this block's tile products (hfd_int4_amx):
   the tile unit works through the products issued before a unit while the vector units
   dequantize. NULL or no units left: nothing. */
typedef struct {
    const uint8_t *packed;
    const void *scales, *mins;
    int s_dt, tiled, next, units;
    int64_t group, K, n0, every, left; /* a unit every `every` k steps; `left` to the next */
    uint16_t *out;
    uint8_t *tmp;
    float *sf, *mf;
    int64_t ld; /* out's rows apart */
    /* the prefetch of the coming unit: a unit reads its TILE_ROWS rows of codes (K / 2 bytes
       each, adjacent whether row-major or in one tile: code_lines lines), then their scales and
       their mins (G values each, adjacent: scale_bytes per row, scale_lines lines each) */
    int64_t code_lines, scale_bytes, scale_lines, pf_done, pf_per;
} dq_job;

/* job's prefetch fields from its other ones: every k step prefetches pf_per lines */
static inline void dq_plan(dq_job *j) {
    j->code_lines = TILE_ROWS * j->K / 2 / 64;
    j->scale_bytes = (j->K / j->group) * (j->s_dt == DT_F32 ? 4 : 2);
    j->scale_lines = (TILE_ROWS * j->scale_bytes + 63) / 64;
    j->pf_done = 0;
    j->pf_per = (j->code_lines + 2 * j->scale_lines + j->every - 1) / j->every;
}

static inline const char *dq_line(const dq_job *j, int64_t i) {
    const int64_t r = j->n0 + (int64_t)j->next * TILE_ROWS;
    if (i < j->code_lines) return (const char *)j->packed + r * (j->K / 2) + 64 * i;
    i -= j->code_lines;
    const int first = i < j->scale_lines;
    return (const char *)(first ? j->scales : j->mins) + r * j->scale_bytes
           + 64 * (first ? i : i - j->scale_lines);
}

static inline void dq_unit(dq_job *j) {
    const int u = j->next++;
    hfd_int4_panel_bf16(j->packed, j->scales, j->mins, j->s_dt, j->group, j->K, j->tiled,
                        j->n0 + u * TILE_ROWS, TILE_ROWS, j->out + u * TILE_ROWS * j->ld, j->ld,
                        j->tmp, j->sf, j->mf);
    j->pf_done = 0;
}

/* One k step's share of the side dequantization: some lines of the coming unit prefetched,
   then that unit when its turn comes. Without the prefetch, each unit (a burst of reads every
   `every` k steps, which the hardware prefetchers do not run ahead of) waited on its codes,
   scales and mins. 5632 x 2048, group 32, 2 threads, 8 copies cycled, AMX Xeon, two
   interleaved runs: 1 / 16 / 32 / 64 rows 0.99-1.05 / 0.99-1.05 / 1.05-1.13 / 1.40-1.44 ms
   before, 0.90-0.91 / 0.85-0.87 / 0.89-0.94 / 1.16-1.22 after. A 256-column form with the
   bf16 rows in L1 instead of L2 was slower (0.92-1.05 ms against 0.85-0.92 at 1-32 rows):
   the kernel is bound by the vector ports' dequantization, not by the tile loads. */
static inline void dq_step(dq_job *j) {
    if (!j || j->next >= j->units) return;
    const int64_t lines = j->code_lines + 2 * j->scale_lines;
    for (int64_t s = 0; s < j->pf_per && j->pf_done < lines; s++, j->pf_done++)
        _mm_prefetch(dq_line(j, j->pf_done), _MM_HINT_T0);
    if (--j->left == 0) {
        j->left = j->every;
        dq_unit(j);
    }
}

/* C tiles 0..3 = (A0, A1) x (B0, B1) over K: tile 0 = A0.B0, 1 = A0.B1, 2 = A1.B0, 3 = A1.B1;
   with nb = 1 only tiles 0 and 2. B tiles of k step s at b + s * bstep (uint32). One unit of the
   pending epilogue, some prefetches and the side dequantization's turn (dq: NULL, none) per k
   step. */
static inline void amx_2x2(const uint16_t *a0, const uint16_t *a1, int64_t lda,
                           const uint32_t *b0, const uint32_t *b1, int64_t bstep, int64_t K,
                           int nb, prefetcher *pf, epilogue *ep, dq_job *dq) {
    _tile_zero(0);
    _tile_zero(2);
    if (nb == 2) {
        _tile_zero(1);
        _tile_zero(3);
        for (int64_t k = 0, s = 0; k < K; k += 32, s++) {
            _tile_loadd(4, a0 + k, lda * 2);
            _tile_loadd(6, b0 + s * bstep, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + s * bstep, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + k, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            if (ep->next < ep->units) epilogue_unit(ep);
            prefetch_step(pf);
            dq_step(dq);
        }
    } else {
        for (int64_t k = 0, s = 0; k < K; k += 32, s++) {
            _tile_loadd(4, a0 + k, lda * 2);
            _tile_loadd(6, b0 + s * bstep, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a1 + k, lda * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (ep->next < ep->units) epilogue_unit(ep);
            prefetch_step(pf);
            dq_step(dq);
        }
    }
    epilogue_finish(ep); /* short K: whatever the k steps did not cover */
}

/* Panels p0..p1 of 16 rows of x [n, K] (K even) as [K / 2][16] bf16 pairs, rows past n zero,
   panel p at xp + p * K * 8. */
static void pack_panels(const uint16_t *x, int64_t n, int64_t K, int64_t p0, int64_t p1,
                        uint32_t *xp) {
    const __m512i rows = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        _mm512_set1_epi32((int)(K / 2)));
    for (int64_t p = p0; p < p1; p++) {
        uint32_t *panel = xp + p * K * 8;
        const uint32_t *src = (const uint32_t *)(x + p * 16 * K);
        __mmask16 mk = mask16(n - p * 16);
        for (int64_t k2 = 0; k2 < K / 2; k2++)
            _mm512_store_si512(panel + k2 * 16, _mm512_mask_i32gather_epi32(
                _mm512_setzero_si512(), mk, _mm512_add_epi32(rows, _mm512_set1_epi32((int)k2)),
                src, 4));
    }
}

/* Scratch of the AMX paths (packed rows), kept between calls and grown as needed: at 512 rows
   per expert the MoE kernel packs ~37 MB, and a fresh allocation is page-faulted in on every
   call (71.8 ms instead of 35.3 ms in the measurement above, epilogues skipped). One call at a
   time uses it; a concurrent call allocates its own. */
static pthread_mutex_t arena_lock = PTHREAD_MUTEX_INITIALIZER;
static void *arena;
static size_t arena_bytes;

/* need bytes of 64-byte aligned scratch (NULL when out of memory); *owned says whether it must
   be freed (a concurrent call's own) or the arena released by scratch_put. */
static void *scratch_get(size_t need, int *owned) {
    if (pthread_mutex_trylock(&arena_lock) == 0) {
        *owned = 0;
        if (arena_bytes < need) {
            free(arena);
            arena = aligned_alloc(64, (need + 63) / 64 * 64);
            arena_bytes = arena ? need : 0;
        }
        if (!arena) pthread_mutex_unlock(&arena_lock);
        return arena;
    }
    *owned = 1;
    return aligned_alloc(64, (need + 63) / 64 * 64);
}

static void scratch_put(void *mem, int owned) {
    if (owned)
        free(mem);
    else if (mem)
        pthread_mutex_unlock(&arena_lock);
}

/* Both phases on AMX for the routed rows; returns 0 or -2 (out of memory). */
static int moe_amx(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                   const int64_t *offsets, int64_t E, int64_t H, int64_t I, uint16_t *y,
                   const float *rw, int nt) {
    int64_t *panel_at = (int64_t *)malloc((size_t)(E + 1) * sizeof(int64_t));
    if (!panel_at) return -2;
    panel_at[0] = 0;
    for (int64_t e = 0; e < E; e++)
        panel_at[e + 1] = panel_at[e] + (offsets[e + 1] - offsets[e] + 15) / 16;
    int owned;
    void *mem = scratch_get((size_t)(panel_at[E] * (H + I) * 32), &owned);
    if (!mem) {
        free(panel_at);
        return -2;
    }
    uint32_t *xp = (uint32_t *)mem, *ap = xp + panel_at[E] * H * 8;
#pragma omp parallel num_threads(nt)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
        tile_state ts = {0};
        epilogue *ep = &ts.ep;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panel_at[E]; p++) {
            int64_t e = 0;
            while (panel_at[e + 1] <= p) e++;
            pack_panels(x + offsets[e] * H, offsets[e + 1] - offsets[e], H, p - panel_at[e],
                        p - panel_at[e] + 1, xp + panel_at[e] * H * 8);
        }
        amx_configure();
        for (int phase = 0; phase < 2; phase++) {
            const int64_t K = phase ? I : H, blocks = phase ? H / 32 : I / 16;
            /* this thread's share: tasks (e, block) in expert order, cut at equal cost (panels) */
            int64_t total = panel_at[E] * blocks;
            int64_t lo = total * me / nth, hi = total * (me + 1) / nth;
            for (int64_t e = 0; e < E; e++) {
                int64_t P = panel_at[e + 1] - panel_at[e], n = offsets[e + 1] - offsets[e];
                if (P == 0) continue;
                int64_t first = panel_at[e] * blocks; /* cost before this expert */
                /* blocks b with first + b * P in [lo, hi), rounded to whole tasks */
                int64_t b0 = lo > first ? (lo - first + P - 1) / P : 0;
                int64_t b1 = hi > first ? (hi - first + P - 1) / P : 0;
                if (b1 > blocks) b1 = blocks;
                if (b0 >= b1) continue;
                const int64_t group = panel_group(K);
                const uint32_t *bx = phase ? ap + panel_at[e] * I * 8 : xp + panel_at[e] * H * 8;
                const int64_t bstep = phase ? P * 256 : 256, bpanel = phase ? 256 : H * 8;
                for (int64_t g0 = 0; g0 < P; g0 += group) {
                    int64_t g1 = g0 + group < P ? g0 + group : P;
                    for (int64_t b = b0; b < b1; b++) {
                        const uint16_t *w0, *w1;
                        int64_t lda;
                        if (phase == 0) {
                            w0 = gate_up + (e * 2 * I + b * 16) * H;
                            w1 = w0 + I * H;
                            lda = H;
                        } else {
                            w0 = down + (e * H + b * 32) * I;
                            w1 = w0 + 16 * I;
                            lda = I;
                        }
                        /* prefetch the rows of the next block (or this group's first again) */
                        int64_t bn = b + 1 < b1 ? b + 1 : (g1 < P ? b0 : -1);
                        const uint16_t *na = bn < 0 ? NULL
                                             : phase ? down + (e * H + bn * 32) * I
                                                     : gate_up + (e * 2 * I + bn * 16) * H;
                        prefetcher pf = prefetch_plan(na, phase ? 16 * I : I * H, lda, K,
                                                      g1 - g0);
                        for (int64_t p = g0; p < g1; p += 2) {
                            int nb = g1 - p >= 2 ? 2 : 1;
                            amx_2x2(w0, w1, lda, bx + p * bpanel, bx + (p + 1) * bpanel, bstep, K,
                                    nb, &pf, ep, NULL);
                            float (*c)[256] = store_tiles(&ts, nb);
                            if (phase == 0) {
                                /* a's B tile (k step b / 2, panel p) rows (b & 1) * 8.. */
                                uint32_t *dst = ap + panel_at[e] * I * 8 + (b >> 1) * P * 256
                                                + (b & 1) * 128;
                                ep->c = c;
                                ep->kind = EPI_GATED;
                                ep->next = 0;
                                ep->a_dst[0] = dst + p * 256;
                                ep->a_dst[1] = dst + (p + 1) * 256;
                                ep->units = 16 * nb;
                            } else {
                                epilogue_rows(ep, c, y + (offsets[e] + p * 16) * H + b * 32, H,
                                              n - p * 16, nb,
                                              rw ? rw + offsets[e] - offsets[0] + p * 16 : NULL,
                                              NULL);
                            }
                        }
                    }
                }
            }
            epilogue_finish(ep);
#pragma omp barrier
        }
        _tile_release();
    }
    scratch_put(mem, owned);
    free(panel_at);
    return 0;
}

/* y[c] = bf16(o[c]), or bf16(bf16(o[c]) * w) when scaled, for c < cols. */
static inline void round_row_scaled(const float *o, float w, int scaled, uint16_t *y,
                                    int64_t cols) {
    for (int64_t c = 0; c < cols; c += 16) {
        __mmask16 mk = mask16(cols - c);
        __m512 v = _mm512_maskz_loadu_ps(mk, o + c);
        if (scaled) v = _mm512_mul_ps(bf16_round(v), _mm512_set1_ps(w));
        store16_bf16(y + c, mk, v);
    }
}

/* act: 0 = silu (the only gated activation of the MoE families we inject); allow_amx: 0 keeps
   the AVX-512 dot products even where AMX runs. a: [offsets[E] - offsets[0], I] scratch of the
   AVX-512 path (unused, may be NULL, on AMX). rw: NULL, or one routing weight per row (row r at
   rw[r - offsets[0]]), each y row then bf16(bf16(y) * w) as HF weights an expert's output.
   Returns 0, -1 for an unknown act, -2 when out of memory. */
int hfd_moe_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                 const int64_t *offsets, int64_t E, int64_t H, int64_t I, uint16_t *a,
                 uint16_t *y, const float *rw, int act, int allow_amx, int nthreads) {
    if (act != 0) return -1;
    if (offsets[E] - offsets[0] <= 0) return 0;
    int nt = nthreads > 0 ? nthreads : 1;
    if (allow_amx && H % 32 == 0 && I % 32 == 0 && amx_usable())
        return moe_amx(x, gate_up, down, offsets, E, H, I, y, rw, nt);
    int64_t most = ((I > H ? I : H) + TASK - 1) / TASK, nmax = 0;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] - offsets[e] > nmax) nmax = offsets[e + 1] - offsets[e];
    int32_t *te = (int32_t *)malloc((size_t)(E * most) * sizeof(int32_t));
    int32_t *tc = (int32_t *)malloc((size_t)(E * most) * sizeof(int32_t));
    float *scratch = (float *)malloc((size_t)(nt * 2 * nmax * TASK) * sizeof(float));
    if (!te || !tc || !scratch) {
        free(te); free(tc); free(scratch);
        return -2;
    }

    /* phase 1: gate and up rows c*TASK.. of each expert, then a = bf16(bf16(silu(g)) * u);
       phase 2: down rows c*TASK.. of each expert, y = bf16(a @ Wd^T) */
    for (int down_phase = 0; down_phase < 2; down_phase++) {
        const int64_t N = down_phase ? H : I, K = down_phase ? I : H;
        /* row r (offsets[0] <= r < offsets[E]) of this phase's input is at src + r * K */
        const uint16_t *src = down_phase ? a - offsets[0] * I : x;
        int64_t tasks = list_tasks(offsets, E, N, te, tc);
#pragma omp parallel num_threads(nt)
        {
            float *f0 = scratch + (int64_t)omp_get_thread_num() * 2 * nmax * TASK;
            float *f1 = f0 + nmax * TASK;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tasks; t++) {
                int64_t e = te[t], j0 = (int64_t)tc[t] * TASK;
                int64_t n = offsets[e + 1] - offsets[e], cols = N - j0 < TASK ? N - j0 : TASK;
                const uint16_t *xe = src + offsets[e] * K;
                /* phase 1: w0 gate rows, w1 up rows; phase 2: w0 down rows, no w1 */
                const uint16_t *w0 = down_phase ? down + (e * H + j0) * I
                                                : gate_up + (e * 2 * I + j0) * H;
                const uint16_t *w1 = down_phase ? NULL : w0 + I * H;
                for (int64_t r = 0; r < cols; r += WR) {
                    int nw = (int)(cols - r < WR ? cols - r : WR);
                    dots_rows(w0 + r * K, K, nw, xe, n, K, f0 + r, TASK);
                    if (w1) dots_rows(w1 + r * K, K, nw, xe, n, K, f1 + r, TASK);
                }
                for (int64_t i = 0; i < n; i++) {
                    if (down_phase)
                        round_row_scaled(f0 + i * TASK, rw ? rw[offsets[e] - offsets[0] + i] : 0.f,
                                         rw != NULL, y + (offsets[e] + i) * H + j0, cols);
                    else
                        gated_silu_row(f0 + i * TASK, f1 + i * TASK,
                                       a + (offsets[e] - offsets[0] + i) * I + j0, cols);
                }
            }
        }
    }
    free(te);
    free(tc);
    free(scratch);
    return 0;
}

/* y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]) in bf16 on AMX tiles, rounded once as torch's
 * bf16 linear rounds: the dense linear of batched decode. A tiles are 16 weight rows read
 * straight from the row-major weight, B tiles x packed in 16-row panels, 2 x 2 tile blocks, the
 * next task's 32 weight rows prefetched into L2, the transposition into y's rows interleaved
 * with the next pair's tiles: the moe_amx machinery with one "expert" and no activation. Tasks
 * are 32 output columns, split evenly over the threads. Returns 0, -2 (out of memory) or -3
 * (no AMX here, or N or K not a multiple of 32: use another kernel). */
int hfd_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 32 || K % 32 || K <= 0 || !amx_usable()) return -3;
    const int64_t P = (M + 15) / 16, blocks = N / 32;
    int owned;
    uint32_t *xp = (uint32_t *)scratch_get((size_t)(P * K * 32), &owned);
    if (!xp) return -2;
    const int64_t group = panel_group(K);
    int nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel num_threads(nt)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
        tile_state ts = {0};
        epilogue *ep = &ts.ep;
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) pack_panels(x, M, K, p, p + 1, xp);
        amx_configure();
        int64_t b0 = blocks * me / nth, b1 = blocks * (me + 1) / nth;
        for (int64_t g0 = 0; g0 < P && b0 < b1; g0 += group) {
            int64_t g1 = g0 + group < P ? g0 + group : P;
            for (int64_t b = b0; b < b1; b++) {
                const uint16_t *w0 = w + b * 32 * K;
                int64_t bn = b + 1 < b1 ? b + 1 : (g1 < P ? b0 : -1);
                const uint16_t *na = bn < 0 ? NULL : w + bn * 32 * K;
                prefetcher pf = prefetch_plan(na, 16 * K, K, K, g1 - g0);
                for (int64_t p = g0; p < g1; p += 2) {
                    int nb = g1 - p >= 2 ? 2 : 1;
                    amx_2x2(w0, w0 + 16 * K, K, xp + p * K * 8, xp + (p + 1) * K * 8, 256, K, nb,
                            &pf, ep, NULL);
                    epilogue_rows(ep, store_tiles(&ts, nb), y + p * 16 * N + b * 32, N,
                                  M - p * 16, nb, NULL, bias ? bias + b * 32 : NULL);
                }
            }
        }
        epilogue_finish(ep);
        _tile_release();
    }
    scratch_put(xp, owned);
    return 0;
}

/* ---- 4-bit weights on AMX-BF16: the int4 linear of many rows (hfd_int4_amx) ----
 *
 * y [M, N] = bf16(x [M, K] @ deq(W)^T) for bf16 x, deq(W) the 4-bit weight dequantized to bf16
 * as kernels/quant.py's dequantize_int4 gives it (cpu_qgemm.c's table dequantization, to the bit),
 * so y is hfd_linear_bf16 on that bf16 weight: the caller adds a bias after this rounding, as
 * the torch path's int4 linear does. Each thread takes whole tasks of 32 weight rows: it
 * dequantizes the task's rows into its own buffer (2 x 16 rows, K * 64 bytes: in L2), then
 * runs hfd_linear_bf16's 2 x 2 tile blocks over every panel of x with A tiles from that buffer,
 * dequantizing the next task's rows into a second buffer a quad of rows at a time between the
 * k steps (dq_job), so the tile unit and the vector units work at once.
 * The 4-bit codes are read from memory once per call, the dequantized rows never leave the
 * core's cache: where the dot-product kernel (cpu_decode.c: hfd_int4_linear) does integer work
 * per row of x, and dequantize + GEMM writes and reads the whole bf16 weight, this costs the
 * dequantization of the weight once plus tile products that cost little per row. */
int hfd_int4_amx(const uint16_t *x, int64_t M, const uint8_t *packed, const void *scales,
                 const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                 uint16_t *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 32 || K <= 0 || K % 32 || group <= 0 || group % 32 || K % group
        || (tiled && (K / 2) % 64) || !amx_usable())
        return -3;
    const int64_t P = (M + 15) / 16, blocks = N / 32, G = K / group;
    int owned;
    uint32_t *xp = (uint32_t *)scratch_get((size_t)(P * K * 32), &owned);
    if (!xp) return -2;
    int nt = nthreads > 0 ? nthreads : 1;
    if (nt > blocks) nt = (int)blocks;
    /* two 32-row buffers (the block whose tiles run, and the next one, dequantized meanwhile),
       their rows LD apart, a line more than K: rows 2K bytes apart would put a tile's 16 rows
       in one L1 set whenever K is a multiple of 2048 (tiles alone, 256 rows of a 5632 x 2048
       weight: 2.27 ms against 2.51) */
    const int64_t LD = K + 32;
    const size_t bytes = ((size_t)(64 * LD * 2 + TILE_ROWS * K / 2 + 8 * (G + 16)) + 63)
                         & ~(size_t)63;
    /* the next block's units spread over this block's k steps */
    const int64_t units = 32 / TILE_ROWS, steps = (P + 1) / 2 * (K / 32);
    const int64_t every = steps / units > 0 ? steps / units : 1;
    int failed = 0;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) pack_panels(x, M, K, p, p + 1, xp);
        uint16_t *wb = (uint16_t *)aligned_alloc(64, bytes);
        if (!wb) {
            failed = 1;
        } else {
            uint8_t *tmp = (uint8_t *)(wb + 64 * LD);
            float *sf = (float *)(tmp + TILE_ROWS * K / 2), *mf = sf + G + 16;
            tile_state ts = {0};
            epilogue *ep = &ts.ep;
            prefetcher none = {0};
            amx_configure();
            const int64_t b0 = blocks * me / nth, b1 = blocks * (me + 1) / nth;
            if (b0 < b1)
                hfd_int4_panel_bf16(packed, scales, mins, s_dt, group, K, tiled, b0 * 32, 32, wb,
                                    LD, tmp, sf, mf);
            for (int64_t b = b0; b < b1; b++) {
                uint16_t *cur = wb + ((b - b0) & 1) * 32 * LD;
                dq_job next = {packed, scales, mins, s_dt, tiled, 0, b + 1 < b1 ? (int)units : 0,
                               group, K, (b + 1) * 32, every, every,
                               wb + ((b - b0 + 1) & 1) * 32 * LD, tmp, sf, mf, LD};
                dq_plan(&next);
                for (int64_t p = 0; p < P; p += 2) {
                    int nb = P - p >= 2 ? 2 : 1;
                    amx_2x2(cur, cur + 16 * LD, LD, xp + p * K * 8, xp + (p + 1) * K * 8, 256, K,
                            nb, &none, ep, &next);
                    epilogue_rows(ep, store_tiles(&ts, nb), y + p * 16 * N + b * 32, N,
                                  M - p * 16, nb, NULL, NULL);
                }
                while (next.next < next.units) dq_unit(&next);
            }
            epilogue_finish(ep);
            _tile_release();
            free(wb);
        }
    }
    scratch_put(xp, owned);
    return failed ? -2 : 0;
}

/* ---- int8 weights on AMX-INT8: the int8 linear of many rows (hfd_int8_amx) ----
 *
 * hfd_int8_gemv's numerics (cpu_quant.c: each row of x as 24-bit fixed point in three unsigned
 * byte planes, exact integer sums with the int8 weight, planes combined exactly, the offset
 * removed with the row sums, then the same float operations), with TDPBUSD doing the sums: A
 * tiles are 16 rows of x's planes (64 columns), B tiles 16 weight rows x 64 columns of the
 * stored row tiles (hfd_simd.h: tile_row) transposed as dwords into the order TDPBUSD reads
 * (B[k / 4][n * 4 + k % 4]), once per 16-row weight block into a per-thread buffer. The
 * results are the GEMV's to the bit; where the GEMV's vpdpbusd work grows with every row of x,
 * a tile product takes 16 rows at once. */

static int amx_int8_state = -1;

static int amx_int8_usable(void) {
#if HFD_AMX
    if (amx_int8_state < 0) {
        unsigned a, b, c, d;
        amx_int8_state = amx_usable() && __get_cpuid_count(7, 0, &a, &b, &c, &d)
                         && (d & (1u << 25));
    }
    return amx_int8_state;
#else
    return 0;
#endif
}

/* y [M, N] (x's dtype) = scale[n] * sum_k x[m, k] * in_scale[k] * q[n, k] + bias[n], q the
   [N, K] int8 weight stored as row tiles; hfd_int8_gemv's arguments. Returns 0, -2 out of
   memory, -3 not computable here (no AMX-INT8, N % 16, K % 64, K > 65536). */
__attribute__((optimize("fp-contract=off")))
int hfd_int8_amx(const void *x, int x_dt, const float *in_scale, const int8_t *q,
                 const int32_t *rowsum, const void *scales, int s_dt, const void *bias,
                 int b_dt, void *y, int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 0 || N <= 0 || N % 16 || K <= 0 || K % 64 || K > 65536 || !amx_int8_usable())
        return -3;
    const int64_t Mp = (M + 15) / 16 * 16, ld = 3 * K, xs = x_dt == DT_F32 ? 4 : 2;
    const int nt = nthreads > 0 ? nthreads : 1;
    uint8_t *planes = (uint8_t *)aligned_alloc(64, (size_t)(Mp * ld));
    double *unit = (double *)malloc((size_t)Mp * sizeof(double));
    float *xf = (float *)aligned_alloc(64, (size_t)(nt * K) * sizeof(float));
    uint8_t *vnni = (uint8_t *)aligned_alloc(64, (size_t)(nt * 16 * K));
    if (!planes || !unit || !xf || !vnni) {
        free(planes); free(unit); free(xf); free(vnni);
        return -2;
    }
    memset(planes + M * ld, 0, (size_t)((Mp - M) * ld)); /* padding rows: zero sums */
#pragma omp parallel num_threads(nt)
    {
        const int me = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            unit[m] = int8_planes((const char *)x + m * K * xs, x_dt, in_scale, K, K,
                                  xf + me * K, planes + m * ld);
        amx_configure();
        uint8_t *vb = vnni + (int64_t)me * 16 * K;
        __attribute__((aligned(64))) int32_t c[3][16][16];
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 16) {
            for (int64_t s = 0; s < K / 64; s++) { /* 16 rows x 64 columns -> B order */
                __m512i r[16];
                for (int i = 0; i < 16; i++)
                    r[i] = _mm512_loadu_si512(tile_row(q, n0 + i, K, 1) + 256 * s);
                transpose16_epi32(r);
                for (int j = 0; j < 16; j++) _mm512_store_si512(vb + s * 1024 + 64 * j, r[j]);
            }
            const __m512 sc = load16(scales, n0, s_dt, 0xFFFF);
            const __m512 bi = bias ? load16(bias, n0, b_dt, 0xFFFF) : _mm512_setzero_ps();
            const __m512i rs = _mm512_loadu_si512(rowsum + n0);
            const __m512d rs_lo = _mm512_mul_pd(_mm512_cvtepi32_pd(_mm512_castsi512_si256(rs)),
                                                _mm512_set1_pd(8388608.0));
            const __m512d rs_hi = _mm512_mul_pd(
                _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(rs, 1)), _mm512_set1_pd(8388608.0));
            for (int64_t m0 = 0; m0 < M; m0 += 16) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                const uint8_t *a = planes + m0 * ld; /* plane p of row m at a + m ld + p K */
                for (int64_t s = 0; s < K / 64; s++) {
                    _tile_loadd(6, vb + s * 1024, 64);
                    _tile_loadd(3, a + 64 * s, ld);
                    _tile_dpbusd(0, 3, 6);
                    _tile_loadd(4, a + K + 64 * s, ld);
                    _tile_dpbusd(1, 4, 6);
                    _tile_loadd(5, a + 2 * K + 64 * s, ld);
                    _tile_dpbusd(2, 5, 6);
                }
                _tile_stored(0, c[0], 64);
                _tile_stored(1, c[1], 64);
                _tile_stored(2, c[2], 64);
                for (int i = 0; i < 16 && m0 + i < M; i++) {
                    /* exact: every term an integer below 2^53 */
                    __m512d v[2];
                    for (int h = 0; h < 2; h++) {
                        __m512d p0 = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i *)(c[0][i] + 8 * h)));
                        __m512d p1 = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i *)(c[1][i] + 8 * h)));
                        __m512d p2 = _mm512_cvtepi32_pd(_mm256_load_si256((const __m256i *)(c[2][i] + 8 * h)));
                        __m512d t = _mm512_add_pd(p0, _mm512_mul_pd(p1, _mm512_set1_pd(256.0)));
                        t = _mm512_add_pd(t, _mm512_mul_pd(p2, _mm512_set1_pd(65536.0)));
                        t = _mm512_sub_pd(t, h ? rs_hi : rs_lo);
                        v[h] = _mm512_mul_pd(t, _mm512_set1_pd(unit[m0 + i]));
                    }
                    __m512 f = _mm512_castpd_ps(_mm512_insertf64x4(
                        _mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(v[0]))),
                        _mm256_castps_pd(_mm512_cvtpd_ps(v[1])), 1));
                    f = _mm512_mul_ps(f, sc);
                    if (bias) f = _mm512_add_ps(f, bi);
                    const int64_t o = (m0 + i) * N + n0;
                    if (x_dt == DT_F32)
                        _mm512_storeu_ps((float *)y + o, f);
                    else if (x_dt == DT_BF16)
                        store16_bf16((uint16_t *)y + o, 0xFFFF, f);
                    else
                        _mm256_storeu_si256((__m256i *)((uint16_t *)y + o),
                                            _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
                }
            }
        }
        _tile_release();
    }
    free(planes); free(unit); free(xf); free(vnni);
    return 0;
}

/* 1 when hfd_int8_amx runs here (AMX-INT8 present and granted), else 0. */
int hfd_amx_int8_available(void) { return amx_int8_usable(); }

/* 1 when hfd_moe_bf16 may run on AMX tiles here (CPU and kernel permit it), else 0. */
int hfd_amx_available(void) { return amx_usable(); }
