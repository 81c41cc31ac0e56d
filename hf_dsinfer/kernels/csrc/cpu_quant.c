/* Weight-only int8 matrix-vector kernel, written for x86 CPUs with AVX-512 (VNNI, BF16) and built
 * for every ISA tier (hfd_simd.h).
 *
 * Built on first use by hf_dsinfer/kernels/_native.py (gcc, -O3, OpenMP against the libgomp that
 * torch already loaded) and called through ctypes. The kernel streams the weight once per call
 * and compute M <= a few rows of x against it: the decode-time shape, bound by memory bandwidth.
 * The weight-only numerics are kept: x is never rounded below what the result can show.
 *
 * int8 (hfd_int8_gemv): y[m, n] = scale[n] * sum_k x[m, k] * in_scale[k] * q[n, k] + bias[n]
 *   q is the [N, K] int8 weight as stored: row-major, or tiles (tiled = 1; see tile_row in
 *   hfd_simd.h), rowsum[n] = sum_k q[n, k].
 *   Each row of x (times in_scale) becomes 24-bit fixed point relative to its absmax, offset to
 *   unsigned and split into three byte planes; vpdpbusd multiplies a plane (u8) by the weights
 *   (s8) with exact int32 sums, the planes combine in int64 and the offset is removed with the
 *   row sum. 24 bits keep every x element within 2^-16 of the row's absmax exactly (a bf16 x has
 *   8 significant bits), so the result is as accurate as an fp32 dot product.
 *
 * No int4 kernel lives here: a bf16-dot-product int4 GEMV (nibbles turned into bf16 by vpermw,
 * vdpbf16ps, per-group scales) ran at the speed of torch's _weight_int4pack_mm_for_cpu at one row
 * (0.39-0.44 ms for a 5632 x 2048 weight, groups 32-128) and slower above. int4 dot products run
 * in cpu_decode.c, with x as 24-bit fixed point per group in byte planes (vpdpbusd): inside the
 * native decode layer (38.7 -> 20-21 ms for 22 Llama-1.1B MLPs there) and as the int4 linear of
 * 1-32 rows (hfd_int4_linear). int8 linears of 4-256 rows run on AMX-INT8 (cpu_moe.c:
 * hfd_int8_amx) with this file's numerics.
 *
 * Dequantization (hfd_dequant_int4_rows, hfd_dequant_int8_rows): rows of a quantized weight to
 * bf16 / fp16 / fp32 for the GEMM of many rows (prefill), in the fp32 operations and order of
 * kernels/quant.py's torch dequantization (a product, then a sum or a product, each rounded), so
 * the result is the same to the bit: ~10x faster than those torch ops (unpack, stack, casts).
 *
 * KV cache decoding (hfd_dequant_kv_int4): the offload engine's token-major 4-bit cache into the
 * [rows, heads, tokens, D] layout attention reads, in one pass, the same bits as the torch ops.
 * Decode attention over that cache without decoding it (hfd_attend_kv_int4): one query per
 * sequence and head against the codes themselves, 15 ms against 33 ms for decoding 32 x 32 heads x
 * 544 tokens of OPT-2.7B's heads and attending over the copy.
 */
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "hfd_api.h"
#include "hfd_simd.h"

int hfd_int8_gemv(const void *x, int x_dt, const float *in_scale, const int8_t *q,
                  const int32_t *rowsum, const void *scales, int s_dt, const void *bias,
                  int b_dt, void *y, int64_t M, int64_t N, int64_t K, int tiled, int nthreads) {
    int64_t kp = (K + 63) / 64 * 64;
    uint8_t *planes = (uint8_t *)aligned_alloc(64, (size_t)(M * INT8_X_BYTES(kp)));
    double *unit = (double *)malloc((size_t)M * sizeof(double));
    float *xf = (float *)aligned_alloc(64, (size_t)kp * sizeof(float));
    if (!planes || !unit || !xf) {
        free(planes); free(unit); free(xf);
        return -2;
    }
    for (int64_t m = 0; m < M; m++)
        unit[m] = int8_input((const char *)x + m * K * (x_dt == DT_F32 ? 4 : 2), x_dt,
                             in_scale, K, kp, xf, planes + m * INT8_X_BYTES(kp));
    free(xf);
    int64_t blocks = (N + INT8_ROWS - 1) / INT8_ROWS;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t n0 = b * INT8_ROWS;
        int rows = (int)(N - n0 < INT8_ROWS ? N - n0 : INT8_ROWS);
        const int8_t *wr[INT8_ROWS];
        for (int r = 0; r < INT8_ROWS; r++)
            wr[r] = (const int8_t *)tile_row(q, n0 + (r < rows || tiled ? r : 0), K, tiled);
        for (int64_t m = 0; m < M; m++) {
            int64_t s[INT8_ROWS];
            if (tiled)
                int8_dots(wr, rowsum + n0, rows, planes + m * INT8_X_BYTES(kp), kp, K, s, NULL,
                          m == 0 ? q + N * K : NULL, 1); /* rows m > 0 read the block cached */
            else
                int8_dots(wr, rowsum + n0, rows, planes + m * INT8_X_BYTES(kp), kp, K, s,
                          m == 0 && n0 + INT8_ROWS < N ? wr[0] + INT8_ROWS * K : NULL, q + N * K,
                          0);
            for (int r = 0; r < rows; r++) {
                float v = (float)((double)s[r] * unit[m]) * load_f32(scales, n0 + r, s_dt);
                if (bias) v += load_f32(bias, n0 + r, b_dt);
                store_f32(y, m * N + n0 + r, x_dt, v);
            }
        }
    }
    free(planes);
    free(unit);
    return 0;
}

int hfd_avx2_dots(void) { return HFD_AVX2_DOTS + HFD_AVX_VNNI; }

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

/* 16 fp32 values to out[o..o + 16) of dtype dt, rounded to nearest even as torch rounds. */
static inline void store16_dt(void *out, int64_t o, int dt, __m512 w) {
    if (dt == DT_F32)
        _mm512_storeu_ps((float *)out + o, w);
    else if (dt == DT_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + o), _mm512_cvtepi32_epi16(bf16_bits(w)));
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + o), _mm512_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT));
}

/* 16 4-bit codes (8 bytes, even index in the low nibble) as fp32 0..15 */
static inline __m512 codes16(const uint8_t *p) {
    const __m512i idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i shift = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
    /* byte j twice, shifted by 0 and 4 */
    __m512i b = _mm512_permutexvar_epi32(idx, _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(b, shift), _mm512_set1_epi32(15)));
}

/* The 16 codes of row bytes o .. o + 7 (o a multiple of 8) of a stored row: row-major, or
   tiles in the super-chunk order (hfd_simd.h: int4_order), where they are two runs of 4. */
static inline __m512 codes16_at(const uint8_t *row, int64_t o, int64_t row_bytes, int tiled) {
    if (!tiled) return codes16(row + o);
    uint8_t b[8];
    if (o < row_bytes / INT4_SUPER * INT4_SUPER) {
        /* inside a whole super-chunk s, with o = 256 s + 16 j + 8 h: int4_order stores row
           bytes o .. o + 3 at 256 s + 128 h + 4 j and o + 4 .. o + 7 64 bytes further, which
           tile_at places at 1024 s + 512 h + 4 j and 256 bytes further (the same bytes as
           below, without either function's arithmetic per 16 codes) */
        const uint8_t *p = row + 4 * (o & ~(int64_t)(INT4_SUPER - 1)) + 64 * (o & 8) +
                           ((o & 0xF0) >> 2);
        memcpy(b, p, 4);
        memcpy(b + 4, p + 256, 4);
        return codes16(b);
    }
    memcpy(b, row + tile_at(int4_order(o, row_bytes), 1), 4);
    memcpy(b + 4, row + tile_at(int4_order(o + 4, row_bytes), 1), 4);
    return codes16(b);
}

/* out[r, :] (dtype o_dt) = q * scale + min (fp32: the product rounded, then the sum) for rows
   [row0, row1) of a 4-bit weight packed two per byte (column 2b low nibble; row-major, or tiles
   in the super-chunk order: tiled = 1, see tile_row and int4_order), groups of `group`
   columns; out holds row1 - row0 rows of K.
   fp-contract off: gcc would fuse the product and the sum into one fma (differently rounded
   from torch's two ops). */
__attribute__((optimize("fp-contract=off")))
int hfd_dequant_int4_rows(const uint8_t *packed, const void *scales, const void *mins, int s_dt,
                          int64_t group, int64_t K, int64_t row0, int64_t row1, void *out,
                          int o_dt, int tiled, int nthreads) {
    const int64_t G = K / group;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = row0; r < row1; r++) {
        const uint8_t *row = tile_row(packed, r, K / 2, tiled);
        for (int64_t g = 0; g < G; g++) {
            const __m512 s = _mm512_set1_ps(load_f32(scales, r * G + g, s_dt));
            const __m512 m = _mm512_set1_ps(load_f32(mins, r * G + g, s_dt));
            for (int64_t c = g * group; c < (g + 1) * group; c += 16)
                store16_dt(out, (r - row0) * K + c, o_dt,
                           _mm512_add_ps(_mm512_mul_ps(codes16_at(row, c / 2, K / 2, tiled), s),
                                         m));
        }
    }
    return 0;
}

/* out[r, :] = q * scale (* in_scale, a second rounded product) for rows [row0, row1) of an int8
   [N, K] weight; K a multiple of 16. */
int hfd_dequant_int8_rows(const int8_t *q, const void *scales, int s_dt, const float *in_scale,
                          int64_t K, int64_t row0, int64_t row1, void *out, int o_dt, int tiled,
                          int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = row0; r < row1; r++) {
        const __m512 s = _mm512_set1_ps(load_f32(scales, r, s_dt));
        const uint8_t *row = tile_row(q, r, K, tiled);
        for (int64_t c = 0; c < K; c += 16) {
            const __m128i q16 = _mm_loadu_si128((const __m128i *)(row + tile_at(c, tiled)));
            __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)), s);
            if (in_scale) w = _mm512_mul_ps(w, _mm512_loadu_ps(in_scale + c));
            store16_dt(out, (r - row0) * K + c, o_dt, w);
        }
    }
    return 0;
}

/* A 4-bit KV cache (kernels/kv_quant.py's min-max codes, two per byte with the even index in
   the low nibble, fp16 scale and min per group of `group` values along D) stored token-major,
   decoded into the layout attention reads: out + (u * out_stride + t) * D holds unit u (a
   sequence's head) at token t, for t < tokens and u < units. Token t's codes start at
   packed + t * p_stride bytes and its scales / mins at + t * s_stride bytes, units contiguous
   inside a token, so one kernel reads RAM tensors and the interleaved records of a cache file.
   Same fp32 operations as the torch decoding (product rounded, then sum; fp-contract off), so
   the result is the same to the bit. group: a multiple of 16 dividing D. */
__attribute__((optimize("fp-contract=off")))
int hfd_dequant_kv_int4(const uint8_t *packed, const uint8_t *scales, const uint8_t *mins,
                        int64_t p_stride, int64_t s_stride, int64_t tokens, int64_t units,
                        int64_t D, int64_t group, void *out, int o_dt, int64_t out_stride,
                        int nthreads) {
    const int64_t G = D / group;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t u = 0; u < units; u++) {
        for (int64_t t = 0; t < tokens; t++) {
            const uint8_t *row = packed + t * p_stride + u * (D / 2);
            const uint16_t *sc = (const uint16_t *)(scales + t * s_stride) + u * G;
            const uint16_t *mn = (const uint16_t *)(mins + t * s_stride) + u * G;
            const int64_t o = (u * out_stride + t) * D;
            for (int64_t g = 0; g < G; g++) {
                const __m512 s = _mm512_set1_ps(_cvtsh_ss(sc[g]));
                const __m512 m = _mm512_set1_ps(_cvtsh_ss(mn[g]));
                for (int64_t c = g * group; c < (g + 1) * group; c += 16)
                    store16_dt(out, o + c, o_dt,
                               _mm512_add_ps(_mm512_mul_ps(codes16(row + c / 2), s), m));
            }
        }
    }
    return 0;
}

/* The 4-bit KV codes of n vectors x [n, D] (dtype x_dt): per group of `group` values,
   lo / hi = min / max, scale = fp16(max((hi - lo) / 15, 1e-10)), min = fp16(lo), q = floor((x -
   min) / scale + 0.5) clamped to [0, 15] (NaN -> 0, as torch casts it), two codes per byte with
   the even index in the low nibble: kernels/kv_quant.py's quantize_kv_int4_ref, the same fp32
   operations, so the same codes. A group holding NaN gets NaN scale and min, as there. group: a
   multiple of 16 dividing D. */
int hfd_quant_kv_int4(const void *x, int x_dt, int64_t n, int64_t D, int64_t group,
                      uint8_t *packed, uint16_t *scales, uint16_t *mins, int nthreads) {
    const int64_t G = D / group;
    const __m512 half = _mm512_set1_ps(0.5f), zero = _mm512_setzero_ps(),
                 fifteen = _mm512_set1_ps(15.0f);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t i = 0; i < n * G; i++) {
        const int64_t first = i * group; /* element index of the group in x */
        __m512 lo = _mm512_set1_ps(INFINITY), hi = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int64_t c = 0; c < group; c += 16) {
            __m512 v = load16(x, first + c, x_dt, 0xFFFF);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            lo = _mm512_min_ps(lo, v);
            hi = _mm512_max_ps(hi, v);
        }
        float l = _mm512_reduce_min_ps(lo), h = _mm512_reduce_max_ps(hi);
        if (nan) l = h = NAN;
        float s = (h - l) / 15.0f;
        if (s < 1e-10f) s = 1e-10f; /* false for NaN, which stays */
        const uint16_t sh = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT), mh = _cvtss_sh(l, _MM_FROUND_TO_NEAREST_INT);
        scales[i] = sh;
        mins[i] = mh;
        const __m512 vs = _mm512_set1_ps(_cvtsh_ss(sh)), vm = _mm512_set1_ps(_cvtsh_ss(mh));
        for (int64_t c = 0; c < group; c += 16) {
            __m512 v = load16(x, first + c, x_dt, 0xFFFF);
            __m512 q = _mm512_roundscale_ps(_mm512_add_ps(_mm512_div_ps(_mm512_sub_ps(v, vm), vs), half),
                                            _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
            q = _mm512_min_ps(_mm512_max_ps(q, zero), fifteen); /* max(NaN, 0) = 0 */
            __m128i b = _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(q)); /* 16 codes, one per byte */
            __m128i lo4 = _mm_and_si128(b, _mm_set1_epi16(0x000F));
            __m128i hi4 = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi16(0x00F0));
            __m128i pairs = _mm_packus_epi16(_mm_or_si128(lo4, hi4), _mm_setzero_si128());
            _mm_storel_epi64((__m128i *)(packed + (first + c) / 2), pairs);
        }
    }
    return 0;
}

/* Decode attention straight over a token-major 4-bit KV cache (FlexGen's attention where the
   cache lives, without the dense copy): for sequence r < rows and query head h < heads, with
   kv head h / (heads / kv_heads),
       o[r, h] = sum_t softmax_t(scale * q[r, h] . K_t + mask[r, t]) V_t,
       K_t = codes * scale + min per group (fp32, never rounded: the codes' own values).
   The cache's tokens come in `nspans` spans, in order (the tokens read ahead, then the step's
   new one); a span's token t has its (row, kv head) units contiguous, each D / 2 code bytes
   at kp + t * p_stride (likewise vp) and G fp16 scales / mins at ks + t * s_stride (km, vs,
   vm), as kernels/kv_quant.py's codes of RAM tensors and cache-file records lie.
   Per key: the codes' dot with q's even and odd elements per group (fp32 FMA), times the
   group's scale, plus its min times the group's sum of q. Per value: the probability times
   the group's scale weights the codes, and the probability times the min adds to the group.
   Probabilities are fp32 exps rounded to p_dt before they weight V, their fp32 sum divides at
   the end (torch's CPU flash attention does both). keep[r * keep_stride + t] == 0 masks key t
   (over all the spans' tokens) of row r (keep_stride 0: one row for all; keep NULL: every key),
   as kernels/decode.py's keep_rows makes it from HF's mask; a row masked everywhere gets zeros.
   q, out:
   [rows, heads, D] contiguous. D <= 256, group even, dividing D. Returns -2 when out of
   memory. */
/* The codes of up to 16 bytes (lanes past the mask read as code 0): low nibbles (even
   elements) in lo, high nibbles (odd elements) in hi, as fp32. */
static inline void code_pairs16(const uint8_t *p, __mmask16 mk, __m512 *lo, __m512 *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mk, p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}

int hfd_attend_kv_int4(const void *q, int q_dt, const hfd_kv_span *spans, int nspans,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, int64_t group,
                       const uint8_t *keep, int64_t keep_stride, float scale, int p_dt, void *out,
                       int o_dt, int nthreads) {
    if (D > 256 || group <= 0 || group % 2 || D % group || heads % kv_heads) return -1;
    const int64_t G = D / group, half = group / 2, rep = heads / kv_heads;
    int64_t T = 0;
    for (int i = 0; i < nspans; i++) T += spans[i].tokens;
    int failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *sc = (float *)malloc((size_t)(T + 16) * sizeof(float));
        /* q's even / odd elements (16 floats of zeros past each group's end), the V sums */
        float qe[256 + 16], qo[256 + 16], ae[256 + 16], ao[256 + 16], qsum[128], madd[128];
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t w = 0; w < rows * heads; w++) {
            if (!sc) continue;
            const int64_t r = w / heads, h = w % heads, u = r * kv_heads + h / rep;
            const uint8_t *krow = keep ? keep + r * keep_stride : NULL;
            for (int64_t g = 0; g < G; g++) {
                float s = 0.f;
                for (int64_t j = 0; j < half; j++) {
                    const float e = load_f32(q, w * D + g * group + 2 * j, q_dt);
                    const float o = load_f32(q, w * D + g * group + 2 * j + 1, q_dt);
                    qe[g * half + j] = e;
                    qo[g * half + j] = o;
                    s += e + o;
                }
                qsum[g] = s;
            }
            for (int j = 0; j < 16; j++) qe[G * half + j] = qo[G * half + j] = 0.f;
            /* scores */
            float mx = -INFINITY;
            int64_t t0 = 0;
            for (int i = 0; i < nspans; i++) {
                const hfd_kv_span *sp = &spans[i];
                for (int64_t t = 0; t < sp->tokens; t++) {
                    const int64_t at = t0 + t;
                    if (krow && !krow[at]) {
                        sc[at] = -INFINITY;
                        continue;
                    }
                    const uint8_t *codes = sp->kp + t * sp->p_stride + u * (D / 2);
                    const uint16_t *ks = (const uint16_t *)(sp->ks + t * sp->s_stride) + u * G;
                    const uint16_t *km = (const uint16_t *)(sp->km + t * sp->s_stride) + u * G;
                    __m512 acc = _mm512_setzero_ps();
                    float mins = 0.f;
                    for (int64_t g = 0; g < G; g++) {
                        __m512 dot = _mm512_setzero_ps();
                        for (int64_t c = 0; c < half; c += 16) {
                            __m512 lo, hi;
                            code_pairs16(codes + g * half + c, mask16(half - c), &lo, &hi);
                            dot = _mm512_fmadd_ps(lo, _mm512_loadu_ps(qe + g * half + c), dot);
                            dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(qo + g * half + c), dot);
                        }
                        acc = _mm512_fmadd_ps(dot, _mm512_set1_ps(_cvtsh_ss(ks[g])), acc);
                        mins += _cvtsh_ss(km[g]) * qsum[g];
                    }
                    const float x = (_mm512_reduce_add_ps(acc) + mins) * scale;
                    sc[at] = x;
                    if (x > mx) mx = x;
                }
                t0 += sp->tokens;
            }
            if (mx == -INFINITY) { /* nothing to attend (a padding row): zeros, never NaN */
                for (int64_t d = 0; d < D; d++) store_f32(out, w * D + d, o_dt, 0.f);
                continue;
            }
            /* probabilities */
            __m512 sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < T; t += 16) {
                const __mmask16 mk = mask16(T - t);
                __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + t), _mm512_set1_ps(mx)));
                e = _mm512_maskz_mov_ps(mk, e);
                sum = _mm512_add_ps(sum, e);
                if (p_dt == DT_BF16) e = bf16_round(e);
                else if (p_dt == DT_F16) e = _mm512_cvtph_ps(_mm512_cvtps_ph(e, _MM_FROUND_TO_NEAREST_INT));
                _mm512_mask_storeu_ps(sc + t, mk, e);
            }
            /* values */
            for (int64_t j = 0; j < G * half + 16; j++) ae[j] = ao[j] = 0.f;
            for (int64_t g = 0; g < G; g++) madd[g] = 0.f;
            t0 = 0;
            for (int i = 0; i < nspans; i++) {
                const hfd_kv_span *sp = &spans[i];
                for (int64_t t = 0; t < sp->tokens; t++) {
                    const float p = sc[t0 + t];
                    if (p == 0.f) continue;
                    const uint8_t *codes = sp->vp + t * sp->p_stride + u * (D / 2);
                    const uint16_t *vs = (const uint16_t *)(sp->vs + t * sp->s_stride) + u * G;
                    const uint16_t *vm = (const uint16_t *)(sp->vm + t * sp->s_stride) + u * G;
                    for (int64_t g = 0; g < G; g++) {
                        const __m512 pw = _mm512_set1_ps(p * _cvtsh_ss(vs[g]));
                        madd[g] += p * _cvtsh_ss(vm[g]);
                        for (int64_t c = 0; c < half; c += 16) {
                            __m512 lo, hi;
                            code_pairs16(codes + g * half + c, mask16(half - c), &lo, &hi);
                            float *e = ae + g * half + c, *o = ao + g * half + c;
                            _mm512_storeu_ps(e, _mm512_fmadd_ps(pw, lo, _mm512_loadu_ps(e)));
                            _mm512_storeu_ps(o, _mm512_fmadd_ps(pw, hi, _mm512_loadu_ps(o)));
                        }
                    }
                }
                t0 += sp->tokens;
            }
            const float inv = 1.0f / _mm512_reduce_add_ps(sum);
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < half; j++) {
                    store_f32(out, w * D + g * group + 2 * j, o_dt, (ae[g * half + j] + madd[g]) * inv);
                    store_f32(out, w * D + g * group + 2 * j + 1, o_dt, (ao[g * half + j] + madd[g]) * inv);
                }
        }
        free(sc);
    }
    return failed ? -2 : 0;
}
