/* 4-bit and int8 weights times many rows of bf16 x, without a dequantized copy of the weight in
 * memory: batched decode (16-64 sequences), continuous batching's packed steps, short prefills.
 * And bf16 weights times a few rows (hfd_gemm_bf16, below).
 *
 * Where the dot-product kernel of cpu_decode.c (hfd_int4_linear: x as fixed point in byte
 * planes, integer sums) pays its fixed-point set-up per row of x, and dequantizing the whole
 * weight for a GEMM (quant.py's chunked path) writes and reads the bf16 weight through memory,
 * this dequantizes a panel of weight rows (16 to HFD_QP) at a time into a thread's own bf16
 * buffer (in L2) and multiplies every row of x with it there: the 4-bit codes are read from
 * memory once, the panel's bf16 values once per HFD_QR rows of x from cache, x once per panel.
 *
 * Dequantization by table: within a group (32-256 columns) a code c means bf16(c * scale + min),
 * so each group's 16 values are computed once (fp32 product, rounded, then the sum, rounded to
 * bf16 to nearest even: quant.py's dequantize_int4 to bf16, bit for bit) and every 32 codes are
 * looked up in one permute. Tiled codes (quant.py's row tiles in the super-chunk column order,
 * hfd_simd.h: tile_row, int4_order) are put back in column order per row first.
 *
 * Numerics, the same on every tier: w = the bf16 dequantized weight above; each y[m, n] is the
 * sum of x[m, k] * w[n, k] (exact bf16 products) in fp32 in vdpbf16ps's order (16 lanes, a pair
 * of columns per lane per step of 32, the odd one first; hfd_simd.h emulates the instruction
 * with the same bits below avx512_bf16), the lanes reduced in _mm512_reduce_add_ps's order. So
 * y is what F.linear(x, dequantize_int4(W, bf16)) computes in fp32 up to the order of its sums.
 * Each output is computed by one thread whatever their number or the position of its row in a
 * block: the result depends on neither. y is fp32; the caller rounds (quant.py).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hfd_api.h"
#include "hfd_simd.h"

#define HFD_QP 128 /* most weight rows dequantized per panel (a multiple of 16) */
/* A panel's bf16 bytes at most (it stays in L2 with the rows of x read against it): each row of
   x is read once per panel, so the taller the panel, the fewer passes over x */
#define HFD_QP_BYTES (512 * 1024)
#define HFD_QR 6  /* rows of x per register block */
#define HFD_QN 4  /* panel rows per register block (HFD_QR x HFD_QN accumulators) */

/* The 16 values bf16(c * s[0] + m[0]), c = 0..15, as the low 16 words of a vector (a permute
   table): the product rounded, then the sum (fp-contract off), then to bf16 to nearest even
   (bf16_bits_q: these are arithmetic results, never signalling NaNs) */
static inline __m512i group_table(const float *s, const float *m) {
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v = _mm512_add_ps(_mm512_mul_ps(codes, _mm512_set1_ps(*s)), _mm512_set1_ps(*m));
    return _mm512_castsi256_si512(_mm512_cvtepi32_epi16(bf16_bits_q(v)));
}

/* Rows r .. r + TILE_ROWS of the codes in column order (two per byte, column 2b in the low
   nibble of byte b) at rows[i]: the rows themselves when row-major, else gathered from their
   tile into tmp (TILE_ROWS x row_bytes bytes), reading the tile as the one sequential stream it
   is, prefetched TILE_PREFETCH bytes ahead. */
static void tile_codes(const uint8_t *packed, int64_t r, int64_t row_bytes, int tiled,
                       uint8_t *tmp, const uint8_t *rows[TILE_ROWS]) {
    if (!tiled) {
        for (int i = 0; i < TILE_ROWS; i++) rows[i] = packed + (r + i) * row_bytes;
        return;
    }
    const uint8_t *tile = tile_row(packed, r, row_bytes, 1), *end = tile + TILE_ROWS * row_bytes;
    for (int i = 0; i < TILE_ROWS; i++) rows[i] = tmp + i * row_bytes;
    const int64_t whole = row_bytes / INT4_SUPER * INT4_SUPER;
    for (int64_t s = 0; s < whole; s += INT4_SUPER) {
        for (int q = 0; q < 4; q++) /* the run's 1 KiB: 16 lines */
            prefetch_tiles(tile + tile_at(s + 64 * q, 1), end);
        for (int t = 0; t < TILE_ROWS; t++) {
            /* stored byte 64i + 4j + b of the run holds row byte 16j + 4i + b: dword j of load i
               goes to dword 4j + i, a 4 x 16 transpose of dwords */
            const uint8_t *at = tile + tile_at(s, 1) + 64 * t;
            __m512i a0 = _mm512_loadu_si512(at), a1 = _mm512_loadu_si512(at + 64 * TILE_ROWS);
            __m512i a2 = _mm512_loadu_si512(at + 128 * TILE_ROWS);
            __m512i a3 = _mm512_loadu_si512(at + 192 * TILE_ROWS);
            /* per 128-bit lane l: (a0[4l + u], a1[4l + u], a2[4l + u], a3[4l + u]) in d_u */
            __m512i b0 = _mm512_unpacklo_epi32(a0, a1), b1 = _mm512_unpackhi_epi32(a0, a1);
            __m512i c0 = _mm512_unpacklo_epi32(a2, a3), c1 = _mm512_unpackhi_epi32(a2, a3);
            __m512i d0 = _mm512_unpacklo_epi64(b0, c0), d1 = _mm512_unpackhi_epi64(b0, c0);
            __m512i d2 = _mm512_unpacklo_epi64(b1, c1), d3 = _mm512_unpackhi_epi64(b1, c1);
            /* output o = 128-bit lane o of d0, d1, d2, d3: a 4 x 4 transpose of 128-bit lanes */
            __m512i e0 = _mm512_shuffle_i32x4(d0, d1, 0x44), e1 = _mm512_shuffle_i32x4(d0, d1, 0xEE);
            __m512i f0 = _mm512_shuffle_i32x4(d2, d3, 0x44), f1 = _mm512_shuffle_i32x4(d2, d3, 0xEE);
            uint8_t *out = tmp + t * row_bytes + s;
            _mm512_storeu_si512(out, _mm512_shuffle_i32x4(e0, f0, 0x88));
            _mm512_storeu_si512(out + 64, _mm512_shuffle_i32x4(e0, f0, 0xDD));
            _mm512_storeu_si512(out + 128, _mm512_shuffle_i32x4(e1, f1, 0x88));
            _mm512_storeu_si512(out + 192, _mm512_shuffle_i32x4(e1, f1, 0xDD));
        }
    }
    for (int64_t o = whole; o < row_bytes; o += 64)
        for (int t = 0; t < TILE_ROWS; t++)
            memcpy(tmp + t * row_bytes + o, tile + tile_at(o, 1) + 64 * t, 64);
}

/* sf[0 .. G), mf[0 .. G) = row r's scales and mins as fp32, zeros after them up to the next
   multiple of 16 (both have room for G + 16). Whole-vector stores: the table code reads single
   floats back at once, and a masked store does not forward to such a load (one thread, one
   row of a 5632 x 2048 int4 AMX linear: 1.99 ms with masked stores, 1.85-1.90 without). */
static void row_scales(const void *scales, const void *mins, int s_dt, int64_t r, int64_t G,
                       float *sf, float *mf) {
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mk = mask16(G - g);
        _mm512_storeu_ps(sf + g, load16(scales, r * G + g, s_dt, mk));
        _mm512_storeu_ps(mf + g, load16(mins, r * G + g, s_dt, mk));
    }
}

#if defined(__AVX512BF16__)
/* 1 when every scale and min of a row (sf, mf: G fp32 each) is 0 or of magnitude in [2^-100,
   2^100]. Then every c * s + m (c = 0..15, each operation rounded) is 0 or finite and at least
   2^-123 in magnitude: the exact sum of two floats that are 0 or at least 2^-100 is a multiple of
   2^-123. vcvtne2ps2bf16, which rounds to nearest even but flushes denormals (and may keep a
   NaN's payload), then gives bf16_bits_q's bits. */
static int row_plain(const float *sf, const float *mf, int64_t G) {
    const __m512 lo = _mm512_set1_ps(0x1p-100f), hi = _mm512_set1_ps(0x1p100f);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g += 16) {
        const __mmask16 mk = mask16(G - g);
        const __m512 v[2] = {_mm512_abs_ps(_mm512_maskz_loadu_ps(mk, sf + g)),
                             _mm512_abs_ps(_mm512_maskz_loadu_ps(mk, mf + g))};
        for (int i = 0; i < 2; i++) {
            __mmask16 ok = _mm512_cmp_ps_mask(v[i], zero, _CMP_EQ_OQ)
                           | (_mm512_cmp_ps_mask(v[i], lo, _CMP_GE_OQ)
                              & _mm512_cmp_ps_mask(v[i], hi, _CMP_LE_OQ));
            if ((ok & mk) != mk) return 0;
        }
    }
    return 1;
}
#endif

/* out[0 .. K) = the bf16 weight of a row: codes in column order, sf / mf its groups' scales and
   mins (fp32). With AVX512-BF16, two groups' tables in one vector, made by one vcvtne2ps2bf16,
   where row_plain allows (their bits are the same; 0.75 of the instructions per 32 codes). */
static void dequant_row(const uint8_t *codes, const float *sf, const float *mf, int64_t group,
                        int64_t K, uint16_t *out) {
    const int64_t G = K / group;
    const __m512i nib = _mm512_set1_epi32(0x000F000F);
    int64_t g = 0;
#if defined(__AVX512BF16__)
    if (G >= 2 && row_plain(sf, mf, G)) {
        const __m512 cv = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i high = _mm512_set1_epi32(0x00100010); /* the second group's words */
        for (; g + 2 <= G; g += 2) {
            __m512 v0 = _mm512_add_ps(_mm512_mul_ps(cv, _mm512_set1_ps(sf[g])),
                                      _mm512_set1_ps(mf[g]));
            __m512 v1 = _mm512_add_ps(_mm512_mul_ps(cv, _mm512_set1_ps(sf[g + 1])),
                                      _mm512_set1_ps(mf[g + 1]));
            const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* words 0-15: g */
            for (int h = 0; h < 2; h++)
                for (int64_t c = (g + h) * group; c < (g + h + 1) * group; c += 32) {
                    __m512i d = _mm512_cvtepu8_epi32(
                        _mm_loadu_si128((const __m128i *)(codes + c / 2)));
                    __m512i idx = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)),
                                                   nib);
                    if (h) idx = _mm512_or_si512(idx, high);
                    _mm512_storeu_si512(out + c, _mm512_permutexvar_epi16(idx, table));
                }
        }
    }
#endif
    for (; g < G; g++) {
        const __m512i table = group_table(sf + g, mf + g);
        for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
            /* dword b: byte b of the 16; its words: low nibble (column 2b), high (2b + 1) */
            __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + c / 2)));
            __m512i idx = _mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), nib);
            _mm512_storeu_si512(out + c, _mm512_permutexvar_epi16(idx, table));
        }
    }
}

/* Where the products go: y [M, N] of dtype y_dt (DT_F32, or DT_BF16 rounded to nearest even),
   plus bias [N] (bf16, NULL: none) added to the fp32 sum before that rounding */
typedef struct {
    void *y;
    int y_dt;
    const uint16_t *bias;
    int64_t N;
} out_t;

/* y[m + i, n + r] = sum_k x[i, k] w[r, k] (+ bias[n + r]) for i < NX (a literal at each call
   site), r < HFD_QN; x rows ldx apart, weight rows K apart */
static inline __attribute__((always_inline)) void block_dots(const uint16_t *x, int64_t ldx,
                                                             const int NX, const uint16_t *w,
                                                             int64_t K, const out_t *o, int64_t m,
                                                             int64_t n) {
    __m512 acc[HFD_QR][HFD_QN];
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < HFD_QN; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512i wv[HFD_QN];
        for (int r = 0; r < HFD_QN; r++) wv[r] = _mm512_loadu_si512(w + r * K + k);
        for (int i = 0; i < NX; i++) {
            const __m512i xv = _mm512_loadu_si512(x + i * ldx + k);
            for (int r = 0; r < HFD_QN; r++)
                acc[i][r] = _mm512_dpbf16_ps(acc[i][r], as_bh(xv), as_bh(wv[r]));
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < HFD_QN; r++) {
            float sum = _mm512_reduce_add_ps(acc[i][r]);
            if (o->bias) sum += load_f32(o->bias, n + r, DT_BF16);
            store_f32(o->y, (m + i) * o->N + n + r, o->y_dt, sum);
        }
}

#if HFD_AVX2_DOTS
/* block_dots on the avx2 tier: the same sums (hfd_avx2.h: hfd_dpbf16_avx2, vdpbf16ps's lanes
   as two halves of 8, the odd column's product first; hfd_reduce16_ps), blocked for 16 ymm
   registers: two rows of x by two weight rows, one half of a 32-column step at a time (8
   accumulators, the two weight rows' and two x rows' high / low parts as fp32: 16 registers;
   8 FMAs per 8 conversions). The 512-bit form's 6 x 4 block of accumulators, emulated through
   memory on this tier, ran 16 rows of a Llama-1.1B MLP at oneDNN's AVX2 speed; see
   docs/performance.md. */
static inline __attribute__((always_inline)) void pair_dots_avx2(
        const uint16_t *x0, const uint16_t *x1, const uint16_t *w0, const uint16_t *w1,
        int64_t K, float out[2][2]) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256 acc[2][2][2]; /* [x row][weight row][half] */
    for (int i = 0; i < 2; i++)
        for (int r = 0; r < 2; r++) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
    const uint16_t *xs[2] = {x0, x1 ? x1 : x0};
    const uint16_t *ws[2] = {w0, w1};
    for (int64_t k = 0; k < K; k += 32)
        for (int h = 0; h < 2; h++) {
            __m256 wh[2], wl[2], xh[2], xl[2];
            for (int r = 0; r < 2; r++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(ws[r] + k + 16 * h));
                wh[r] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                wl[r] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
            }
            for (int i = 0; i < (x1 ? 2 : 1); i++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(xs[i] + k + 16 * h));
                xh[i] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
                xl[i] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                for (int r = 0; r < 2; r++) {
                    acc[i][r][h] = _mm256_fmadd_ps(xh[i], wh[r], acc[i][r][h]);
                    acc[i][r][h] = _mm256_fmadd_ps(xl[i], wl[r], acc[i][r][h]);
                }
            }
        }
    for (int i = 0; i < (x1 ? 2 : 1); i++)
        for (int r = 0; r < 2; r++) out[i][r] = hfd_reduce16_ps(acc[i][r][0], acc[i][r][1]);
}

static void block_dots_avx2(const uint16_t *x, int64_t ldx, int NX, const uint16_t *w,
                            int64_t K, const out_t *o, int64_t m, int64_t n) {
    for (int i = 0; i < NX; i += 2)
        for (int r = 0; r < HFD_QN; r += 2) {
            float out[2][2];
            pair_dots_avx2(x + i * ldx, i + 1 < NX ? x + (i + 1) * ldx : NULL, w + r * K,
                           w + (r + 1) * K, K, out);
            for (int a = 0; a < 2 && i + a < NX; a++)
                for (int b = 0; b < 2; b++) {
                    float sum = out[a][b];
                    if (o->bias) sum += load_f32(o->bias, n + r + b, DT_BF16);
                    store_f32(o->y, (m + i + a) * o->N + n + r + b, o->y_dt, sum);
                }
        }
}
#define block_dots(x, ldx, NX, w, K, o, m, n) block_dots_avx2(x, ldx, NX, w, K, o, m, n)
#endif

/* y[:, n0 .. n0 + P) for every row of x, from P bf16 weight rows (K apart) at w */
static void panel_product(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w, int64_t P,
                          const out_t *o, int64_t n0) {
    int64_t m = 0;
    for (; m + HFD_QR <= M; m += HFD_QR)
        for (int r = 0; r < P; r += HFD_QN)
            block_dots(x + m * K, K, HFD_QR, w + r * K, K, o, m, n0 + r);
    for (int r = 0; r < P && m < M; r += HFD_QN) {
        const uint16_t *wr = w + r * K, *xm = x + m * K;
        switch (M - m) {
            case 1: block_dots(xm, K, 1, wr, K, o, m, n0 + r); break;
            case 2: block_dots(xm, K, 2, wr, K, o, m, n0 + r); break;
            case 3: block_dots(xm, K, 3, wr, K, o, m, n0 + r); break;
            case 4: block_dots(xm, K, 4, wr, K, o, m, n0 + r); break;
            default: block_dots(xm, K, 5, wr, K, o, m, n0 + r); break;
        }
    }
}

/* How N weight rows of K columns split into panels for nt threads: *P rows each (the last one
   fewer), a multiple of 16 from 16 to HFD_QP and at most HFD_QP_BYTES of bf16, with as many
   panels per thread where the rows allow (576 rows: 6 panels of 96, not 128 x 4 + 64). Returns
   the number of panels. */
static int64_t panel_split(int64_t N, int64_t K, int nt, int64_t *P) {
    int64_t p = HFD_QP_BYTES / (2 * K) / 16 * 16;
    p = p < 16 ? 16 : p > HFD_QP ? HFD_QP : p;
    int64_t panels = (N + p - 1) / p;
    if (nt > 1) {
        panels = (panels + nt - 1) / nt * nt;
        p = ((N + panels - 1) / panels + 15) / 16 * 16;
    }
    *P = p;
    return (N + p - 1) / p;
}

/* out[0 .. K) = bf16(q * s) for an int8 row (row-major, or in tiles: tiled = 1): quant.py's
   dequantize_int8 to bf16 without an input scale (the caller folds that into x) */
static void dequant_int8_row(const int8_t *q, int64_t r, int64_t K, int tiled, float s,
                             uint16_t *out) {
    const uint8_t *row = tile_row(q, r, K, tiled);
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t c = 0; c < K; c += 16) {
        const __m128i q16 = _mm_loadu_si128((const __m128i *)(row + tile_at(c, tiled)));
        const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)), sv);
        _mm256_storeu_si256((__m256i *)(out + c), _mm512_cvtepi32_epi16(bf16_bits_q(w)));
    }
}

/* Rows n0 .. n0 + rows (a multiple of TILE_ROWS) of a 4-bit weight [N, K] dequantized to bf16
   (ldo apart) at out, as qgemm's panels: the table dequantization above, codes row-major or in
   tiles. Scratch: tmp TILE_ROWS * K / 2 bytes, sf and mf K / group + 16 floats each. For the AMX
   kernel of cpu_moe.c (hfd_int4_amx), which multiplies such a panel on tiles. */
void hfd_int4_panel_bf16(const uint8_t *packed, const void *scales, const void *mins, int s_dt,
                         int64_t group, int64_t K, int tiled, int64_t n0, int64_t rows,
                         uint16_t *out, int64_t ldo, uint8_t *tmp, float *sf, float *mf) {
    const int64_t G = K / group;
    for (int64_t r = 0; r < rows; r += TILE_ROWS) {
        const uint8_t *codes[TILE_ROWS];
        tile_codes(packed, n0 + r, K / 2, tiled, tmp, codes);
        for (int t = 0; t < TILE_ROWS; t++) {
            row_scales(scales, mins, s_dt, n0 + r + t, G, sf, mf);
            dequant_row(codes[t], sf, mf, group, K, out + (r + t) * ldo);
        }
    }
}

/* A quantized weight [N, K]: 4-bit codes (bits 4; groups of `group` columns with a scale and a
   min each) or int8 (bits 8; a scale per row), row-major or in tiles */
typedef struct {
    int bits, tiled, s_dt;
    const void *q, *scales, *mins;
    int64_t group;
} qweight_t;

/* y [M, N] (fp32) = x [M, K] (bf16) times the weight dequantized to bf16, transposed: panels of
   weight rows (panel_split) dequantized into each thread's buffer, then every row of x against
   them. Threads split the panels. */
static int qgemm(const uint16_t *x, int64_t M, const qweight_t *w, int64_t N, int64_t K,
                 float *y, int nthreads) {
    int nt = nthreads > 0 ? nthreads : 1;
    int64_t P;
    const int64_t panels = panel_split(N, K, nt, &P);
    const int64_t G = w->bits == 4 ? K / w->group : 1;
    const out_t o = {y, DT_F32, NULL, N};
    if (nt > panels) nt = (int)panels;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        const size_t bytes = ((size_t)(P * K * 2 + TILE_ROWS * K / 2 + 8 * (G + 16)) + 63) & ~(size_t)63;
        uint16_t *panel = aligned_alloc(64, bytes);
        if (!panel) {
            failed = 1;
        } else {
            uint8_t *tmp = (uint8_t *)(panel + P * K);
            float *sf = (float *)(tmp + TILE_ROWS * K / 2), *mf = sf + G + 16;
            int me = omp_get_thread_num(), nth = omp_get_num_threads();
            for (int64_t p = panels * me / nth; p < panels * (me + 1) / nth; p++) {
                const int64_t n0 = p * P, rows = N - n0 < P ? N - n0 : P;
                if (w->bits == 4)
                    hfd_int4_panel_bf16(w->q, w->scales, w->mins, w->s_dt, w->group, K,
                                        w->tiled, n0, rows, panel, K, tmp, sf, mf);
                else
                    for (int64_t r = 0; r < rows; r++)
                        dequant_int8_row(w->q, n0 + r, K, w->tiled,
                                         load_f32(w->scales, n0 + r, w->s_dt), panel + r * K);
                panel_product(x, M, K, panel, rows, &o, n0);
            }
            free(panel);
        }
    }
    return failed ? -2 : 0;
}

/* y [M, N] (fp32) = x [M, K] (bf16) times the 4-bit weight [N, K] (packed two per byte, groups of
 * `group` columns with a scale and a min each, dtype s_dt; row-major, or tiles: tiled = 1) as
 * dequantized to bf16, transposed. Returns 0; -3 for a shape this kernel does not take (N not a
 * multiple of 16, group not a multiple of 32 or not dividing K); -2 when its buffers cannot be
 * allocated. */
int hfd_int4_gemm_bf16(const uint16_t *x, int64_t M, const uint8_t *packed, const void *scales,
                       const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                       float *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 16 || K <= 0 || group <= 0 || group % 32 || K % group) return -3;
    if (tiled && (K / 2) % 64) return -3;
    const qweight_t w = {4, tiled, s_dt, packed, scales, mins, group};
    return qgemm(x, M, &w, N, K, y, nthreads);
}

/* The same for an int8 weight [N, K] (a scale per row, dtype s_dt; row-major, or tiles) as
 * dequantized to bf16 (q * s, rounded): the caller folds an input scale into x. Returns 0; -3
 * for N not a multiple of 16 or K not of 32; -2 out of memory. */
int hfd_int8_gemm_bf16(const uint16_t *x, int64_t M, const int8_t *q, const void *scales,
                       int s_dt, int64_t N, int64_t K, int tiled, float *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 16 || K <= 0 || K % 32) return -3;
    if (tiled && K % 64) return -3;
    const qweight_t w = {8, tiled, s_dt, q, scales, NULL, 0};
    return qgemm(x, M, &w, N, K, y, nthreads);
}

/* y [M, N] = bf16(x [M, K] @ w [N, K]^T + bias [N]) for bf16 x, w, bias (optional) and y: the
 * bias added to the fp32 sum, one rounding, as F.linear; the sums in vdpbf16ps's order (see the
 * header; oneDNN's differ in their last bits, so a bf16 output may differ from F.linear's by one
 * unit in the last place). The weight is read where it is, in panels (panel_split)
 * (from memory once, then from L2 for each block of HFD_QR rows of x); threads split the panels.
 * Measured on Zen 5 against F.linear (kernels/crossovers.py): faster up to 48 rows on one
 * weight, level at 64, slower past (oneDNN's blocking); linear.py takes it for 5-16 rows.
 * Returns 0, or -3 for a shape this kernel does not take (K not a multiple of 32, N not a
 * multiple of HFD_QN). */
int hfd_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || K % 32 || N % HFD_QN) return -3;
    int nt = nthreads > 0 ? nthreads : 1;
    int64_t P;
    const int64_t panels = panel_split(N, K, nt, &P);
    const out_t o = {y, DT_BF16, bias, N};
    if (nt > panels) nt = (int)panels;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int me = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t p = panels * me / nth; p < panels * (me + 1) / nth; p++) {
            const int64_t n0 = p * P, rows = N - n0 < P ? N - n0 : P;
            panel_product(x, M, K, w + n0 * K, rows, &o, n0);
        }
    }
    return 0;
}

/* ---- 4-bit weights times int8 activations (W4A8: quant.py's linear_int4_a8_ref) ----
 *
 * The kernels above multiply in bf16, and from a few tens of rows on that arithmetic is the
 * bound: on Zen 4 a continuous-batching step of ~53 rows ran the Llama-1.1B linears at ~275
 * GFLOP/s of vdpbf16ps on 2 cores whether the weights were bf16 or 4-bit. vpdpbusd does twice
 * the multiply-adds per instruction (64 u8 x s8 products into 16 int32 lanes), so a model that
 * accepts 8-bit activations gets them here. The numbers (the same on every tier: integer sums,
 * then fp32):
 *
 *   x per row and group g (the weight's groups): unit = amax / 127, q = round_even(x * (127 /
 *   amax)) in [-127, 127] (0 where amax is 0), gsum = the fp32 sum of the group's x;
 *   y[m, n] = sum over g of float(I[m, n, g]) * (scale[n, g] * unit[m, g])
 *                          + (min[n, g] + 8 scale[n, g]) * gsum[m, g],
 *   I the exact int32 sum of q * (code - 8) over the group (|I| <= 256 * 127 * 8 < 2^19), the
 *   terms added g by g in that order (product term first), from 0. The codes are centred
 *   (w = (code - 8) scale + (min + 8 scale)) so that x's rounding meets weights of the size of
 *   w, not of code * scale: on Gaussian weights and inputs that halves the error.
 *
 * vpdpbusd multiplies unsigned bytes by signed ones: x goes in as q + 128 (1..255), the codes
 * as code - 8 (-8..7), and each group's sum starts from -128 * sum(code - 8) of its weight row
 * (computed per panel with the same instruction), which leaves I exactly.
 *
 * Layout: the x bytes go per row in column octets, the 4 even columns of an octet then its 4
 * odd ones (bytes 8o .. 8o + 3: columns 8o, 8o + 2, 8o + 4, 8o + 6). A panel of weight rows is
 * put in vpdpbusd's order in a thread's buffer: for octet o and 16 rows, 64 bytes, dword lane i
 * = row i's code bytes 4o .. 4o + 3 as stored in column order (byte b: column 8o + 2b in the low
 * nibble, 8o + 2b + 1 in the high one), a 16 x 16 dword transpose of 64 bytes of each row. So
 * the low nibbles of a lane meet the even columns' x, the high nibbles the odd ones', each with
 * one broadcast of 4 x bytes: 2 vpdpbusd per 8 columns and 16 rows of a row of x, the unpacking
 * (and, shift, subtract) paid once per panel load for A8_MR rows of x. */

/* Register blocks of A8_MR rows of x by A8_NV vectors of 16 weight rows. Zen 4, 2 threads,
   Llama-1.1B shapes (5632 x 2048, 2048 x 5632), 32 and 53 rows, GOPS: 6 x 3 379-463, 4 x 4
   458-518, 8 x 2 496-535, 4 x 3 463-513, 5 x 4 429-451, 6 x 2 507-572 (the bf16 panel kernel
   above: ~350). */
#define A8_MR 6
#define A8_NV 2
#define A8_P 96  /* most weight rows per panel (a multiple of 16 * A8_NV) */

/* x [M, K] (x_dt) -> bytes q + 128 [M, K] in the octet order above, unit and gsum [M, G] */
static void a8_quantize_rows(const void *x, int x_dt, int64_t M, int64_t K, int64_t group,
                             uint8_t *xq, float *unit, float *gsum, int nt) {
    const int64_t G = K / group;
    /* within 16 columns (two octets): evens then odds of each */
    const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m512i lim = _mm512_set1_epi32(127), nlim = _mm512_set1_epi32(-127);
    const __m128i offset = _mm_set1_epi8((char)0x80);
#pragma omp parallel for num_threads(nt) if (nt > 1 && M > 1) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const int64_t c0 = m * K + g * group;
            __m512 sum = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
            for (int64_t c = 0; c < group; c += 16) {
                const __m512 v = load16(x, c0 + c, x_dt, 0xFFFF);
                sum = _mm512_add_ps(sum, v);
                mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            }
            const float amax = _mm512_reduce_max_ps(mx);
            gsum[m * G + g] = _mm512_reduce_add_ps(sum);
            unit[m * G + g] = amax / 127.f;
            const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
            for (int64_t c = 0; c < group; c += 16) {
                __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, c0 + c, x_dt, 0xFFFF), inv));
                q = _mm512_max_epi32(_mm512_min_epi32(q, lim), nlim);
                q = _mm512_permutexvar_epi32(order, q);
                _mm_storeu_si128((__m128i *)(xq + c0 + c),
                                 _mm_xor_si128(_mm512_cvtepi32_epi8(q), offset)); /* q + 128 */
            }
        }
    }
}

void hfd_a8_quantize_row(const void *x, int x_dt, int64_t K, int64_t group, uint8_t *xq,
                         float *unit, float *gsum) {
    a8_quantize_rows(x, x_dt, 1, K, group, xq, unit, gsum, 1);
}

/* A vector of panel codes (vpdpbusd's order) as signed bytes code - 8: the low nibbles (even
   columns) in lo, the high ones (odd columns) in hi */
static inline __attribute__((always_inline)) void a8_codes(__m512i w, __m512i *lo, __m512i *hi) {
    const __m512i nib = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
    *lo = _mm512_sub_epi8(_mm512_and_si512(w, nib), eight);
    *hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(w, 4), nib), eight);
}

#if HFD_AVX2_DOTS
/* a8_codes for half a vector (8 weight rows) */
static inline __attribute__((always_inline)) void a8_codes_avx2(__m256i w, __m256i *lo,
                                                                __m256i *hi) {
    const __m256i nib = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
    *lo = _mm256_sub_epi8(_mm256_and_si256(w, nib), eight);
    *hi = _mm256_sub_epi8(_mm256_and_si256(_mm256_srli_epi16(w, 4), nib), eight);
}

/* vpdpbusd on ymm for the operands here (x bytes 1..255 times codes -8..7): with AVX-VNNI the
   instruction itself, else vpmaddubsw (whose int16 pair sums, at most 2 * 255 * 8, cannot
   saturate here) and vpmaddwd by 1: the same int32 lane sums. */
static inline __attribute__((always_inline)) __m256i a8_dot_avx2(__m256i acc, __m256i x,
                                                                 __m256i w) {
#if HFD_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(acc, x, w);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* a8_block on the avx2 tier, in 256-bit registers (SIMDe's 512-bit vpdpbusd, which must
   allow for saturating pairs, ran the 512-bit block ~3x slower than the bf16 panel kernel):
   MR <= A8_MR2 rows of x by one vector of 16 weight rows as two halves of 8, the same integer
   sums and the same fp32 operations per lane in the same order, so the same bits. */
#define A8_MR2 4
static inline __attribute__((always_inline)) void a8_block_avx2(
        const uint8_t *xq, const float *unit, const float *gsum, int64_t K, int64_t G,
        int64_t group, const int MR, const uint8_t *buf, int64_t NVp, int64_t v,
        const float *sT, const float *mT, const int32_t *cT, int64_t rows, float *y, int64_t N,
        int64_t n0) {
    __m256 f[A8_MR2][2];
    for (int i = 0; i < MR; i++) f[i][0] = f[i][1] = _mm256_setzero_ps();
    const int64_t octs = group / 8;
    for (int64_t g = 0; g < G; g++) {
        __m256i acc[A8_MR2][2];
        for (int h = 0; h < 2; h++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(cT + g * rows + 16 * v + 8 * h));
            for (int i = 0; i < MR; i++) acc[i][h] = c;
        }
        for (int64_t o = g * octs; o < (g + 1) * octs; o++) {
            __m256i lo[2], hi[2];
            for (int h = 0; h < 2; h++)
                a8_codes_avx2(_mm256_loadu_si256((const __m256i *)(buf + (o * NVp + v) * 64 + 32 * h)),
                              &lo[h], &hi[h]);
            for (int i = 0; i < MR; i++) {
                int32_t e, d;
                memcpy(&e, xq + i * K + 8 * o, 4);
                memcpy(&d, xq + i * K + 8 * o + 4, 4);
                const __m256i xe = _mm256_set1_epi32(e), xo = _mm256_set1_epi32(d);
                for (int h = 0; h < 2; h++)
                    acc[i][h] = a8_dot_avx2(a8_dot_avx2(acc[i][h], xe, lo[h]), xo, hi[h]);
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 sc = _mm256_loadu_ps(sT + g * rows + 16 * v + 8 * h);
            const __m256 mn = _mm256_loadu_ps(mT + g * rows + 16 * v + 8 * h);
            for (int i = 0; i < MR; i++) {
                const __m256 su = _mm256_mul_ps(sc, _mm256_set1_ps(unit[i * G + g]));
                f[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][h]), su, f[i][h]);
                f[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(gsum[i * G + g]), f[i][h]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + i * N + n0 + 16 * v + 8 * h, f[i][h]);
}
#endif

/* Rows n0 .. n0 + rows (a multiple of 16) of the codes in vpdpbusd's order at buf: octet o of
   vector v at buf + (o * (rows / 16) + v) * 64; as [G][rows], their scales (fp32) at sT, min +
   8 scale (fp32, each rounded once) at mT, and -128 * sum(code - 8) per group (int32) at cT */
static void a8_panel(const uint8_t *packed, const void *scales, const void *mins, int s_dt,
                     int64_t group, int64_t K, int tiled, int64_t n0, int64_t rows, uint8_t *buf,
                     uint8_t *tmp, float *sT, float *mT, int32_t *cT) {
    const int64_t B = K / 2, NVp = rows / 16, G = K / group, whole = B / 64 * 64;
    const int64_t octs = group / 8;
    for (int64_t v = 0; v < NVp; v++) {
        const uint8_t *row[16];
        for (int q = 0; q < 4; q++)
            tile_codes(packed, n0 + 16 * v + 4 * q, B, tiled, tmp + q * TILE_ROWS * B, row + 4 * q);
        for (int64_t b = 0; b < whole; b += 64) { /* 16 octets */
#if HFD_AVX2_DOTS
            /* four 8 x 8 transposes in ymm: rows 8r.. by dwords 8d.. -> octets 8d.., half r */
            for (int r = 0; r < 2; r++)
                for (int d = 0; d < 2; d++) {
                    __m256i t[8];
                    for (int i = 0; i < 8; i++)
                        t[i] = _mm256_loadu_si256((const __m256i *)(row[8 * r + i] + b + 32 * d));
                    transpose8_epi32(t);
                    for (int j = 0; j < 8; j++)
                        _mm256_storeu_si256((__m256i *)(buf + ((b / 4 + 8 * d + j) * NVp + v) * 64 + 32 * r),
                                            t[j]);
                }
#else
            __m512i t[16];
            for (int i = 0; i < 16; i++) t[i] = _mm512_loadu_si512(row[i] + b);
            transpose16_epi32(t);
            for (int j = 0; j < 16; j++)
                _mm512_storeu_si512(buf + ((b / 4 + j) * NVp + v) * 64, t[j]);
#endif
        }
        for (int64_t b = whole; b < B; b += 4) /* the last octets one dword at a time */
            for (int i = 0; i < 16; i++)
                memcpy(buf + ((b / 4) * NVp + v) * 64 + 4 * i, row[i] + b, 4);
        for (int64_t g = 0; g < G; g++) { /* -128 * sum(code - 8), by the kernel's instruction */
#if HFD_AVX2_DOTS
            for (int h = 0; h < 2; h++) {
                const __m256i one = _mm256_set1_epi8(1);
                __m256i c = _mm256_setzero_si256(), lo, hi;
                for (int64_t o = g * octs; o < (g + 1) * octs; o++) {
                    a8_codes_avx2(_mm256_loadu_si256((const __m256i *)(buf + (o * NVp + v) * 64 + 32 * h)),
                                  &lo, &hi);
                    c = a8_dot_avx2(a8_dot_avx2(c, one, lo), one, hi);
                }
                _mm256_storeu_si256((__m256i *)(cT + g * rows + 16 * v + 8 * h),
                                    _mm256_mullo_epi32(c, _mm256_set1_epi32(-128)));
            }
#else
            const __m512i one = _mm512_set1_epi8(1);
            __m512i c = _mm512_setzero_si512(), lo, hi;
            for (int64_t o = g * octs; o < (g + 1) * octs; o++) {
                a8_codes(_mm512_loadu_si512(buf + (o * NVp + v) * 64), &lo, &hi);
                c = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c, one, lo), one, hi);
            }
            _mm512_storeu_si512(cT + g * rows + 16 * v, _mm512_mullo_epi32(c, _mm512_set1_epi32(-128)));
#endif
        }
    }
    for (int64_t r = 0; r < rows; r++) { /* each row's as fp32 (vectors), then transposed */
        float *sf = (float *)tmp, *mf = sf + G + 16;
        row_scales(scales, mins, s_dt, n0 + r, G, sf, mf);
        for (int64_t g = 0; g < G; g++) {
            sT[g * rows + r] = sf[g];
            mT[g * rows + r] = mf[g] + 8.f * sf[g];
        }
    }
}

/* y[m + i, n0 + 16 v + lane] for i < MR, v < NV (literals at each call site): x bytes of rows
   m.. at xq (K apart), the panel's vectors v0.. of NVp at buf */
static inline __attribute__((always_inline)) void a8_block(
        const uint8_t *xq, const float *unit, const float *gsum, int64_t K, int64_t G,
        int64_t group, const int MR, const int NV, const uint8_t *buf, int64_t NVp, int64_t v0,
        const float *sT, const float *mT, const int32_t *cT, int64_t rows, float *y, int64_t N,
        int64_t n0) {
    __m512 f[A8_MR][A8_NV];
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) f[i][v] = _mm512_setzero_ps();
    const int64_t octs = group / 8;
    for (int64_t g = 0; g < G; g++) {
        __m512i acc[A8_MR][A8_NV];
        for (int v = 0; v < NV; v++) {
            const __m512i c = _mm512_loadu_si512(cT + g * rows + 16 * (v0 + v));
            for (int i = 0; i < MR; i++) acc[i][v] = c;
        }
        for (int64_t o = g * octs; o < (g + 1) * octs; o++) {
            __m512i lo[A8_NV], hi[A8_NV];
            for (int v = 0; v < NV; v++)
                a8_codes(_mm512_loadu_si512(buf + (o * NVp + v0 + v) * 64), &lo[v], &hi[v]);
            for (int i = 0; i < MR; i++) {
                int32_t e, d;
                memcpy(&e, xq + i * K + 8 * o, 4);
                memcpy(&d, xq + i * K + 8 * o + 4, 4);
                const __m512i xe = _mm512_set1_epi32(e), xo = _mm512_set1_epi32(d);
                for (int v = 0; v < NV; v++)
                    acc[i][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i][v], xe, lo[v]),
                                                    xo, hi[v]);
            }
        }
        for (int v = 0; v < NV; v++) {
            const __m512 s = _mm512_loadu_ps(sT + g * rows + 16 * (v0 + v));
            const __m512 mn = _mm512_loadu_ps(mT + g * rows + 16 * (v0 + v));
            for (int i = 0; i < MR; i++) {
                const __m512 su = _mm512_mul_ps(s, _mm512_set1_ps(unit[i * G + g]));
                f[i][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i][v]), su, f[i][v]);
                f[i][v] = _mm512_fmadd_ps(mn, _mm512_set1_ps(gsum[i * G + g]), f[i][v]);
            }
        }
    }
    for (int i = 0; i < MR; i++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(y + i * N + n0 + 16 * (v0 + v), f[i][v]);
}

/* every row of x against a panel of `rows` weight rows (from n0) in the thread's buffer */
static void a8_panel_product(const uint8_t *xq, const float *unit, const float *gsum, int64_t M,
                             int64_t K, int64_t group, const uint8_t *buf, int64_t rows,
                             const float *sT, const float *mT, const int32_t *cT, float *y,
                             int64_t N, int64_t n0) {
    const int64_t G = K / group, NVp = rows / 16;
#if HFD_AVX2_DOTS
#define A8_AVX2(MR)                                                                          \
    for (int64_t v = 0; v < NVp; v++)                                                        \
        a8_block_avx2(xq + m * K, unit + m * G, gsum + m * G, K, G, group, MR, buf, NVp, v, \
                      sT, mT, cT, rows, y + m * N, N, n0)
    int64_t m = 0;
    for (; m + A8_MR2 <= M; m += A8_MR2) A8_AVX2(A8_MR2);
    switch (M - m) {
        case 1: A8_AVX2(1); break;
        case 2: A8_AVX2(2); break;
        case 3: A8_AVX2(3); break;
        default: break;
    }
#undef A8_AVX2
#else
#define A8_CALL(MR, NV) a8_block(xq + m * K, unit + m * G, gsum + m * G, K, G, group, MR, NV, \
                                 buf, NVp, v, sT, mT, cT, rows, y + m * N, N, n0)
#define A8_ROWS(MR)                                    \
    for (int64_t v = 0; v < NVp;) {                    \
        if (NVp - v >= 2) { A8_CALL(MR, 2); v += 2; }  \
        else { A8_CALL(MR, 1); v += 1; }               \
    }
    int64_t m = 0;
    for (; m + A8_MR <= M; m += A8_MR) A8_ROWS(A8_MR)
    switch (M - m) {
        case 1: A8_ROWS(1) break;
        case 2: A8_ROWS(2) break;
        case 3: A8_ROWS(3) break;
        case 4: A8_ROWS(4) break;
        case 5: A8_ROWS(5) break;
        default: break;
    }
#undef A8_ROWS
#undef A8_CALL
#endif
}

/* y [M, N] (fp32) = x [M, K] (x_dt: DT_F32 / DT_BF16 / DT_F16) with 8-bit activations times the
 * 4-bit weight [N, K] (as hfd_int4_gemm_bf16 takes it), in the numbers of the header above.
 * Returns 0; -3 for a shape it does not take (N not a multiple of 16, group not a multiple of
 * 32 or not dividing K); -2 when its buffers cannot be allocated. */
int hfd_int4_gemm_a8(const void *x, int x_dt, int64_t M, const uint8_t *packed,
                     const void *scales, const void *mins, int s_dt, int64_t group, int64_t N,
                     int64_t K, int tiled, float *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (N % 16 || K <= 0 || group <= 0 || group % 32 || K % group) return -3;
    if (tiled && (K / 2) % 64) return -3;
    int nt = nthreads > 0 ? nthreads : 1;
    const int64_t G = K / group;
    uint8_t *xq = aligned_alloc(64, ((size_t)(M * K) + 63) & ~(size_t)63);
    float *unit = malloc(sizeof(float) * (size_t)(2 * M * G));
    if (!xq || !unit) {
        free(xq);
        free(unit);
        return -2;
    }
    float *gsum = unit + M * G;
    a8_quantize_rows(x, x_dt, M, K, group, xq, unit, gsum, nt);
    /* panels of at most A8_P rows, at least one per thread where N allows */
    int64_t P = (N + nt - 1) / nt;
    P = (P + 15) / 16 * 16;
    if (P > A8_P) P = A8_P;
    const int64_t panels = (N + P - 1) / P;
    if (nt > panels) nt = (int)panels;
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1) reduction(| : failed)
    {
        /* the panel, 16 rows of codes (or 2 G + 32 floats of one row's scales), sT, mT, cT */
        const int64_t tmp_bytes = 16 * K / 2 > 4 * (2 * G + 32) ? 16 * K / 2 : 4 * (2 * G + 32);
        const size_t bytes = (size_t)(P * K / 2 + tmp_bytes + 3 * 4 * G * P) + 64;
        uint8_t *buf = aligned_alloc(64, (bytes + 63) & ~(size_t)63);
        if (!buf) {
            failed = 1;
        } else {
            uint8_t *tmp = buf + P * K / 2;
            float *sT = (float *)(tmp + tmp_bytes), *mT = sT + G * P;
            int32_t *cT = (int32_t *)(mT + G * P);
            const int me = omp_get_thread_num(), nth = omp_get_num_threads();
            for (int64_t p = panels * me / nth; p < panels * (me + 1) / nth; p++) {
                const int64_t n0 = p * P, rows = N - n0 < P ? N - n0 : P;
                a8_panel(packed, scales, mins, s_dt, group, K, tiled, n0, rows, buf, tmp, sT, mT,
                         cT);
                a8_panel_product(xq, unit, gsum, M, K, group, buf, rows, sT, mT, cT, y, N, n0);
            }
            free(buf);
        }
    }
    free(xq);
    free(unit);
    return failed ? -2 : 0;
}
