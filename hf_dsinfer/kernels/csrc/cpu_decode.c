/* One Llama-family or OPT decoder layer for one token (batch-1 decode) in two calls, on x86
 * CPUs with AVX-512 BF16 / VNNI.
 *
 * A batch-1 decode step reads each weight once, so it is bound by memory bandwidth; what
 * separates it from the bandwidth limit is the work between the weight reads. Computed with
 * torch ops, one layer is ~60 dispatches (norms, three projections, ~20 rotary ops, the cache
 * update, attention, residuals, the MLP): on the 2-core machine this was written on, a
 * SmolLM2-135M int4 decode step took 19 ms that way and 14 ms with this file. Here a layer is
 * two calls, with the HF cache update between them, so padding, beams and every Cache class
 * keep working:
 *
 *   hfd_decode_attn_in:  h = rms_norm(x); q, k, v = h W_q^T, h W_k^T, h W_v^T (+ bias);
 *                        each head of q and k RMS-normalized over head_dim where the layer has
 *                        q / k norms (Qwen3); q, k rotated (rotate-half RoPE with the model's
 *                        own cos / sin)
 *   hfd_decode_attn_out: a = softmax(q k^T * scale, keep) v over the cache's keys;
 *                        x1 = x + a W_o^T; h = rms_norm(x1); out = x1 + (silu(h W_g^T) * h W_u^T) W_d^T
 *                        (Granite: both branch outputs times resid_mult before the add)
 *
 * Options of the same two calls, each computed once for every family that has it (hfd_layer):
 * the RMSNorm numerics (Llama's; OLMo 2's fp32 weight multiply; Gemma's fp32 (1 + w)), absent
 * pre-norms and norms after attention and after the MLP before each residual add (sandwich:
 * Gemma 2/3, OLMo 2), q / k norms per head (Qwen3, Gemma 3) or over the whole projection
 * (OLMo 2), RoPE with fp32 cos / sin (OLMo 2), no RoPE (SmolLM3's NoPE layers), a tanh-GELU
 * gated MLP (Gemma), an attention logit soft-cap (Gemma 2), a sliding window (the last W
 * keys), head_dim up to 256, and Granite's residual multiplier.
 *
 * OPT's layout is the same two calls with LayerNorm (weight and bias) for rms_norm, no RoPE
 * (its learned positions are added before the layers), q = bf16(q * q_scale) after the
 * projection with scale 1 in the softmax (HF's order), a bias on every projection, and
 * out = x1 + relu(h W_fc1^T + b) W_fc2^T + b (hfd_layer: norm, rope, q_scale, mlp).
 *
 * Weights are read where the model keeps them (no copy): bf16 [N, K] rows (vdpbf16ps), int8
 * rows with per-row scales and input equalization (three byte planes of x, vpdpbusd: see
 * cpu_quant.c), or 4-bit rows packed two per byte (low nibble first) with per-group scale and
 * min, W = q * scale + min (see lin_block: the codes meet x as 24-bit fixed point per group in
 * byte planes, vpdpbusd, integer sums; the mins come in through per-group sums of x).
 * Products of bf16 are exact and sums are fp32.
 *
 * Rounding to bf16 happens where HF's bf16 modules round: after the norm's normalization and
 * its weight, after each projection, after each rotary product and their sum, after the
 * attention, each residual add, silu and the gate product. Attention follows torch's CPU flash
 * kernel: fp32 scores and softmax, the unnormalized probabilities rounded to bf16 before they
 * weight v, the sum divided out at the end.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "hfd_api.h"
#include "hfd_simd.h"

#include <stddef.h>

int64_t hfd_abi(int64_t *info, int64_t n) {
    const int64_t all[HFD_ABI_FIELDS] = {
        HFD_ABI_VERSION, (int64_t)sizeof(hfd_lin), (int64_t)sizeof(hfd_layer), L_COUNT,
        (int64_t)offsetof(hfd_layer, lin), (int64_t)offsetof(hfd_layer, resid_mult),
        (int64_t)sizeof(hfd_kv_span)};
    int64_t i = 0;
    for (; i < n && i < HFD_ABI_FIELDS; i++) info[i] = all[i];
    return i;
}

/* x prepared for the linears that read it: bf16 values, int4 group sums, int8 planes. */
typedef struct {
    const uint16_t *x;
    float *gsum;     /* int4: [k / group] sums of x per group */
    float *gunit;    /* int4: [k / group] value of one fixed-point step of x per group */
    uint8_t *planes; /* X_BYTES(kp): int8 and int4 x as fixed point (see prepare_input) */
    int32_t *qsum;   /* W4A8: [k / group] sums of x's 8-bit codes per group */
    int64_t kp;
    double unit;
} lin_input;

#define ROWS TILE_ROWS /* weight rows per block (one thread streams them together) */
#define MAX_GROUPS 1024 /* int4: groups per row (k / group) the kernel takes */
/* bytes of an input's planes: int4's 3 * kp, int8's INT8_X_BYTES (4 * kp on avx2) */
#define X_BYTES(kp) (INT8_X_BYTES(kp) > 3 * (kp) ? INT8_X_BYTES(kp) : 3 * (kp))

static inline int is_int4(const hfd_lin *L) {
    return L->kind == LIN_INT4 || L->kind == LIN_INT4_TILED;
}

static inline int is_a8(const hfd_lin *L) {
    return L->kind == LIN_INT4_A8 || L->kind == LIN_INT4_A8_TILED;
}

#if HFD_AVX2_DOTS
/* The sum and the largest |x| of x's group of `group` columns from c0, as the 512-bit code
   computes them: 16 lanes (two halves of 8) summing every 16th value, reduced in gcc's order for
   _mm512_reduce_add_ps / _mm512_reduce_max_ps (lanes i and i + 8, then i + 4, i + 2, i + 1). */
static inline __attribute__((always_inline)) float group_sum_absmax_avx2(
        const void *x, int x_dt, int64_t c0, int64_t group, float *amax) {
    const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, m0 = s0, m1 = s0;
    for (int64_t c = 0; c < group; c += 16) {
        const __m256 v0 = hfd_load8(x, c0 + c, x_dt, 8), v1 = hfd_load8(x, c0 + c + 8, x_dt, 8);
        s0 = _mm256_add_ps(s0, v0);
        s1 = _mm256_add_ps(s1, v1);
        m0 = _mm256_max_ps(m0, _mm256_and_ps(v0, sign));
        m1 = _mm256_max_ps(m1, _mm256_and_ps(v1, sign));
    }
    const __m256 s8 = _mm256_add_ps(s1, s0), m8 = _mm256_max_ps(m1, m0);
    __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m8, 1), _mm256_castps256_ps128(m8));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    *amax = _mm_cvtss_f32(m4);
    return _mm_cvtss_f32(s4);
}

/* cpu_qgemm.c's a8_quantize_rows for one row, on this tier's own vectors (SIMDe's 512-bit
   emulation of it took ~10 us for 2048 columns, per input of every linear): the same
   operations per lane, the group sum reduced in the order of _mm512_reduce_add_ps (lanes i and
   i + 8, then i + 4, i + 2, i + 1), so the same bits (tests/kernels/test_native_a8.py); and
   qsum[g], the group's sum of q. */
static void a8_quantize_avx2(const void *x, int x_dt, int64_t K, int64_t group, uint8_t *xq,
                             float *unit, float *gsum, int32_t *qsum) {
    const int64_t G = K / group;
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i low = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t g = 0; g < G; g++) {
        const int64_t c0 = g * group;
        float amax;
        gsum[g] = group_sum_absmax_avx2(x, x_dt, c0, group, &amax);
        unit[g] = amax / 127.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        __m256i qs = _mm256_setzero_si256();
        for (int64_t c = 0; c < group; c += 8) {
            __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(hfd_load8(x, c0 + c, x_dt, 8), inv));
            q = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
            qs = _mm256_add_epi32(qs, q);
            /* evens then odds, each byte q + 128 */
            const __m256i b = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(q, order), low);
            const uint32_t e = (uint32_t)_mm256_extract_epi32(b, 0) ^ 0x80808080u;
            const uint32_t o = (uint32_t)_mm256_extract_epi32(b, 4) ^ 0x80808080u;
            memcpy(xq + c0 + c, &e, 4);
            memcpy(xq + c0 + c + 4, &o, 4);
        }
        __m128i q4 = _mm_add_epi32(_mm256_extracti128_si256(qs, 1), _mm256_castsi256_si128(qs));
        q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0x4E));
        q4 = _mm_add_epi32(q4, _mm_shuffle_epi32(q4, 0xB1));
        qsum[g] = _mm_cvtsi128_si32(q4);
    }
}

/* prepare_input_dt's int4 planes on this tier's own vectors (SIMDe's emulation of the 512-bit
   code, its two-source permutes and narrowing conversions lane by lane, took ~12 us for 2048
   columns, per input of every int4 linear): the same group sums (gcc's order for
   _mm512_reduce_add_ps, as a8_quantize_avx2), the same fixed point per lane, and the same
   bytes where the 512-bit code puts them, so the same bits (tests/kernels/test_native_tiers.py).
   Bytes 0, 1 and 2 of v are the low, middle and (v >> 16, truncated to 8 bits) high planes;
   per 32 columns, each plane's 16 even and 16 odd bytes come from two packs: with every
   register's dwords in the order evens, odds (vpermd), vpackusdw of two registers holds their
   evens in its low 128 bits and their odds in its high ones, and vpackuswb of two such holds the
   16 even bytes in order in its low 128 bits, the 16 odd ones in its high. */
static void int4_input_avx2(const void *x, int x_dt, int64_t K, int64_t group, int64_t kp,
                            int64_t ordered, int32_t *v32, float *gsum, float *gunit,
                            uint8_t *plane) {
    const int64_t G = K / group, half = kp / 2;
    const __m256i lim = _mm256_set1_epi32(8388607), nlim = _mm256_set1_epi32(-8388607);
    for (int64_t g = 0; g < G; g++) {
        const int64_t c0 = g * group;
        float amax;
        gsum[g] = group_sum_absmax_avx2(x, x_dt, c0, group, &amax);
        gunit[g] = amax > 0.f ? amax / 8388607.f : 0.f;
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? 8388607.f / amax : 0.f);
        for (int64_t c = 0; c < group; c += 8) {
            const __m256i i = _mm256_cvtps_epi32(_mm256_mul_ps(hfd_load8(x, c0 + c, x_dt, 8), inv));
            /* fp32 rounding may reach 2^23 */
            _mm256_storeu_si256((__m256i *)(v32 + c0 + c),
                                _mm256_max_epi32(_mm256_min_epi32(i, lim), nlim));
        }
    }
    for (int i = 0; i < 16; i++) gsum[G + i] = gunit[G + i] = 0.f; /* as the 512-bit code */
    memset(v32 + K, 0, (size_t)(kp - K) * sizeof(int32_t));
    const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), byte = _mm256_set1_epi32(255);
    for (int64_t k = 0; k < kp; k += 32) {
        __m256i v[4];
        for (int r = 0; r < 4; r++)
            v[r] = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(v32 + k + 8 * r)), order);
        for (int t = 0; t < 3; t++) {
            __m256i b[4];
            for (int r = 0; r < 4; r++) b[r] = _mm256_and_si256(_mm256_srli_epi32(v[r], 8 * t), byte);
            const __m256i eo = _mm256_packus_epi16(_mm256_packus_epi32(b[0], b[1]),
                                                   _mm256_packus_epi32(b[2], b[3]));
            const __m128i bytes[2] = {_mm256_castsi256_si128(eo), _mm256_extracti128_si256(eo, 1)};
            for (int p = 0; p < 2; p++) { /* columns k + 2j + p, j < 16 */
                uint8_t *o = plane + (2 * t + p) * half;
                if (k < ordered) {
                    const int64_t run = k / 2 & ~(int64_t)(INT4_SUPER - 1);
                    const int64_t j = (k / 2 & (INT4_SUPER - 1)) >> 4;
                    uint32_t w[4];
                    _mm_storeu_si128((__m128i *)w, bytes[p]);
                    for (int i = 0; i < 4; i++) memcpy(o + run + 64 * i + 4 * j, &w[i], 4);
                } else {
                    _mm_storeu_si128((__m128i *)(o + k / 2), bytes[p]);
                }
            }
        }
    }
}
#endif

/* x (K values of dtype x_dt: bf16 in the decode layer) as the linear L reads it: kp floats of
   scratch in xf; for int4, in->gsum and in->gunit hold kp floats each. */
static void prepare_input_dt(const hfd_lin *L, const void *x, int x_dt, lin_input *in,
                             float *xf) {
    in->x = (const uint16_t *)x;
    if (L->kind == LIN_INT8 || L->kind == LIN_INT8_TILED) {
        in->kp = (L->k + 63) / 64 * 64;
        in->unit = int8_input(x, x_dt, L->in_scale, L->k, in->kp, xf, in->planes);
    } else if (is_a8(L)) {
        /* W4A8 (a8_dots): x quantized by hfd_int4_gemm_a8's own code (the same bits), its
           bytes q + 128 in that kernel's octet order (per 8 columns the 4 even ones, then the 4
           odd ones) turned into two planes of signed q, as the int4 planes below: the even
           columns' then the odd columns' (kp / 2 bytes each, 0 past K), whole 512-column runs
           of tiles in the codes' super-chunk order; in->qsum[g]: the group's sum of q. */
        const int64_t K = L->k, group = L->group, G = K / group;
        in->kp = (K + 127) / 128 * 128;
        uint8_t *xq = (uint8_t *)xf; /* K bytes in the kp floats of scratch */
#if HFD_AVX2_DOTS
        a8_quantize_avx2(x, x_dt, K, group, xq, in->gunit, in->gsum, in->qsum);
#else
        hfd_a8_quantize_row(x, x_dt, K, group, xq, in->gunit, in->gsum);
        for (int64_t g = 0; g < G; g++) { /* sums of the bytes q + 128, 32 at a time */
            __m256i t = _mm256_setzero_si256();
            for (int64_t c = g * group; c < (g + 1) * group; c += 32)
                t = _mm256_add_epi64(t, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(xq + c)),
                                                        _mm256_setzero_si256()));
            int64_t l[4];
            _mm256_storeu_si256((__m256i *)l, t);
            in->qsum[g] = (int32_t)(l[0] + l[1] + l[2] + l[3] - 128 * group);
        }
#endif
        const int64_t words = in->kp / 8, octets = K / 8; /* dwords of a plane; octets of x */
        const int64_t ordered = L->kind == LIN_INT4_A8_TILED ? K / 512 * 64 : 0;
        uint8_t *E = in->planes, *O = E + in->kp / 2;
        for (int64_t d = 0; d < words; d++) {
            uint32_t e = 0, o = 0;
            if (d < octets) {
                memcpy(&e, xq + 8 * d, 4);
                memcpy(&o, xq + 8 * d + 4, 4);
                e ^= 0x80808080u; /* q + 128 -> q */
                o ^= 0x80808080u;
            }
            /* a run's natural dword 4j + i goes to 16i + j (hfd_simd.h: int4_order) */
            const int64_t at = d < ordered ? (d & ~(int64_t)63) + 16 * (d & 3) + ((d & 63) >> 2) : d;
            memcpy(E + 4 * at, &e, 4);
            memcpy(O + 4 * at, &o, 4);
        }
    } else if (is_int4(L)) {
        /* x per group g as 24-bit fixed point v = round(x / gunit[g]), |v| < 2^23 (gunit[g] =
           absmax / (2^23 - 1): the int8 kernel's precision), split v = 65536 hi + 256 mid + lo
           into two unsigned bytes and a signed one, each as a plane of the even and a plane of
           the odd columns: E_lo | O_lo | E_mid | O_mid | E_hi | O_hi, kp / 2 bytes each (kp:
           K rounded up to 128; columns past K are 0 in every plane). Byte b of a row's codes
           holds columns 2b (low nibble) and 2b + 1, so byte b of the planes meets it in
           lin_block. */
        const int64_t K = L->k, group = L->group;
        in->kp = (K + 127) / 128 * 128;
        int32_t *v32 = (int32_t *)xf; /* K int32 in the kp floats of scratch */
        /* tiles: the codes' whole 512-column runs are in the super-chunk order (hfd_simd.h:
           int4_order), and so are the planes: the 16 row bytes k / 2 .. k / 2 + 15 of a run
           (one j) go to 4 runs of 4 bytes, 64 apart */
        const int64_t ordered = L->kind == LIN_INT4_TILED ? K / 512 * 512 : 0;
#if HFD_AVX2_DOTS
        int4_input_avx2(x, x_dt, K, group, in->kp, ordered, v32, in->gsum, in->gunit, in->planes);
#else
        const int64_t G = K / group;
        const __m512i lim = _mm512_set1_epi32(8388607), nlim = _mm512_set1_epi32(-8388607);
        for (int64_t g = 0; g < G; g++) {
            __m512 sum = _mm512_setzero_ps(), mx = _mm512_setzero_ps();
            for (int64_t c = 0; c < group; c += 16) {
                __m512 v = load16(x, g * group + c, x_dt, 0xFFFF);
                sum = _mm512_add_ps(sum, v);
                mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
            }
            in->gsum[g] = _mm512_reduce_add_ps(sum);
            float amax = _mm512_reduce_max_ps(mx);
            in->gunit[g] = amax > 0.f ? amax / 8388607.f : 0.f;
            const __m512 inv = _mm512_set1_ps(amax > 0.f ? 8388607.f / amax : 0.f);
            for (int64_t c = 0; c < group; c += 16) {
                __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, g * group + c, x_dt, 0xFFFF), inv));
                /* fp32 rounding may reach 2^23 */
                _mm512_storeu_si512(v32 + g * group + c, _mm512_max_epi32(_mm512_min_epi32(i, lim), nlim));
            }
        }
        /* past the last group: 0 (a partial last chunk's lanes past K read 16 of these) */
        _mm512_storeu_ps(in->gsum + G, _mm512_setzero_ps());
        _mm512_storeu_ps(in->gunit + G, _mm512_setzero_ps());
        const int64_t half = in->kp / 2;
        uint8_t *plane = in->planes;
        const __m512i byte = _mm512_set1_epi32(255);
        const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
        for (int64_t k = 0; k < in->kp; k += 32) {
            __m512i a = _mm512_maskz_loadu_epi32(mask16(K - k), v32 + k);
            __m512i b = _mm512_maskz_loadu_epi32(mask16(K - k - 16), v32 + k + 16);
            __m512i eo[2] = {_mm512_permutex2var_epi32(a, even, b), _mm512_permutex2var_epi32(a, odd, b)};
            for (int p = 0; p < 2; p++) { /* columns k + 2j + p, j < 16 */
                __m128i bytes[3] = {
                    _mm512_cvtepi32_epi8(_mm512_and_si512(eo[p], byte)),
                    _mm512_cvtepi32_epi8(_mm512_and_si512(_mm512_srli_epi32(eo[p], 8), byte)),
                    _mm512_cvtepi32_epi8(_mm512_srai_epi32(eo[p], 16))};
                for (int t = 0; t < 3; t++) {
                    uint8_t *o = plane + (2 * t + p) * half;
                    if (k < ordered) {
                        const int64_t run = k / 2 & ~(int64_t)(INT4_SUPER - 1);
                        const int64_t j = (k / 2 & (INT4_SUPER - 1)) >> 4;
                        uint32_t w[4];
                        _mm_storeu_si128((__m128i *)w, bytes[t]);
                        for (int i = 0; i < 4; i++) memcpy(o + run + 64 * i + 4 * j, &w[i], 4);
                    } else {
                        _mm_storeu_si128((__m128i *)(o + k / 2), bytes[t]);
                    }
                }
            }
        }
#endif
    }
}

static void prepare_input(const hfd_lin *L, const uint16_t *x, lin_input *in, float *xf) {
    prepare_input_dt(L, x, DT_BF16, in, xf);
}

/* ---- int4 rows (see lin_block for the numerics) ---- */

/* A block of ROWS int4 weight rows: where each row's codes start, and its scales as fp32
   (padded with 16 zeros: a partial last chunk's lanes past K meet them). */
typedef struct {
    const uint8_t *wr[ROWS];
    float scale[ROWS][MAX_GROUPS + 16];
} int4_block;

static void int4_setup(const hfd_lin *L, int64_t n0, int rows, int4_block *b) {
    const int64_t K = L->k, G = K / L->group;
    const int tiled = L->kind == LIN_INT4_TILED;
    for (int r = 0; r < ROWS; r++) {
        int64_t row = n0 + (r < rows ? r : 0);
        b->wr[r] = tile_row(L->w, row, K / 2, tiled);
#if HFD_AVX2_DOTS
        hfd_to_f32(b->scale[r], L->scales, row * G, G, (int)L->s_dt);
        memset(b->scale[r] + G, 0, 16 * sizeof(float));
#else
        for (int64_t g = 0; g < G; g += 16) {
            __mmask16 mk = mask16(G - g);
            _mm512_mask_storeu_ps(b->scale[r] + g, mk, load16(L->scales, row * G + g, (int)L->s_dt, mk));
        }
        _mm512_storeu_ps(b->scale[r] + G, _mm512_setzero_ps());
#endif
    }
    /* The threads take consecutive blocks: the next block's scales and mins are prefetched
       now (its codes one line per 64 bytes read, in int4_dots). */
    const int sz = L->s_dt == DT_F32 ? 4 : 2;
    for (int64_t c = 0; n0 + ROWS < L->n && c < ROWS * G * sz; c += 64) {
        _mm_prefetch((const char *)L->scales + (n0 + ROWS) * G * sz + c, _MM_HINT_T0);
        _mm_prefetch((const char *)L->mins + (n0 + ROWS) * G * sz + c, _MM_HINT_T0);
    }
}

/* out[r] = W[n0 + r] . x (fp32, bias not added) for r < rows, x as prepared in `in`. */
static inline __attribute__((always_inline)) void int4_dots(const hfd_lin *L, const int4_block *b,
                                                            const lin_input *in, int64_t n0,
                                                            int rows, float *out) {
    const int64_t K = L->k, group = L->group, G = K / group, half = in->kp / 2;
    const int tiled = L->kind == LIN_INT4_TILED; /* whole 128-column chunks */
    const int64_t step = tiled ? ROWS : 1;        /* bytes of a row's stream per code byte */
    const uint8_t *const *wr = b->wr;
    const char *next = n0 + ROWS < L->n ? (const char *)L->w + (n0 + ROWS) * (K / 2) : NULL;
    const char *end = (const char *)L->w + L->n * (K / 2);
    float dot[ROWS];
#if HFD_AVX2_DOTS
    const float *sc[ROWS];
    (void)step;
    for (int r = 0; r < ROWS; r++) sc[r] = b->scale[r];
    int4_dots_avx2(wr, sc, K, __builtin_ctzll(group), tiled, in->planes, half, in->gunit, next,
                   end, dot);
#else
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    /* dword j's group within its chunk; group is 32, 64, 128 or 256 (decode.py checks), so
       divisions by it are shifts (an idiv per chunk was ~25 cycles of ~80) */
    const int gshift = __builtin_ctzll(group);
    const __m512i gidx = _mm512_srli_epi32(
        _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3),
        gshift < 7 ? gshift : 7);
    const uint8_t *xe = in->planes, *xo = xe + half; /* lo, mid, hi planes 2 * half apart */
    /* Tiles: whole 512-column runs first, in the super-chunk order (hfd_simd.h: int4_order):
       lane j of load i (chunk 4s + i) holds columns 512s + 32j + 8i .. + 7, so each lane sums
       its run's 32 products as integers over the 4 loads (|lo|, |mid| <= 32 * 15 * 255,
       |hi| <= 32 * 15 * 128) and is scaled once: lo + 256 mid exactly, then + 65536 hi in
       fp32. Lane j's group is (512s + 32j) / group. */
    const int64_t runs = tiled ? K / 512 : 0;
    const __m512i lidx = _mm512_srli_epi32(
        _mm512_slli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 5),
        gshift);
    for (int64_t s = 0; s < runs; s++) {
        __m512i lo[ROWS], mid[ROWS], hi[ROWS];
        for (int r = 0; r < ROWS; r++) lo[r] = mid[r] = hi[r] = _mm512_setzero_si512();
        for (int64_t c = 4 * s; c < 4 * s + 4; c++) {
            const __m512i xel = _mm512_loadu_si512(xe + c * 64), xol = _mm512_loadu_si512(xo + c * 64);
            const __m512i xem = _mm512_loadu_si512(xe + 2 * half + c * 64);
            const __m512i xom = _mm512_loadu_si512(xo + 2 * half + c * 64);
            const __m512i xeh = _mm512_loadu_si512(xe + 4 * half + c * 64);
            const __m512i xoh = _mm512_loadu_si512(xo + 4 * half + c * 64);
            prefetch_tiles(wr[0] + c * 64 * step, end);
            for (int r = 0; r < ROWS; r++) {
                __m512i v = _mm512_loadu_si512(wr[r] + c * 64 * step);
                __m512i even = _mm512_and_si512(v, nibble);
                __m512i odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                lo[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo[r], xel, even), xol, odd);
                mid[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(mid[r], xem, even), xom, odd);
                hi[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi[r], even, xeh), odd, xoh);
            }
        }
        const int64_t gb = (512 * s) >> gshift;
        __m512 unit = _mm512_loadu_ps(in->gunit + gb);
        if (gshift != 5) unit = _mm512_permutexvar_ps(lidx, unit);
        for (int r = 0; r < ROWS; r++) {
            __m512 t = _mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], _mm512_slli_epi32(mid[r], 8)));
            t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_set1_ps(65536.f), t);
            __m512 sc = _mm512_loadu_ps(b->scale[r] + gb);
            if (gshift != 5) sc = _mm512_permutexvar_ps(lidx, sc);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(t, unit), sc, acc[r]);
        }
    }
    for (int64_t c = 4 * runs; c < (K + 127) / 128; c++) {
        const __m512i xel = _mm512_loadu_si512(xe + c * 64), xol = _mm512_loadu_si512(xo + c * 64);
        const __m512i xem = _mm512_loadu_si512(xe + 2 * half + c * 64);
        const __m512i xom = _mm512_loadu_si512(xo + 2 * half + c * 64);
        const __m512i xeh = _mm512_loadu_si512(xe + 4 * half + c * 64);
        const __m512i xoh = _mm512_loadu_si512(xo + 4 * half + c * 64);
        const __mmask64 mk = K - c * 128 >= 128 ? ~0ULL : (1ULL << ((K - c * 128) / 2)) - 1;
        if (tiled)
            prefetch_tiles(wr[0] + c * 64 * step, end);
        else
            prefetch_next_block(next, end, ROWS * c, ROWS, 0);
        const int64_t g0 = (c * 128) >> gshift;
        const __m512 unit = _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(in->gunit + g0));
        for (int r = 0; r < ROWS; r++) {
            __m512i v = _mm512_maskz_loadu_epi8(mk, wr[r] + c * 64 * step);
            __m512i even = _mm512_and_si512(v, nibble);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xel, even); /* u8 x s8 */
            lo = _mm512_dpbusd_epi32(lo, xol, odd);
            __m512i mid = _mm512_dpbusd_epi32(_mm512_setzero_si512(), xem, even);
            mid = _mm512_dpbusd_epi32(mid, xom, odd);
            __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), even, xeh); /* s8 x */
            hi = _mm512_dpbusd_epi32(hi, odd, xoh);
            __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(mid, 8), _mm512_slli_epi32(hi, 16));
            __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, sum)), unit);
            acc[r] = _mm512_fmadd_ps(t, _mm512_permutexvar_ps(gidx, _mm512_loadu_ps(b->scale[r] + g0)), acc[r]);
        }
    }
    for (int r = 0; r < ROWS; r++) dot[r] = _mm512_reduce_add_ps(acc[r]);
#endif
#if HFD_AVX2_DOTS
    for (int r = 0; r < rows; r++) /* the mins come in through the group sums of x */
        out[r] = dot[r] + hfd_dot16_f32(L->mins, (n0 + r) * G, (int)L->s_dt, in->gsum, G,
                                          L->n * G);
#else
    for (int r = 0; r < rows; r++) { /* the mins come in through the group sums of x */
        __m512 m = _mm512_setzero_ps();
        for (int64_t g = 0; g < G; g += 16) {
            __mmask16 mk = mask16(G - g);
            m = _mm512_fmadd_ps(load16(L->mins, (n0 + r) * G + g, (int)L->s_dt, mk),
                                _mm512_maskz_loadu_ps(mk, in->gsum + g), m);
        }
        out[r] = dot[r] + _mm512_reduce_add_ps(m);
    }
#endif
}

/* ---- 4-bit rows times 8-bit x (W4A8) ----
 *
 * The batch-1 form of cpu_qgemm.c's hfd_int4_gemm_a8, in that kernel's numbers to the bit (so
 * a request's tokens do not depend on whether its row was decoded alone or packed with others):
 * per row n and group g the exact integer I = sum q * (code - 8), then, g by g from 0,
 * f = fma(float(I), scale * unit, f); f = fma(min + 8 scale, gsum, f). Here the codes (0..15)
 * meet x's signed codes in vpdpbusd as stored (no panel transposed per call) and
 * I = sum q * code - 8 * qsum, exactly. A64-byte load of a row holds 128 columns, dword lane j
 * the 8 columns 8j .. 8j + 7 (whole 512-column runs of tiles: 512s + 32j + 8i .. for load i,
 * so the run's 4 loads sum lane j over one 32-column piece). A block of A8_BLOCK rows reduces
 * each row's lanes to the 16 pieces of a 512-column span, transposes them so that a lane is a
 * row, adds pieces into groups and runs the fp32 steps for A8_BLOCK rows per instruction, the
 * lane order of the panel kernel's. One vpdpbusd per 64 columns and row, against the bf16
 * activations' three (the byte planes of x's 24-bit fixed point). */
#if HFD_AVX2_DOTS
#define A8_BLOCK 8 /* rows per block: a ymm lane each */

/* the int32 lane sums of 32 code bytes v (64 columns) times x's even / odd codes */
static inline __attribute__((always_inline)) __m256i a8_dot32(__m256i v, __m256i xe, __m256i xo) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i e = _mm256_and_si256(v, nib), o = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#if HFD_AVX_VNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), e, xe), o, xo);
#else /* pairs of 15 * 127: no saturation; their sums in int16 at most 4 * 3810 */
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(e, xe), _mm256_maddubs_epi16(o, xo)),
                             _mm256_set1_epi16(1));
#endif
}
#else
#define A8_BLOCK 16 /* rows per block: a zmm lane each */

/* the int32 lane sums of 64 code bytes v (128 columns) times x's even / odd codes, added to acc */
static inline __attribute__((always_inline)) __m512i a8_dot64(__m512i acc, __m512i v, __m512i xe,
                                                              __m512i xo) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(v, nib), xe);
    return _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(v, 4), nib), xo);
}

/* 4 chunks' lane sums (lane j of p[i]: columns 128i + 8j ..) -> lane k: the 32-column piece k */
static inline __attribute__((always_inline)) __m512i a8_pieces(const __m512i p[4]) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    /* 128-bit lane l: piece l of chunks 0..3 */
    const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    return _mm512_permutexvar_epi32(
        _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), q);
}
#endif

/* out[r] = W[n0 + r] . x in W4A8 (fp32, bias not added) for r < rows (<= A8_BLOCK); gp: the
   group's 32-column pieces, a constant at each call (a8_dots) so that the group loops unroll
   and the pieces stay in registers. */
static inline __attribute__((always_inline)) void a8_dots_g(const hfd_lin *L, const lin_input *in,
                                                            int64_t n0, int rows, float *out,
                                                            const int64_t gp) {
    const int64_t K = L->k, group = L->group, G = K / group, half = in->kp / 2;
    const int tiled = L->kind == LIN_INT4_A8_TILED;
    const int64_t step = tiled ? TILE_ROWS : 1; /* bytes of a row's stream per code byte */
    const int64_t chunks = (K + 127) / 128;
    const uint8_t *wr[A8_BLOCK];
    int64_t row[A8_BLOCK];
    for (int r = 0; r < A8_BLOCK; r++) {
        row[r] = n0 + (r < rows ? r : 0);
        wr[r] = tile_row(L->w, row[r], K / 2, tiled);
    }
    const char *end = (const char *)L->w + L->n * (K / 2);
    const char *next = n0 + A8_BLOCK < L->n ? (const char *)L->w + (n0 + A8_BLOCK) * (K / 2) : NULL;
    const int64_t spans = (chunks + 3) / 4, span_lines = (A8_BLOCK * K / 2 / 64 + spans - 1) / spans;
    const int row_lines = (int)((span_lines + A8_BLOCK - 1) / A8_BLOCK); /* per row's loads */
    const uint8_t *xe = in->planes, *xo = xe + half;
    /* the threads take consecutive blocks: the next block's scales and mins (contiguous rows)
       are fetched now, as int4_setup does */
    const int sz = L->s_dt == DT_F32 ? 4 : 2;
    for (int64_t c = 0; n0 + A8_BLOCK < L->n && c < A8_BLOCK * G * sz; c += 64) {
        _mm_prefetch((const char *)L->scales + (n0 + A8_BLOCK) * G * sz + c, _MM_HINT_T0);
        _mm_prefetch((const char *)L->mins + (n0 + A8_BLOCK) * G * sz + c, _MM_HINT_T0);
    }
#if HFD_AVX2_DOTS
    __m256 f = _mm256_setzero_ps();
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#else
    __m512 f = _mm512_setzero_ps();
#endif
    for (int64_t s = 0; 4 * s < chunks; s++) {
        const int64_t c0 = 4 * s, nc = chunks - c0 < 4 ? chunks - c0 : 4;
        const int whole = tiled && 512 * (s + 1) <= K;
        /* The block's rows are contiguous (tiles or not): the next block's codes are fetched
           a span's share at a time. The streams of its rows are short (a tile, 4 rows, is one
           4 KiB page of a 2048-column weight), too short for the hardware prefetchers: without
           this a 5632 x 2048 weight read from DRAM at 16.8 GB/s, 27.4 for the W4A16 rows.
           AVX-512 (16 rows, 4 tiles side by side) fetches into L2 only: into L1 the next
           block's 16-32 KiB competed with the block being read. Zen 4, 2 threads, 16 such
           weights cycled from DRAM, 3 interleaved runs: 13.5-16.4 GB/s of codes into L1,
           16.8-20.7 into L2; Qwen3-0.6B's int4-a8 decode layers 13.4-15.0 -> 12.1-13.4 ms. The
           avx2 loop (8 rows) was no faster so (16.6-18.1 against 17.1-18.7 GB/s) and keeps
           L1. Not measured on a Xeon. */
#if HFD_AVX2_DOTS
        __m256i V[2][8]; /* V[h][r]: row r's pieces 8h .. 8h + 7 */
        for (int r = 0; r < A8_BLOCK; r++) {
            prefetch_next_block(next, end, s * span_lines + r * row_lines, row_lines, 0);
            if (whole) {
                for (int h = 0; h < 2; h++) {
                    /* without AVX-VNNI: int16 pair sums, at most 4 chunks x 2 x 3810 */
                    __m256i acc = _mm256_setzero_si256();
                    for (int64_t c = c0; c < c0 + 4; c++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + c * 64 * step + 32 * h));
                        const __m256i e = _mm256_loadu_si256((const __m256i *)(xe + c * 64 + 32 * h));
                        const __m256i o = _mm256_loadu_si256((const __m256i *)(xo + c * 64 + 32 * h));
                        const __m256i nib = _mm256_set1_epi8(0x0F);
                        const __m256i ce = _mm256_and_si256(v, nib);
                        const __m256i co = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
#if HFD_AVX_VNNI
                        acc = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, ce, e), co, o);
#else
                        acc = _mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(ce, e),
                                                                     _mm256_maddubs_epi16(co, o)));
#endif
                    }
#if HFD_AVX_VNNI
                    V[h][r] = acc;
#else
                    V[h][r] = _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
                }
            } else {
                __m256i A[4];
                for (int64_t i = 0; i < 4; i++) {
                    __m256i p[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
                    const int64_t c = c0 + i, bytes = i < nc ? (K - 128 * c) / 2 : 0;
                    for (int h = 0; h < 2 && 32 * h < bytes; h++) {
                        const uint8_t *w = wr[r] + c * 64 * step + 32 * h;
                        const __m256i v = bytes - 32 * h >= 32
                            ? _mm256_loadu_si256((const __m256i *)w)
                            : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w));
                        p[h] = a8_dot32(v, _mm256_loadu_si256((const __m256i *)(xe + c * 64 + 32 * h)),
                                        _mm256_loadu_si256((const __m256i *)(xo + c * 64 + 32 * h)));
                    }
                    A[i] = _mm256_hadd_epi32(p[0], p[1]);
                }
                /* [pieces 0 2 4 6 | 1 3 5 7] of chunks 0, 1 (and 2, 3) -> in order */
                V[0][r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(A[0], A[1]), order);
                V[1][r] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(A[2], A[3]), order);
            }
        }
        transpose8_epi32(V[0]); /* V[h][j]: piece 8h + j of every row */
        transpose8_epi32(V[1]);
        const int64_t pieces = (K - 512 * s) / 32 < 16 ? (K - 512 * s) / 32 : 16;
        const int64_t ng = pieces / gp, g0 = 512 * s / group;
        __m256i S[2][8], M[2][8]; /* the span's scales and mins, transposed as V */
        for (int r = 0; r < A8_BLOCK; r++)
            for (int h = 0; h < 2; h++) {
                const int64_t at = row[r] * G + g0 + 8 * h, left = G - g0 - 8 * h;
                S[h][r] = _mm256_castps_si256(hfd_load8_in(L->scales, at, (int)L->s_dt, left, L->n * G));
                M[h][r] = _mm256_castps_si256(hfd_load8_in(L->mins, at, (int)L->s_dt, left, L->n * G));
            }
        for (int h = 0; h < 1 + (ng > 8); h++) {
            transpose8_epi32(S[h]);
            transpose8_epi32(M[h]);
        }
        for (int64_t t = 0; t < 16 / gp; t++) {
            if (t >= ng) break;
            const int64_t g = g0 + t;
            __m256i I = V[(t * gp) / 8][(t * gp) % 8];
            for (int64_t u = t * gp + 1; u < (t + 1) * gp; u++) I = _mm256_add_epi32(I, V[u / 8][u % 8]);
            I = _mm256_sub_epi32(I, _mm256_set1_epi32(8 * in->qsum[g]));
            const __m256 sc = _mm256_castsi256_ps(S[t / 8][t % 8]);
            const __m256 mn = _mm256_add_ps(_mm256_castsi256_ps(M[t / 8][t % 8]),
                                            _mm256_mul_ps(_mm256_set1_ps(8.f), sc));
            f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(sc, _mm256_set1_ps(in->gunit[g])), f);
            f = _mm256_fmadd_ps(mn, _mm256_set1_ps(in->gsum[g]), f);
        }
#else
        __m512i V[A8_BLOCK]; /* row r's pieces, then (transposed) piece j of every row */
        if (whole) {
            __m512i x[8];
            for (int i = 0; i < 4; i++) {
                x[2 * i] = _mm512_loadu_si512(xe + (c0 + i) * 64);
                x[2 * i + 1] = _mm512_loadu_si512(xo + (c0 + i) * 64);
            }
            for (int r = 0; r < A8_BLOCK; r++) {
                prefetch_next_block(next, end, s * span_lines + r * row_lines, row_lines, 1);
                __m512i acc = _mm512_setzero_si512();
                for (int i = 0; i < 4; i++)
                    acc = a8_dot64(acc, _mm512_loadu_si512(wr[r] + (c0 + i) * 64 * step), x[2 * i],
                                   x[2 * i + 1]);
                V[r] = acc;
            }
        } else {
            for (int r = 0; r < A8_BLOCK; r++) {
                prefetch_next_block(next, end, s * span_lines + r * row_lines, row_lines, 1);
                __m512i p[4];
                for (int64_t i = 0; i < 4; i++) {
                    p[i] = _mm512_setzero_si512();
                    if (i >= nc) continue;
                    const int64_t c = c0 + i, bytes = (K - 128 * c) / 2;
                    const __mmask64 mk = bytes >= 64 ? ~0ULL : (1ULL << bytes) - 1;
                    p[i] = a8_dot64(p[i], _mm512_maskz_loadu_epi8(mk, wr[r] + c * 64 * step),
                                    _mm512_loadu_si512(xe + c * 64), _mm512_loadu_si512(xo + c * 64));
                }
                V[r] = a8_pieces(p);
            }
        }
        transpose16_epi32(V);
        const int64_t pieces = (K - 512 * s) / 32 < 16 ? (K - 512 * s) / 32 : 16;
        const int64_t ng = pieces / gp, g0 = 512 * s / group;
        __m512i S[A8_BLOCK], M[A8_BLOCK]; /* the span's scales and mins, transposed as V */
        for (int r = 0; r < A8_BLOCK; r++) {
            S[r] = _mm512_castps_si512(load16(L->scales, row[r] * G + g0, (int)L->s_dt, mask16(ng)));
            M[r] = _mm512_castps_si512(load16(L->mins, row[r] * G + g0, (int)L->s_dt, mask16(ng)));
        }
        transpose16_epi32(S);
        transpose16_epi32(M);
        for (int64_t t = 0; t < 16 / gp; t++) {
            if (t >= ng) break;
            const int64_t g = g0 + t;
            __m512i I = V[t * gp];
            for (int64_t u = t * gp + 1; u < (t + 1) * gp; u++) I = _mm512_add_epi32(I, V[u]);
            I = _mm512_sub_epi32(I, _mm512_set1_epi32(8 * in->qsum[g]));
            const __m512 sc = _mm512_castsi512_ps(S[t]);
            const __m512 mn = _mm512_add_ps(_mm512_castsi512_ps(M[t]),
                                            _mm512_mul_ps(_mm512_set1_ps(8.f), sc));
            f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(sc, _mm512_set1_ps(in->gunit[g])), f);
            f = _mm512_fmadd_ps(mn, _mm512_set1_ps(in->gsum[g]), f);
        }
#endif
    }
    float o[A8_BLOCK];
#if HFD_AVX2_DOTS
    _mm256_storeu_ps(o, f);
#else
    _mm512_storeu_ps(o, f);
#endif
    for (int r = 0; r < rows; r++) out[r] = o[r];
}

static void a8_dots(const hfd_lin *L, const lin_input *in, int64_t n0, int rows, float *out) {
    switch (L->group) { /* 32 .. 256 (hfd_int4_a8_rows, kernels/decode.py check) */
        case 32: a8_dots_g(L, in, n0, rows, out, 1); break;
        case 64: a8_dots_g(L, in, n0, rows, out, 2); break;
        case 128: a8_dots_g(L, in, n0, rows, out, 4); break;
        default: a8_dots_g(L, in, n0, rows, out, 8); break;
    }
}

/* out[r] = W[n0 + r] . x (fp32, bias not added) for r < rows (<= ROWS). */
static void lin_block(const hfd_lin *L, const lin_input *in, int64_t n0, int rows, float *out) {
    const int64_t K = L->k;
    if (L->kind == LIN_INT8 || L->kind == LIN_INT8_TILED) {
        const int tiled = L->kind == LIN_INT8_TILED; /* ROWS == INT8_ROWS */
        const int8_t *wr[ROWS];
        for (int r = 0; r < ROWS; r++)
            wr[r] = (const int8_t *)tile_row(L->w, n0 + (r < rows || tiled ? r : 0), K, tiled);
        int64_t s[ROWS];
        const int8_t *end = (const int8_t *)L->w + L->n * K;
        if (tiled)
            int8_dots(wr, L->rowsum + n0, rows, in->planes, in->kp, K, s, NULL, end, 1);
        else
            int8_dots(wr, L->rowsum + n0, rows, in->planes, in->kp, K, s,
                      n0 + ROWS < L->n ? wr[0] + ROWS * K : NULL, end, 0);
        for (int r = 0; r < rows; r++)
            out[r] = (float)((double)s[r] * in->unit) * load_f32(L->scales, n0 + r, (int)L->s_dt);
        return;
    }
#if HFD_AVX2_DOTS
    if (L->kind == LIN_BF16) { /* K % 32 == 0 (kernels/decode.py) */
        bf16_dots_avx2((const uint16_t *)L->w + n0 * K, K, rows, (const uint16_t *)in->x, 0, 1,
                       K, PREFETCH, out, 0);
        return;
    }
#endif
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
    if (L->kind == LIN_BF16) { /* one row at a time: hfd_avx2.h's bf16_dots_avx2 says why */
        for (int r = 0; r < rows; r++) {
            const uint16_t *wr = (const uint16_t *)L->w + (n0 + r) * K;
            for (int64_t k = 0; k < K; k += 32) {
                _mm_prefetch((const char *)(wr + k) + PREFETCH, _MM_HINT_T0);
                acc[r] = _mm512_dpbf16_ps(acc[r], as_bh(_mm512_loadu_si512(wr + k)),
                                          as_bh(_mm512_loadu_si512(in->x + k)));
            }
            out[r] = _mm512_reduce_add_ps(acc[r]);
        }
        return;
    }
    /* int4. A 64-byte load of a row's codes holds 128 columns: its low nibbles the even ones,
       its high nibbles the odd ones, dword j columns 8j .. 8j + 7. Each meets the byte planes
       of x (prepare_input) in vpdpbusd: codes (0..15) times the unsigned low and middle bytes,
       and times the signed high bytes, integer sums (a lane: 8 codes times a byte per chunk),
       combined as lo + 256 mid + 65536 hi (|sum| < 2^31) and converted to fp32. Dword j's 8
       columns lie in one group, (128 c + 8 j) / group, so one permute each of the row's fp32
       scales and of x's gunit per chunk applies them; the mins come in through the group sums
       of x.
       Against decoding nibbles to bf16 for vdpbf16ps (~18 vector-port slots per 128 columns
       and row, vdpbf16ps taking two): 15 single-slot ops. 22 Llama-1.1B MLPs from DRAM, 6
       interleaved runs: 20.9-21.8 -> 20.0-21.0 ms; the model's 22 layers, 3 interleaved runs:
       31.6-37.7 -> 29.3-36.2 ms (0.7-2.3 ms less in each pair). A 16-bit x (two planes) was
       no faster and flipped the bf16 rounding of up to 16% of outputs on inputs spanning 5
       decades within a group. Tiles hold whole 512-column runs in an order of their own, so
       that those lanes are combined and scaled once per run (see below). */
    int4_block b;
    int4_setup(L, n0, rows, &b);
    int4_dots(L, &b, in, n0, rows, out);
}

/* Rows of the linears lin[0..count) (all reading the same x), split in ROWS blocks over the
   threads of the enclosing parallel region: y[j][n] = (W_j x + bias_j)[n] in fp32. */
static void lin_rows(const hfd_lin *const *lin, const lin_input *in, int count, float *const *y) {
    int64_t blocks = 0, first[8], size[8];
    for (int j = 0; j < count; j++) {
        first[j] = blocks;
        size[j] = is_a8(lin[j]) ? A8_BLOCK : ROWS;
        blocks += (lin[j]->n + size[j] - 1) / size[j];
    }
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        int j = 0;
        while (j + 1 < count && b >= first[j + 1]) j++;
        const hfd_lin *L = lin[j];
        int64_t n0 = (b - first[j]) * size[j];
        int rows = (int)(L->n - n0 < size[j] ? L->n - n0 : size[j]);
        float out[A8_BLOCK > ROWS ? A8_BLOCK : ROWS];
        if (is_a8(L)) {
            a8_dots(L, &in[j], n0, rows, out);
            if (L->bias) { /* as the torch path adds it: to the product rounded to bf16 */
                uint16_t ob[A8_BLOCK];
                round_row(out, ob, rows);
                for (int r = 0; r < rows; r++) out[r] = load_f32(ob, r, DT_BF16);
            }
        } else {
            lin_block(L, &in[j], n0, rows, out);
        }
        for (int r = 0; r < rows; r++)
            y[j][n0 + r] = out[r] + (L->bias ? load_f32(L->bias, n0 + r, (int)L->b_dt) : 0.f);
    }
}

/* An RMSNorm in bf16, r = rsqrt(mean(x^2) + eps) in fp32, the weight multiply by `style`:
   NORM_RMS (HF's LlamaRMSNorm): out = bf16(w * bf16(x * r));
   NORM_RMS_FP32 (Olmo2RMSNorm): out = bf16(w * (x * r)), the product in fp32;
   NORM_RMS_UNIT (Gemma's RMSNorm): out = bf16((x * r) * (1 + w)), in fp32. */
static void rms_norm_bf16(const uint16_t *x, const uint16_t *w, int64_t n, float eps, int64_t style,
                          uint16_t *out) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
        __m512 v = load16(x, c, DT_BF16, mask16(n - c));
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    float r = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
    const __m512 one = _mm512_set1_ps(style == NORM_RMS_UNIT ? 1.0f : 0.0f);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 h = _mm512_mul_ps(load16(x, c, DT_BF16, mk), _mm512_set1_ps(r));
        if (style == NORM_RMS) h = bf16_round(h);
        store16_bf16(out + c, mk, _mm512_mul_ps(h, _mm512_add_ps(load16(w, c, DT_BF16, mk), one)));
    }
}

/* torch's CPU LayerNorm in bf16: mean and biased variance in fp32, then
   out = bf16((x * rstd + (-mean * rstd)) * w + b), one rounding (b NULL: no bias). */
static void layer_norm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *b, int64_t n,
                            float eps, uint16_t *out) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) s = _mm512_add_ps(s, load16(x, c, DT_BF16, mask16(n - c)));
    const float mean = _mm512_reduce_add_ps(s) / (float)n;
    __m512 ss = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(mean);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 dv = _mm512_maskz_sub_ps(mk, load16(x, c, DT_BF16, mk), mv);
        ss = _mm512_fmadd_ps(dv, dv, ss);
    }
    const float rstd = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps);
    const __m512 r = _mm512_set1_ps(rstd), shift = _mm512_set1_ps(-mean * rstd);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 y = _mm512_mul_ps(_mm512_fmadd_ps(load16(x, c, DT_BF16, mk), r, shift),
                                 load16(w, c, DT_BF16, mk));
        if (b) y = _mm512_add_ps(y, load16(b, c, DT_BF16, mk));
        store16_bf16(out + c, mk, y);
    }
}

/* The layer's norm `which` of one row: 1 before attention, 2 before the MLP, 3 after
   attention, 4 after the MLP (sandwich). An absent norm (NULL weight) copies x. */
static void norm_bf16(const hfd_layer *L, int which, const uint16_t *x, uint16_t *out) {
    const uint16_t *w = which == 1 ? L->ln1 : which == 2 ? L->ln2 : which == 3 ? L->ln3 : L->ln4;
    const float eps = which == 1 ? L->eps1 : which == 2 ? L->eps2 : which == 3 ? L->eps3 : L->eps4;
    if (!w)
        memmove(out, x, (size_t)L->hidden * 2);
    else if (L->norm == NORM_LAYER)
        layer_norm_bf16(x, w, which == 1 ? L->ln1_b : L->ln2_b, L->hidden, eps, out);
    else
        rms_norm_bf16(x, w, L->hidden, eps, L->norm, out);
}

/* q = bf16(q * s) for n elements (OPT's query scaling, after the projection's rounding). */
static void scale_bf16(uint16_t *q, int64_t n, float s) {
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        store16_bf16(q + c, mk, _mm512_mul_ps(load16(q, c, DT_BF16, mk), sv));
    }
}

/* max(v, 0) with NaN kept NaN, as torch.relu (vmaxps would return 0 for NaN). */
static inline __m512 relu_ps(__m512 v) {
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ),
                              _mm512_setzero_ps());
}

/* a[c] = bf16(relu(bf16(y[c]))) for c < n (y fp32: fc1's output with its bias). */
static void relu_row(const float *y, uint16_t *a, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        store16_bf16(a + c, mk, relu_ps(_mm512_maskz_loadu_ps(mk, y + c)));
    }
}

/* out = bf16(a + bf16(b)) for n elements (b fp32: a projection's output before rounding);
   with m != 0, out = bf16(a + bf16(bf16(b) * m)) (Granite's residual multiplier). */
static void residual_bf16(const uint16_t *a, const float *b, int64_t n, float m, uint16_t *out) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 v = bf16_round(_mm512_maskz_loadu_ps(mk, b + c));
        if (m != 0.f) v = bf16_round(_mm512_mul_ps(v, _mm512_set1_ps(m)));
        store16_bf16(out + c, mk, _mm512_add_ps(load16(a, c, DT_BF16, mk), v));
    }
}

/* x (heads x d, bf16) rotated in place: x = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))
   with bf16 cos / sin (rope ROPE_BF16); with fp32 cos / sin (ROPE_FP32, OLMo 2: bf16 q times
   fp32 cos promotes to fp32) x = bf16(x * cos + rotate_half(x) * sin), each product and the
   sum in fp32 (no fused multiply-add: eager rounds each). Only the first `rot` of each head's
   d values rotate (rotate_half within them, cos / sin [rot]); the others stay as they are
   (partial rotary, HF's q_pass: rot < d; the masked loads take any even rot). */
static void rotate_fp32(uint16_t *x, int64_t heads, int64_t d, int64_t rot, const float *cos,
                        const float *sin) {
    int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (int64_t c = 0; c < half; c += 16) {
            __mmask16 mk = mask16(half - c);
            __m512 lo = load16(v, c, DT_BF16, mk), hi = load16(v, half + c, DT_BF16, mk);
            __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
            __m512 a = _mm512_add_ps(_mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mk, cos + c)),
                                     _mm512_mul_ps(neg_hi, _mm512_maskz_loadu_ps(mk, sin + c)));
            __m512 b = _mm512_add_ps(_mm512_mul_ps(hi, _mm512_maskz_loadu_ps(mk, cos + half + c)),
                                     _mm512_mul_ps(lo, _mm512_maskz_loadu_ps(mk, sin + half + c)));
            store16_bf16(v + c, mk, a);
            store16_bf16(v + half + c, mk, b);
        }
    }
}

static void rotate_bf16(uint16_t *x, int64_t heads, int64_t d, int64_t rot, const uint16_t *cos,
                        const uint16_t *sin) {
    int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (int64_t c = 0; c < half; c += 16) {
            __mmask16 mk = mask16(half - c);
            __m512 lo = load16(v, c, DT_BF16, mk), hi = load16(v, half + c, DT_BF16, mk);
            __m512 neg_hi = _mm512_sub_ps(_mm512_setzero_ps(), hi);
            __m512 a = _mm512_add_ps(bf16_round(_mm512_mul_ps(lo, load16(cos, c, DT_BF16, mk))),
                                     bf16_round(_mm512_mul_ps(neg_hi, load16(sin, c, DT_BF16, mk))));
            __m512 b = _mm512_add_ps(bf16_round(_mm512_mul_ps(hi, load16(cos, half + c, DT_BF16, mk))),
                                     bf16_round(_mm512_mul_ps(lo, load16(sin, half + c, DT_BF16, mk))));
            store16_bf16(v + c, mk, a);
            store16_bf16(v + half + c, mk, b);
        }
    }
}

/* x (heads x d, bf16) rotated in place over interleaved pairs (ERNIE 4.5, Helium, GLM): pair j
   of a head's first `rot` values, (x[2j], x[2j + 1]), by cos[j] and sin[j] (the first half of
   Llama's cat(freqs, freqs) tables, as HF's repeat_interleave reads them):
   out[2j] = x[2j] cos[j] - x[2j + 1] sin[j], out[2j + 1] = x[2j + 1] cos[j] + x[2j] sin[j].
   fp32 = 0: bf16 cos / sin, each product and the sum rounded to bf16 (eager in bf16); 1: fp32
   cos / sin, the products and the sum in fp32 (no fused multiply-add), rounded once (ERNIE 4.5
   casts q to fp32). A lane computes x * c + swap(x) * (-+s): (-x) s and -(x s) are the same
   number, so this is eager's rotate_half product. */
static void rotate_pairs(uint16_t *x, int64_t heads, int64_t d, int64_t rot, const void *cos,
                         const void *sin, int fp32) {
    const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (int64_t c = 0; c < rot; c += 16) {
            __mmask16 mk = mask16(rot - c), mk8 = mask16((rot - c < 16 ? rot - c : 16) / 2);
            __m512 xv = load16(v, c, DT_BF16, mk);
            __m512 cv = load16(cos, c / 2, fp32 ? DT_F32 : DT_BF16, mk8);
            __m512 sv = load16(sin, c / 2, fp32 ? DT_F32 : DT_BF16, mk8);
            cv = _mm512_permutexvar_ps(dup, cv);
            sv = _mm512_permutexvar_ps(dup, sv);
            sv = _mm512_mask_sub_ps(sv, (__mmask16)0x5555, _mm512_setzero_ps(), sv);
            __m512 a = _mm512_mul_ps(xv, cv), b = _mm512_mul_ps(_mm512_permutexvar_ps(swap, xv), sv);
            if (!fp32) {
                a = bf16_round(a);
                b = bf16_round(b);
            }
            store16_bf16(v + c, mk, _mm512_add_ps(a, b));
        }
    }
}

/* The q / k norms in place, in the layer's RMSNorm numerics (nothing without q_norm): each head
   of q [heads * d] and k [kv_heads * d] over its d values (Qwen3, Gemma 3), or the whole q and
   the whole k (qk_norm_full: OLMo 2, before the head split). */
static void head_norms_bf16(const hfd_layer *L, uint16_t *q, uint16_t *k) {
    if (!L->q_norm) return;
    const int64_t d = L->head_dim, style = L->norm == NORM_LAYER ? NORM_RMS : L->norm;
    if (L->qk_norm_full) {
        rms_norm_bf16(q, L->q_norm, L->heads * d, L->q_eps, style, q);
        rms_norm_bf16(k, L->k_norm, L->kv_heads * d, L->k_eps, style, k);
        return;
    }
    for (int64_t h = 0; h < L->heads; h++)
        rms_norm_bf16(q + h * d, L->q_norm, d, L->q_eps, style, q + h * d);
    for (int64_t h = 0; h < L->kv_heads; h++)
        rms_norm_bf16(k + h * d, L->k_norm, d, L->k_eps, style, k + h * d);
}

/* The number of leading dims of each head that RoPE rotates (the width of cos / sin). */
static inline int64_t rope_width(const hfd_layer *L) {
    return L->rotary_dim ? L->rotary_dim : L->head_dim;
}

/* q and k rotated in place, as the layer's rope says (cos / sin bf16 or fp32 [rope_width]). */
static void rope_qk(const hfd_layer *L, uint16_t *q, uint16_t *k, const void *cos, const void *sin) {
    const int64_t d = L->head_dim, r = rope_width(L);
    if (L->rope == ROPE_BF16_PAIRS || L->rope == ROPE_FP32_PAIRS) {
        rotate_pairs(q, L->heads, d, r, cos, sin, L->rope == ROPE_FP32_PAIRS);
        rotate_pairs(k, L->kv_heads, d, r, cos, sin, L->rope == ROPE_FP32_PAIRS);
    } else if (L->rope == ROPE_FP32) {
        rotate_fp32(q, L->heads, d, r, (const float *)cos, (const float *)sin);
        rotate_fp32(k, L->kv_heads, d, r, (const float *)cos, (const float *)sin);
    } else if (L->rope) {
        rotate_bf16(q, L->heads, d, r, (const uint16_t *)cos, (const uint16_t *)sin);
        rotate_bf16(k, L->kv_heads, d, r, (const uint16_t *)cos, (const uint16_t *)sin);
    }
}

/* What follows q / k / v's projections, in place on one token's q and k: the q / k norms, the
   query scale (OPT) and RoPE, or RoPE before the norms (qk_norm_after_rope: HunYuan). */
static void qk_finish(const hfd_layer *L, uint16_t *q, uint16_t *k, const void *cos,
                      const void *sin) {
    if (!L->qk_norm_after_rope) head_norms_bf16(L, q, k);
    if (L->q_scale != 0.f) scale_bf16(q, L->heads * L->head_dim, L->q_scale);
    rope_qk(L, q, k, cos, sin);
    if (L->qk_norm_after_rope) head_norms_bf16(L, q, k);
}

/* Scratch of one call: kp-rounded buffers for up to 3 inputs' planes, int4 group sums and
   units. */
typedef struct {
    void *mem;
    float *xf;
    uint8_t *planes;
    float *gsum;
    float *gunit;
    int32_t *qsum;
    int64_t kp;
} scratch;

static int scratch_init(scratch *s, int64_t K) {
    s->kp = (K + 127) / 128 * 128;
    size_t bytes = (size_t)s->kp * (4 + 3 * 4 + 3 * 4 + 3 * 4) + 3 * (size_t)X_BYTES(s->kp);
    s->mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!s->mem) return -2;
    s->xf = (float *)s->mem;
    s->planes = (uint8_t *)(s->xf + s->kp);
    s->gsum = (float *)(s->planes + 3 * X_BYTES(s->kp));
    s->gunit = s->gsum + 3 * s->kp;
    s->qsum = (int32_t *)(s->gunit + 3 * s->kp);
    return 0;
}

static void inputs_for(const hfd_lin *const *lin, int count, const uint16_t *x, scratch *s,
                       lin_input *in) {
    for (int j = 0; j < count; j++) {
        in[j].planes = s->planes + j * X_BYTES(s->kp);
        in[j].gsum = s->gsum + j * s->kp;
        in[j].gunit = s->gunit + j * s->kp;
        in[j].qsum = s->qsum + j * s->kp;
        int shared = -1; /* int4 and W4A8 inputs depend on x, the group and the layout only:
                            q|k|v and gate|up share */
        for (int i = 0; i < j && (is_int4(lin[j]) || is_a8(lin[j])); i++)
            if (lin[i]->kind == lin[j]->kind && lin[i]->group == lin[j]->group) shared = i;
        if (shared >= 0)
            in[j] = in[shared];
        else
            prepare_input(lin[j], x, &in[j], s->xf);
    }
}

/* q [heads * d], k, v [kv_heads * d] (bf16) of one token from x [hidden]; cos, sin
   [rope_width]. */
int hfd_decode_attn_in(const hfd_layer *L, const uint16_t *x, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *q, uint16_t *k, uint16_t *v, int nthreads) {
    const int64_t H = L->hidden, d = L->head_dim;
    const int64_t nq = L->heads * d, nkv = L->kv_heads * d;
    scratch s;
    uint16_t *h = (uint16_t *)malloc((size_t)H * 2);
    float *y = (float *)malloc((size_t)(nq + 2 * nkv) * sizeof(float));
    if (!h || !y || scratch_init(&s, H)) {
        free(h); free(y);
        return -2;
    }
    norm_bf16(L, 1, x, h);
    const hfd_lin *lin[3] = {&L->lin[L_Q], &L->lin[L_K], &L->lin[L_V]};
    lin_input in[3];
    inputs_for(lin, 3, h, &s, in);
    float *ys[3] = {y, y + nq, y + nq + nkv};
#pragma omp parallel num_threads(nthreads)
    lin_rows(lin, in, 3, ys);
    round_row(ys[0], q, nq);
    round_row(ys[1], k, nkv);
    round_row(ys[2], v, nkv);
    qk_finish(L, q, k, cos, sin);
    free(h);
    free(y);
    free(s.mem);
    return 0;
}

/* tanh(v) = 1 - 2 / (exp(2v) + 1): exactly -1 / 1 where exp under- / overflows. */
static inline __m512 tanh_ps(__m512 v) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp_ps(_mm512_add_ps(v, v));
    return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
}

/* Gemma 2's soft-capped scores in the torch path's numerics (kernels/attention.py:
   attention_ref, HF's eager ops in bf16): s = bf16(q . k) -> bf16(s * scale) ->
   bf16(s / cap) -> bf16(tanh(s)) -> bf16(s * cap), 16 at a time. */
static inline __m512 softcap_scores(__m512 dots, float scale, float cap) {
    __m512 s = bf16_round(_mm512_mul_ps(bf16_round(dots), _mm512_set1_ps(scale)));
    s = bf16_round(tanh_ps(bf16_round(_mm512_div_ps(s, _mm512_set1_ps(cap)))));
    return bf16_round(_mm512_mul_ps(s, _mm512_set1_ps(cap)));
}

#define MAX_D 256 /* head_dim the attention's accumulators hold (injection/native_layer.py) */

static inline __attribute__((always_inline)) float key_dot(const uint16_t *q, const uint16_t *kr,
                                                           int64_t d);
static inline float softmax_probs(float *sc, int64_t s0, int64_t sk, float scale, float softcap);
static void scores_heads(const uint16_t *q, int64_t qhs, int64_t g, const uint16_t *kc,
                         int64_t kss, int64_t s0, int64_t sk, int64_t d, const uint8_t *keep,
                         float scale, float softcap, float *sc, const int64_t *ix);

/* The first key a sliding window (window > 0) lets the query read: the query's key is the last
   one keep allows. 0 without a window. */
static inline int64_t window_start(const uint8_t *keep, int64_t sk, int64_t window) {
    if (window <= 0) return 0;
    int64_t last = sk - 1;
    while (keep && last >= 0 && !keep[last]) last--;
    return last + 1 > window ? last + 1 - window : 0;
}

#define GROUP_MAX 8 /* query heads attend_heads takes at once */

/* One pass of pv_heads over the keys: dims i .. i + NV vectors (NV <= 8, a literal, as are G
   and skip_zero, so the sums stay in registers: over a variable count of vectors gcc kept them
   on the stack, a store and a load in each fma's chain) of the G heads' sums, each v row's part
   loaded once. Skipped: keys keep masks, or with skip_zero (attend) keys of probability 0. */
static inline __attribute__((always_inline)) void pv_pass(
        const float *sc, int64_t scs, const int G, const uint16_t *vc, int64_t vss, int64_t s0,
        int64_t sk, const uint8_t *keep, const float *inv, uint16_t *o, int64_t ohs,
        const int64_t *ix, int64_t i, const int NV, const int skip_zero) {
#if HFD_AVX2_DOTS
    __m256 acc[GROUP_MAX][8], v[8];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < NV; j++) acc[h][j] = _mm256_setzero_ps();
    for (int64_t s = s0; s < sk; s++) {
        if (skip_zero ? sc[s] == 0.f : keep && !keep[s]) continue;
        const uint16_t *vr = vc + (ix ? ix[s] : s) * vss + i;
        for (int j = 0; j < NV; j++) v[j] = hfd_load8(vr, j * 8, DT_BF16, 8);
        for (int h = 0; h < G; h++) {
            const __m256 p = _mm256_set1_ps(sc[h * scs + s]);
            for (int j = 0; j < NV; j++) acc[h][j] = _mm256_fmadd_ps(p, v[j], acc[h][j]);
        }
    }
    for (int h = 0; h < G; h++) {
        const __m256 iv = _mm256_set1_ps(inv[h]);
        for (int j = 0; j < NV; j++)
            hfd_store8_bf16(o + h * ohs + i + j * 8, _mm256_mul_ps(acc[h][j], iv));
    }
#else
    __m512 acc[GROUP_MAX][8], v[8];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < NV; j++) acc[h][j] = _mm512_setzero_ps();
    for (int64_t s = s0; s < sk; s++) {
        if (skip_zero ? sc[s] == 0.f : keep && !keep[s]) continue;
        const uint16_t *vr = vc + (ix ? ix[s] : s) * vss + i;
        for (int j = 0; j < NV; j++) v[j] = load16(vr, j * 16, DT_BF16, 0xFFFF);
        for (int h = 0; h < G; h++) {
            const __m512 p = _mm512_set1_ps(sc[h * scs + s]);
            for (int j = 0; j < NV; j++) acc[h][j] = _mm512_fmadd_ps(p, v[j], acc[h][j]);
        }
    }
    for (int h = 0; h < G; h++) {
        const __m512 iv = _mm512_set1_ps(inv[h]);
        for (int j = 0; j < NV; j++)
            store16_bf16(o + h * ohs + i + j * 16, 0xFFFF, _mm512_mul_ps(acc[h][j], iv));
    }
#endif
}

/* The sum over v of G heads at once (G <= GROUP_MAX, a literal at each call): head h's
   probabilities at sc + h * scs, its output o + h * ohs times inv[h]. Each v row is loaded once
   for the G heads, in passes over the keys of as many dims as keep the G heads' sums in
   registers with enough of them to hide the fmas' latency (64 / 32 dims with AVX-512 for G up
   to 4 / more, 64 / 32 / 16 on the avx2 tier for G 1 / 2 / more). Each head's sums run lane
   for lane, key after key. attend (one head, skip_zero) skips a key whose probability is 0;
   attend_heads skips only keys keep masks and adds the others' 0 * v, which leaves a sum that
   starts at +0 as it was (it cannot become -0) wherever v is finite: attend's bits. */
static inline __attribute__((always_inline)) void pv_heads(
        const float *sc, int64_t scs, const int G, const uint16_t *vc, int64_t vss, int64_t s0,
        int64_t sk, int64_t d, const uint8_t *keep, const float *inv, uint16_t *o, int64_t ohs,
        const int64_t *ix, const int skip_zero) {
    for (int64_t i = 0; i < d;) { /* d % 32 == 0 */
#if HFD_AVX2_DOTS
        if (G == 1 && d - i >= 64) {
            pv_pass(sc, scs, G, vc, vss, s0, sk, keep, inv, o, ohs, ix, i, 8, skip_zero);
            i += 64;
        } else if (G <= 2) {
            pv_pass(sc, scs, G, vc, vss, s0, sk, keep, inv, o, ohs, ix, i, 4, skip_zero);
            i += 32;
        } else {
            pv_pass(sc, scs, G, vc, vss, s0, sk, keep, inv, o, ohs, ix, i, 2, skip_zero);
            i += 16;
        }
#else
        if (G <= 4 && d - i >= 64) {
            pv_pass(sc, scs, G, vc, vss, s0, sk, keep, inv, o, ohs, ix, i, 4, skip_zero);
            i += 64;
        } else {
            pv_pass(sc, scs, G, vc, vss, s0, sk, keep, inv, o, ohs, ix, i, 2, skip_zero);
            i += 32;
        }
#endif
    }
}

/* One query head against sk cached keys: o = softmax(q . k * scale) v. Without a soft-cap,
   torch's CPU flash attention numerics (see the header); with one (softcap != 0), the torch
   path's eager numerics: bf16 scores (softcap_scores), fp32 softmax normalized before its
   probabilities are rounded to bf16, then the fp32 sum over v rounded once. A sliding window
   (window > 0) attends only the `window` keys up to the query's own, HF's mask (kv > q -
   window): the query's key is the last one keep allows (causal decode), which in a static
   cache's buffer is not the buffer's last. sc: sk floats of scratch. ix: NULL (key s at
   kc + s * kss, likewise v) or the slot of each key (key s at kc + ix[s] * kss: rows of a paged
   cache read where they are, in the order of the caller's read index). */
static void attend(const uint16_t *q, const uint16_t *kc, int64_t kss, const uint16_t *vc,
                   int64_t vss, int64_t sk, int64_t d, const uint8_t *keep, float scale,
                   float softcap, int64_t window, float *sc, uint16_t *o, const int64_t *ix) {
    const int64_t s0 = window_start(keep, sk, window);
    scores_heads(q, 0, 1, kc, kss, s0, sk, d, keep, scale, softcap, sc, ix);
    const float total = softmax_probs(sc, s0, sk, scale, softcap);
    if (total == 0.f) { /* nothing to attend (a padding row): zeros, never NaN */
        memset(o, 0, (size_t)d * 2);
        return;
    }
    const float inv = softcap == 0.f ? 1.0f / total : 1.0f;
    pv_heads(sc, 0, 1, vc, vss, s0, sk, d, NULL, &inv, o, 0, ix, 1);
}

/* q . k of one query head and one key row: vdpbf16ps over d (d % 32 == 0), its lanes summed in
   gcc's _mm512_reduce_add_ps order; on the avx2 tier the same sums lane for lane. */
static inline __attribute__((always_inline)) float key_dot(const uint16_t *q, const uint16_t *kr,
                                                           int64_t d) {
#if HFD_AVX2_DOTS
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < d; c += 32) {
        __m256 qh[2], ql[2];
        hfd_bf16_split(q + c, qh, ql);
        hfd_dpbf16_avx2(a, kr + c, qh, ql);
    }
    return hfd_reduce16_ps(a[0], a[1]);
#else
    __m512 acc = _mm512_setzero_ps();
    for (int64_t c = 0; c < d; c += 32)
        acc = _mm512_dpbf16_ps(acc, as_bh(_mm512_loadu_si512(kr + c)),
                               as_bh(_mm512_loadu_si512(q + c)));
    return _mm512_reduce_add_ps(acc);
#endif
}

/* The scores sc[s0 .. sk) (q . k * scale without a soft-cap, q . k with one; masked keys -inf)
   -> what the sum over v reads: without a soft-cap exp(s - max) rounded to bf16 (the sum is
   divided by the returned total after), with one the normalized probabilities rounded to bf16.
   Returns the sum of the exponentials (>= 1), or 0 where every key is masked. */
static inline float softmax_probs(float *sc, int64_t s0, int64_t sk, float scale, float softcap) {
#if HFD_AVX2_DOTS
    if (softcap == 0.f) { /* below, by 256-bit instructions: the same operations lane for lane */
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int64_t s = s0;
        for (; s + 8 <= sk; s += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(sc + s), m8);
        float m[8], mx = -INFINITY;
        _mm256_storeu_ps(m, m8);
        for (int i = 0; i < 8; i++) mx = m[i] > mx ? m[i] : mx;
        for (; s < sk; s++) mx = sc[s] > mx ? sc[s] : mx;
        if (mx == -INFINITY) return 0.f;
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* lanes 0-7, 8-15 */
        for (s = s0; s < sk; s += 8) {
            float rest[8];
            const int64_t n = sk - s < 8 ? sk - s : 8;
            float *at = sc + s;
            if (n < 8) { /* past the keys: -inf, whose exp adds +0 (the masked lanes' zeros) */
                for (int i = 0; i < 8; i++) rest[i] = i < n ? sc[s + i] : -INFINITY;
                at = rest;
            }
            const __m256 e = hfd_exp8_ps(_mm256_sub_ps(_mm256_loadu_ps(at), mv));
            sum[(s - s0) / 8 % 2] = _mm256_add_ps(sum[(s - s0) / 8 % 2], e);
            _mm256_storeu_ps(at, _mm256_castsi256_ps(_mm256_slli_epi32(hfd_bf16_bits8(e), 16)));
            if (n < 8) memcpy(sc + s, rest, (size_t)n * sizeof(float));
        }
        return hfd_reduce16_ps(sum[0], sum[1]);
    }
#endif
    if (softcap != 0.f) {
        for (int64_t s = s0; s < sk; s += 16) {
            __mmask16 mk = mask16(sk - s);
            __m512 v = _mm512_maskz_loadu_ps(mk, sc + s);
            __mmask16 live = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ) & mk;
            _mm512_mask_storeu_ps(sc + s, live, softcap_scores(v, scale, softcap));
        }
    }
    /* the largest score, NaN skipped as `if (sc[s] > mx) mx = sc[s]` skips it (vmaxps returns
       its second operand where either is NaN); which of +0 / -0 it keeps changes no s - mx */
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    for (int64_t s = s0; s < sk; s += 16)
        m16 = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), mask16(sk - s), sc + s),
                            m16);
    const float mx = _mm512_reduce_max_ps(m16);
    if (mx == -INFINITY) return 0.f;
    __m512 sum = _mm512_setzero_ps();
    for (int64_t s = s0; s < sk; s += 16) {
        __mmask16 mk = mask16(sk - s);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc + s), _mm512_set1_ps(mx)));
        e = _mm512_maskz_mov_ps(mk, e);
        sum = _mm512_add_ps(sum, e);
        _mm512_mask_storeu_ps(sc + s, mk, softcap == 0.f ? bf16_round(e) : e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    if (softcap != 0.f) { /* normalized, then rounded: probs.to(bf16) */
        const __m512 inv = _mm512_set1_ps(1.0f / total);
        for (int64_t s = s0; s < sk; s += 16) {
            __mmask16 mk = mask16(sk - s);
            _mm512_mask_storeu_ps(sc + s, mk,
                                  bf16_round(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, sc + s), inv)));
        }
    }
    return total;
}

#if defined(__AVX512F__)
/* The horizontal sums of 16 vectors at once, lane s of the result the sum of v[s] in
   _mm512_reduce_add_ps's order (lanes i and i + 8, then i and i + 4, then i and i + 2, then
   the last pair: the same adds, so the same bits), by 30 shuffles, 15 adds and a permute
   instead of 16 reductions of about 8 operations each. */
static inline __attribute__((always_inline)) __m512 reduce_add_16x16(const __m512 v[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++) /* [v.l2 + v.l0, v.l3 + v.l1] of keys 2i, 2i + 1 (128-bit lanes) */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int i = 0; i < 4; i++) /* lane L: the 4 sums of i and i + 4 of key 4i + L */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    for (int i = 0; i < 2; i++) /* lane L: the 2 sums of i and i + 2 of keys 8i + L, 8i + 4 + L */
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane L, element m: the sum of key L + 4m */
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(e[0], e[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, f);
}
#endif

/* The scores of g query heads (head h's query at q + h * qhs) over keys s0 .. sk of one kv
   head, into sc + h * sk: q . k * scale without a soft-cap, q . k with one (softmax_probs caps
   them), -inf where keep masks the key. Each dot product is key_dot's. With AVX-512, 16 keys
   at a time: their 16 vdpbf16ps sums reduced together (reduce_add_16x16, the same bits). */
static void scores_heads(const uint16_t *q, int64_t qhs, int64_t g, const uint16_t *kc,
                         int64_t kss, int64_t s0, int64_t sk, int64_t d, const uint8_t *keep,
                         float scale, float softcap, float *sc, const int64_t *ix) {
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(softcap == 0.f ? scale : 1.0f);
    for (int64_t s = s0; s < sk; s += 16) {
        const int64_t nk = sk - s < 16 ? sk - s : 16;
        const uint16_t *kr[16];
        __mmask16 live = mask16(nk);
        for (int64_t j = 0; j < 16; j++) {
            const int64_t at = s + (j < nk ? j : 0);
            kr[j] = kc + (ix ? ix[at] : at) * kss;
        }
        /* apart from the rows: merged into their loop, gcc reads keep by masked vector loads,
           and with keep NULL their fault suppression cost ~15% of the attention on Zen 4 */
        if (keep)
            for (int64_t j = 0; j < nk; j++)
                if (!keep[s + j]) live &= (__mmask16)~(1u << j);
        for (int64_t h = 0; h < g; h++) {
            const uint16_t *qh = q + h * qhs;
            __m512 acc[16];
            for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
            for (int64_t c = 0; c < d; c += 32) {
                const __m512bh qc = as_bh(_mm512_loadu_si512(qh + c));
                for (int j = 0; j < 16; j++)
                    acc[j] = _mm512_dpbf16_ps(acc[j], as_bh(_mm512_loadu_si512(kr[j] + c)), qc);
            }
            __m512 r = reduce_add_16x16(acc);
            if (softcap == 0.f) r = _mm512_mul_ps(r, sv);
            r = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY), r);
            _mm512_mask_storeu_ps(sc + h * sk + s, mask16(nk), r);
        }
    }
#elif HFD_AVX2_DOTS
    /* 8 keys at a time: key j's 16 lanes summed to 8 (hfd_reduce16_ps's first add), then the
       8 keys' remaining adds together by shuffles, each lane the same adds as hfd_reduce16_ps */
    const __m256 sv = _mm256_set1_ps(softcap == 0.f ? scale : 1.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 qs[MAX_D / 8]; /* one head's query split as hfd_bf16_split: chunk c at qs + 4c */
    for (int64_t s = s0; s < sk; s += 8) {
        const int64_t nk = sk - s < 8 ? sk - s : 8;
        const uint16_t *kr[8];
        int live = (1 << nk) - 1;
        for (int64_t j = 0; j < 8; j++) {
            const int64_t at = s + (j < nk ? j : 0);
            kr[j] = kc + (ix ? ix[at] : at) * kss;
        }
        if (keep)
            for (int64_t j = 0; j < nk; j++)
                if (!keep[s + j]) live &= ~(1 << j);
        for (int64_t h = 0; h < g; h++) {
            if (s == s0 || g > 1)
                for (int64_t c = 0; c < d; c += 32)
                    hfd_bf16_split(q + h * qhs + c, qs + c / 8, qs + c / 8 + 2);
            __m256 t[8];
            for (int j = 0; j < 8; j++) {
                __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int64_t c = 0; c < d; c += 32)
                    hfd_dpbf16_avx2(a, kr[j] + c, qs + c / 8, qs + c / 8 + 2);
                t[j] = _mm256_add_ps(a[1], a[0]);
            }
            __m256 x[4], w[2];
            for (int i = 0; i < 4; i++) /* [u of key 2i, u of key 2i + 1], u[l] = t[l] + t[l + 4] */
                x[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31),
                                     _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20));
            for (int i = 0; i < 2; i++) /* lanes [w0 w1] of keys 4i, 4i + 2 | 4i + 1, 4i + 3 */
                w[i] = _mm256_add_ps(_mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
            /* w0 + w1 of keys 0 2 4 6 | 1 3 5 7, then in key order */
            __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
            r = _mm256_permutevar8x32_ps(r, order);
            if (softcap == 0.f) r = _mm256_mul_ps(r, sv);
            float out[8];
            _mm256_storeu_ps(out, r);
            for (int64_t j = 0; j < nk; j++)
                sc[h * sk + s + j] = live >> j & 1 ? out[j] : -INFINITY;
        }
    }
#else
    for (int64_t s = s0; s < sk; s++) {
        if (keep && !keep[s]) {
            for (int64_t h = 0; h < g; h++) sc[h * sk + s] = -INFINITY;
            continue;
        }
        const uint16_t *kr = kc + (ix ? ix[s] : s) * kss;
        for (int64_t h = 0; h < g; h++) {
            const float dot = key_dot(q + h * qhs, kr, d);
            sc[h * sk + s] = softcap == 0.f ? dot * scale : dot;
        }
    }
#endif
}

/* attend for g query heads that read one kv head (GQA): head h's query at q + h * qhs, its
   output at o + h * ohs. The same bits as g calls of attend (each score, probability and sum
   computed by the same operations in the same order), with each key and value row read once
   for all g heads instead of g times. sc: min(g, GROUP_MAX) * sk floats of scratch. */
static void attend_heads(const uint16_t *q, int64_t qhs, int64_t g, const uint16_t *kc,
                         int64_t kss, const uint16_t *vc, int64_t vss, int64_t sk, int64_t d,
                         const uint8_t *keep, float scale, float softcap, int64_t window,
                         float *sc, uint16_t *o, int64_t ohs, const int64_t *ix) {
    for (; g > GROUP_MAX; g -= GROUP_MAX, q += GROUP_MAX * qhs, o += GROUP_MAX * ohs)
        attend_heads(q, qhs, GROUP_MAX, kc, kss, vc, vss, sk, d, keep, scale, softcap, window,
                     sc, o, ohs, ix);
    if (g == 1) {
        attend(q, kc, kss, vc, vss, sk, d, keep, scale, softcap, window, sc, o, ix);
        return;
    }
    const int64_t s0 = window_start(keep, sk, window);
    scores_heads(q, qhs, g, kc, kss, s0, sk, d, keep, scale, softcap, sc, ix);
    float inv[GROUP_MAX];
    for (int64_t h = 0; h < g; h++) {
        const float total = softmax_probs(sc + h * sk, s0, sk, scale, softcap);
        if (total == 0.f) { /* attend's zeros: no key adds to this head's sums */
            for (int64_t s = s0; s < sk; s++) sc[h * sk + s] = 0.f;
            inv[h] = 0.f;
        } else {
            inv[h] = softcap == 0.f ? 1.0f / total : 1.0f;
        }
    }
    switch (g) {
        case 2: pv_heads(sc, sk, 2, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        case 3: pv_heads(sc, sk, 3, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        case 4: pv_heads(sc, sk, 4, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        case 5: pv_heads(sc, sk, 5, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        case 6: pv_heads(sc, sk, 6, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        case 7: pv_heads(sc, sk, 7, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
        default: pv_heads(sc, sk, 8, vc, vss, s0, sk, d, keep, inv, o, ohs, ix, 0); break;
    }
}

/* Query heads per work item of an attention over `units` (rows x kv heads) with rep query
   heads per kv head: as many as share a kv head (up to GROUP_MAX), halved while that leaves
   fewer than 4 items per thread. */
static int64_t heads_per_item(int64_t units, int64_t rep, int nt) {
    int64_t g = rep < GROUP_MAX ? rep : GROUP_MAX;
    while (g > 1 && units * ((rep + g - 1) / g) < 4 * (int64_t)nt) g = (g + 1) / 2;
    return g;
}

/* torch's tanh-approximated GELU of fp32 lanes: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
   written as x (1 - 1 / (1 + exp(2 t))), t the tanh's argument: exactly 0 and x where exp
   under- / overflows, as torch's is. */
static inline __m512 gelu_tanh_ps(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 t = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(0.044715f), x3)));
    __m512 e = exp_ps(_mm512_add_ps(t, t));
    return _mm512_mul_ps(x, _mm512_sub_ps(one, _mm512_div_ps(one, _mm512_add_ps(one, e))));
}

/* a[c] = bf16(bf16(gelu_tanh(bf16(g[c]))) * bf16(u[c])) for c < n: Gemma's GeGLU after its
   projections' rounding (g, u fp32: the projections' outputs before it). */
static void gated_gelu_row(const float *g, const float *u, uint16_t *a, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 gs = bf16_round(gelu_tanh_ps(bf16_round(_mm512_maskz_loadu_ps(mk, g + c))));
        store16_bf16(a + c, mk, _mm512_mul_ps(gs, bf16_round(_mm512_maskz_loadu_ps(mk, u + c))));
    }
}

/* a[c] = bf16(act(bf16(y[c]))) for c < n: fc1's output (y fp32, with its bias) rounded as its
   projection rounds, then squared ReLU (mlp MLP_RELU2, torch.square(relu(x)): one rounding) or
   tanh GELU (MLP_GELU_TANH), evaluated in fp32 and rounded once. */
static void plain_act_row(int64_t mlp, const float *y, uint16_t *a, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 v = bf16_round(_mm512_maskz_loadu_ps(mk, y + c));
        if (mlp == MLP_RELU2) {
            v = relu_ps(v);
            v = _mm512_mul_ps(v, v);
        } else {
            v = gelu_tanh_ps(v);
        }
        store16_bf16(a + c, mk, v);
    }
}

/* The MLP's activation of one row: y fp32 [2 * I] (gate then up; fc1 alone for the plain
   MLPs) -> a. */
static void mlp_act_row(const hfd_layer *L, const float *y, uint16_t *a) {
    const int64_t I = L->inter;
    if (L->mlp == MLP_GATED_SILU)
        gated_silu_row(y, y + I, a, I);
    else if (L->mlp == MLP_GATED_GELU_TANH)
        gated_gelu_row(y, y + I, a, I);
    else if (L->mlp == MLP_RELU)
        relu_row(y, a, I);
    else
        plain_act_row(L->mlp, y, a, I);
}

static void add_bf16(const uint16_t *a, const uint16_t *b, int64_t n, float m, uint16_t *out);

/* out = x + branch, the branch y (fp32, a projection's output before rounding) as the layer
   adds it: bf16(y) through the post-norm `which` (3: after attention, 4: after the MLP) where
   the layer has one (sandwich: out = bf16(x + norm(bf16(y))); with a residual multiplier,
   HyperCLOVA X's Peri-LN: bf16(x + bf16(norm(bf16(y)) * resid_mult))), else residual_bf16's.
   tmp: hidden bf16 of scratch. */
static void branch_residual(const hfd_layer *L, int which, const uint16_t *x, const float *y,
                            uint16_t *tmp, uint16_t *out) {
    const int64_t H = L->hidden;
    if (!(which == 3 ? L->ln3 : L->ln4)) {
        residual_bf16(x, y, H, L->resid_mult, out);
        return;
    }
    round_row(y, tmp, H);
    norm_bf16(L, which, tmp, tmp);
    add_bf16(x, tmp, H, L->resid_mult, out);
}

/* The rest of the layer for one token: out [hidden] (bf16) from the layer input x, the rotated
   q [heads * d] and the cache's keys / values: element (h, s, c) at kc[h * khs + s * kss + c]
   (likewise vc) for s < sk; keep[s] == 0 masks key s (keep NULL: every key). */
int hfd_decode_attn_out(const hfd_layer *L, const uint16_t *x, const uint16_t *q,
                        const uint16_t *kc, int64_t khs, int64_t kss, const uint16_t *vc,
                        int64_t vhs, int64_t vss, int64_t sk, const uint8_t *keep,
                        uint16_t *out, int nthreads) {
    return hfd_decode_attn_out_slots(L, x, q, kc, khs, kss, vc, vhs, vss, sk, keep, NULL, out,
                                     nthreads);
}

/* hfd_decode_attn_out with the keys read through slots (NULL: key s at kc + s * kss): key s is
   the cache row slots[s], at kc + slots[s] * kss (likewise v), as a paged cache keeps them. */
int hfd_decode_attn_out_slots(const hfd_layer *L, const uint16_t *x, const uint16_t *q,
                              const uint16_t *kc, int64_t khs, int64_t kss, const uint16_t *vc,
                              int64_t vhs, int64_t vss, int64_t sk, const uint8_t *keep,
                              const int64_t *slots, uint16_t *out, int nthreads) {
    const int64_t H = L->hidden, d = L->head_dim, I = L->inter, rep = L->heads / L->kv_heads;
    const int64_t nq = L->heads * d;
    const int nt = nthreads > 0 ? nthreads : 1, gated = MLP_IS_GATED(L->mlp);
    scratch s;
    int64_t kmax = I > H ? I : H; /* the widest input of a projection: I, H or heads * d */
    kmax = nq > kmax ? nq : kmax;
    uint16_t *a = (uint16_t *)malloc((size_t)kmax * 2);  /* attention out, then the MLP act */
    uint16_t *x1 = (uint16_t *)malloc((size_t)H * 2);    /* x + attention */
    uint16_t *h = (uint16_t *)malloc((size_t)H * 2);     /* norm of x1 */
    float *y = (float *)malloc((size_t)(2 * I + H) * sizeof(float));
    const int64_t gh = heads_per_item(L->kv_heads, rep, nt), per = (rep + gh - 1) / gh;
    float *sc = (float *)malloc((size_t)(nt * gh * sk) * sizeof(float));
    if (!a || !x1 || !h || !y || !sc || scratch_init(&s, kmax)) {
        free(a); free(x1); free(h); free(y); free(sc);
        return -2;
    }
    lin_input in[2];
    const hfd_lin *o_lin[1] = {&L->lin[L_O]}, *gu[2] = {&L->lin[L_GATE], &L->lin[L_UP]};
    const hfd_lin *dn[1] = {&L->lin[L_DOWN]};
    float *oy[1] = {y}, *gy[2] = {y, y + I}, *dy[1] = {y + 2 * I};
#pragma omp parallel num_threads(nt)
    {
        float *mine = sc + (int64_t)omp_get_thread_num() * gh * sk;
#pragma omp for schedule(static)
        for (int64_t w = 0; w < L->kv_heads * per; w++) { /* gh heads of kv head j at a time */
            const int64_t j = w / per, h0 = j * rep + (w % per) * gh;
            const int64_t g = (j + 1) * rep - h0 < gh ? (j + 1) * rep - h0 : gh;
            attend_heads(q + h0 * d, d, g, kc + j * khs, kss, vc + j * vhs, vss, sk, d, keep,
                         L->scale, L->softcap, L->window, mine, a + h0 * d, d, slots);
        }
#pragma omp single
        inputs_for(o_lin, 1, a, &s, in);
        lin_rows(o_lin, in, 1, oy);
#pragma omp single
        {
            branch_residual(L, 3, x, y, h, x1);
            norm_bf16(L, 2, x1, h);
            inputs_for(gu, gated ? 2 : 1, h, &s, in);
        }
        lin_rows(gu, in, gated ? 2 : 1, gy);
#pragma omp single
        {
            mlp_act_row(L, y, a);
            inputs_for(dn, 1, a, &s, in);
        }
        lin_rows(dn, in, 1, dy);
    }
    branch_residual(L, 4, x1, y + 2 * I, h, out);
    free(a); free(x1); free(h); free(y); free(sc); free(s.mem);
    return 0;
}

/* A whole batch-1 decode step over `count` layers (a model's, in order), one call instead of
   2 * count, with the cache append between the halves done here: layer l takes x_l (x for l = 0,
   the previous layer's output after), attn_in, writes its rotated key and its value as token n of
   its cache, element (h, n, c) at kc[l][h * strides[4l] + n * strides[4l + 1] + c] (values:
   vc[l], strides[4l + 2], strides[4l + 3]; the caller guarantees room for token n), then
   attn_out over tokens 0..n with keep [n + 1] (NULL: every key). out [hidden]: the last layer's
   output. The numerics are the two calls' exactly; what it saves is the caller's per-layer work
   between them (Llama-1.1B int4 decode: ~3 ms of a ~31 ms step in Python and torch). */
int hfd_decode_layers(const hfd_layer *const *L, int64_t count, const uint16_t *x,
                      const uint16_t *cos, const uint16_t *sin, uint16_t *const *kc,
                      uint16_t *const *vc, const int64_t *strides, int64_t n,
                      const uint8_t *keep, uint16_t *out, int nthreads) {
    int64_t H = 0, nq = 0, nkv = 0;
    for (int64_t l = 0; l < count; l++) {
        H = L[l]->hidden > H ? L[l]->hidden : H;
        nq = L[l]->heads * L[l]->head_dim > nq ? L[l]->heads * L[l]->head_dim : nq;
        nkv = L[l]->kv_heads * L[l]->head_dim > nkv ? L[l]->kv_heads * L[l]->head_dim : nkv;
    }
    uint16_t *buf = (uint16_t *)malloc((size_t)(2 * H + nq + 2 * nkv) * 2);
    if (!buf) return -2;
    uint16_t *xs[2] = {buf, buf + H}, *q = buf + 2 * H, *k = q + nq, *v = k + nkv;
    const uint16_t *xin = x;
    int rc = 0;
    for (int64_t l = 0; l < count && !rc; l++) {
        const hfd_layer *Ll = L[l];
        const int64_t d = Ll->head_dim, *st = strides + 4 * l;
        rc = hfd_decode_attn_in(Ll, xin, cos, sin, q, k, v, nthreads);
        if (rc) break;
        for (int64_t h = 0; h < Ll->kv_heads; h++) {
            memcpy(kc[l] + h * st[0] + n * st[1], k + h * d, (size_t)d * 2);
            memcpy(vc[l] + h * st[2] + n * st[3], v + h * d, (size_t)d * 2);
        }
        uint16_t *xo = l == count - 1 ? out : xs[l & 1];
        rc = hfd_decode_attn_out(Ll, xin, q, kc[l], st[0], st[1], vc[l], st[2], st[3], n + 1,
                                 keep, xo, nthreads);
        xin = xo;
    }
    free(buf);
    return rc;
}

/* y [M, N] (fp32, no bias) = x [M, K] (dtype x_dt) times the 4-bit weight described by L (an
   int4 or a W4A8 kind), by the batch-1 kernel row by row of x. The threads split the weight into
   blocks (ROWS rows, A8_BLOCK for W4A8); a block's codes are read from memory for the first row
   of x and from cache for the others, so the weight is streamed once whatever M is. */
static int rows_linear(const hfd_lin *L, const void *x, int x_dt, int64_t M, float *y, int nthreads) {
    const int a8 = is_a8(L);
    const int64_t N = L->n, K = L->k, G = K / L->group, block = a8 ? A8_BLOCK : ROWS;
    const int nt = nthreads > 0 ? nthreads : 1;
    const int64_t kp = (K + 127) / 128 * 128, xs = x_dt == DT_F32 ? 4 : 2;
    /* per row of x: int4, 3 kp plane bytes and kp floats of group sums and of units; W4A8, kp
       plane bytes and G floats of units, of sums and G int32 code sums; per thread kp floats of
       scratch */
    const int64_t per_row = a8 ? kp + (3 * 4 * G + 63) / 64 * 64 : 3 * kp + 8 * kp;
    uint8_t *mem = (uint8_t *)aligned_alloc(64, (size_t)(M * per_row + nt * kp * 4));
    lin_input *in = (lin_input *)malloc((size_t)M * sizeof(lin_input));
    if (!mem || !in) {
        free(mem); free(in);
        return -2;
    }
#pragma omp parallel num_threads(nt)
    {
        float *xf = (float *)(mem + M * per_row) + (int64_t)omp_get_thread_num() * kp;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            uint8_t *base = mem + m * per_row;
            in[m].planes = base;
            if (a8) {
                in[m].gunit = (float *)(base + kp);
                in[m].gsum = in[m].gunit + G;
                in[m].qsum = (int32_t *)(in[m].gsum + G);
            } else {
                in[m].gsum = (float *)(base + 3 * kp);
                in[m].gunit = in[m].gsum + kp;
            }
            prepare_input_dt(L, (const char *)x + m * K * xs, x_dt, &in[m], xf);
        }
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += block) {
            const int rows = (int)(N - n0 < block ? N - n0 : block);
            float out[A8_BLOCK > ROWS ? A8_BLOCK : ROWS];
            if (a8) {
                for (int64_t m = 0; m < M; m++) {
                    a8_dots(L, &in[m], n0, rows, out);
                    for (int r = 0; r < rows; r++) y[m * N + n0 + r] = out[r];
                }
            } else {
                int4_block b;
                int4_setup(L, n0, rows, &b);
                for (int64_t m = 0; m < M; m++) {
                    int4_dots(L, &b, &in[m], n0, rows, out);
                    for (int r = 0; r < rows; r++) y[m * N + n0 + r] = out[r];
                }
            }
        }
    }
    free(mem);
    free(in);
    return 0;
}

/* y [M, N] (fp32, no bias) = x [M, K] (x_dt: DT_F32 / DT_BF16 / DT_F16) times a 4-bit weight
   W = q * scale + min, stored as the decode layer reads it (tiled: row tiles with the
   super-chunk order, else row-major packed codes; scales and mins [N, K / group] of s_dt):
   the int4 linear of 2-32 rows (kernels/quant.py's linear_int4_cpu), in the batch-1 kernel's
   numerics row by row. Returns 0, -2 out of memory, -3 shapes it does not take. */
int hfd_int4_linear(const void *x, int x_dt, int64_t M, const uint8_t *w, const void *scales,
                    const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                    float *y, int nthreads) {
    if (M <= 0 || N <= 0 || K <= 0 || group <= 0 || group & (group - 1) || group < 32
        || group > 256 || K % group || K / group > MAX_GROUPS
        || (tiled && (N % ROWS || K % 128)))
        return -3;
    const hfd_lin L = {tiled ? LIN_INT4_TILED : LIN_INT4, N, K, group, s_dt, 0, w, scales, mins,
                       NULL, NULL, NULL};
    return rows_linear(&L, x, x_dt, M, y, nthreads);
}

/* y [M, N] (fp32) = hfd_int4_gemm_a8's product to the bit (the same arguments), by the batch-1
   W4A8 dots (a8_dots) for each row of x: the codes read as stored, no panel put in vpdpbusd's
   order per call, so faster for a few rows (kernels/quant.py: linear_int4_a8_cpu's bound).
   -3 where it does not take the shape: groups other than 32, 64, 128 or 256, or tiles of other
   than whole 128-column chunks; -2 out of memory. */
int hfd_int4_a8_rows(const void *x, int x_dt, int64_t M, const uint8_t *w, const void *scales,
                     const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                     float *y, int nthreads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0 || group < 32 || group > 256 || group & (group - 1) || K % group
        || (tiled && (N % TILE_ROWS || K % 128)))
        return -3;
    const hfd_lin L = {tiled ? LIN_INT4_A8_TILED : LIN_INT4_A8, N, K, group, s_dt, 0, w, scales,
                       mins, NULL, NULL, NULL};
    return rows_linear(&L, x, x_dt, M, y, nthreads);
}

/* ---- batched decode: one token of each of `rows` sequences ----
 *
 * The same layer for rows > 1 (batched greedy / sampled decode, beams, continuous batching's
 * decode rows): on a CPU with AMX the projections run on AMX tiles straight from the stored
 * weights (hfd_linear_bf16 of cpu_moe.c, which rounds each output to bf16 after its bias, as
 * nn.Linear does; int8 row tiles on AMX-INT8); without AMX, each projection runs the kernel the
 * torch path's linear takes for that many rows (lin_batch, below). Everything between them is
 * the per-row code above, so a row's numerics are the batch-1 layer's. Row r's cos / sin start
 * at cos + r * cs_stride (0: one position for every row); its keys at kc + r * kbs, its keep row
 * at keep + r * keep_stride; bounds: lin_batch's. Return codes: 0, -2 out of memory, -3 not
 * computable here (a weight kind, bias dtype or shape the kernels do not take). */

/* Rows of x under the AMX-INT8 kernel's: kernels/quant.py's AMX_INT8_MIN_ROWS (the two give the
   same bits; the GEMV is faster for so few rows) */
#define INT8_AMX_MIN_ROWS 4

static void round_then_bias(const float *f, const hfd_lin *L, int64_t rows, uint16_t *y, int nt);
/* y [rows, n] = bf16(x W^T + bias) for a bf16 weight (AMX-BF16) or int8 row tiles (AMX-INT8,
   or the GEMV under 4 rows); y = bf16(bf16(x W^T) + bias) for 4-bit codes (hfd_int4_linear up
   to bounds[1] rows, then hfd_int4_amx on AMX-BF16 tiles): what the torch path's linear
   computes for those weights and rows (kernels/quant.py: linear_int4_cpu), to the bit. Other
   kinds: -3. */
static int lin_amx_rows(const hfd_lin *L, const uint16_t *x, int64_t rows, uint16_t *y, int nt,
                        const int64_t *bounds) {
    if (L->bias && L->b_dt != DT_BF16) return -3;
    if (L->kind == LIN_BF16)
        return hfd_linear_bf16(x, (const uint16_t *)L->w, (const uint16_t *)L->bias, y, rows,
                               L->n, L->k, nt);
    if (is_int4(L)) {
        const int tiled = L->kind == LIN_INT4_TILED;
        int rc;
        if (!bounds) return -3;
        if (rows <= bounds[1]) {
            float *f = (float *)malloc((size_t)(rows * L->n) * sizeof(float));
            if (!f) return -2;
            rc = hfd_int4_linear(x, DT_BF16, rows, (const uint8_t *)L->w, L->scales, L->mins,
                                 (int)L->s_dt, L->group, L->n, L->k, tiled, f, nt);
            if (!rc) round_then_bias(f, L, rows, y, nt);
            free(f);
            return rc;
        }
        rc = hfd_int4_amx(x, rows, (const uint8_t *)L->w, L->scales, L->mins, (int)L->s_dt,
                          L->group, L->n, L->k, tiled, y, nt);
        if (!rc && L->bias)
            for (int64_t r = 0; r < rows; r++)
                add_bf16(y + r * L->n, (const uint16_t *)L->bias, L->n, 0.f, y + r * L->n);
        return rc;
    }
    if (L->kind != LIN_INT8_TILED) return -3;
    if (rows < INT8_AMX_MIN_ROWS)
        return hfd_int8_gemv(x, DT_BF16, L->in_scale, (const int8_t *)L->w, L->rowsum,
                             L->scales, (int)L->s_dt, L->bias, DT_BF16, y, rows, L->n, L->k, 1,
                             nt);
    return hfd_int8_amx(x, DT_BF16, L->in_scale, (const int8_t *)L->w, L->rowsum, L->scales,
                        (int)L->s_dt, L->bias, DT_BF16, y, rows, L->n, L->k, nt);
}

/* y [rows, n] = bf16(bf16(f) + bias) from fp32 products f: the torch path's rounding of its
   int8 panel and int4 products (kernels/quant.py: the product to bf16, then the bias added). */
static void round_then_bias(const float *f, const hfd_lin *L, int64_t rows, uint16_t *y, int nt) {
    const int64_t n = L->n;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) {
        round_row(f + r * n, y + r * n, n);
        if (L->bias) add_bf16(y + r * n, (const uint16_t *)L->bias, n, 0.f, y + r * n);
    }
}

/* y [rows, n] = x W^T + bias in bf16 for the batched layer: lin_amx_rows on a CPU with AMX.
   Else the kernel the torch path's linear takes for `rows` rows (kernels/linear.py, quant.py),
   bounds = {int8_gemv_max_rows, int4_native_max_rows} of the running tier (kernels/crossovers.py):
   a bf16 weight by hfd_gemv_bf16 (up to its 4 rows) or hfd_gemm_bf16, whose dot products are
   the GEMV's; int8 by hfd_int8_gemv up to bounds[0] rows, else hfd_int8_gemm_bf16 (an input
   scale folded into x first); int4 by hfd_int4_linear up to bounds[1] rows, else
   hfd_int4_gemm_bf16. Biases bf16.
   -3 for what it does not take (kernels/decode.py: rows_why checks first), -2 out of memory. */
static int lin_batch(const hfd_lin *L, const uint16_t *x, int64_t rows, uint16_t *y, int nt,
                     const int64_t *bounds) {
    if (is_a8(L)) { /* every row count, AMX or not: the torch path's kernel (linear_int4_a8_cpu) */
        if (L->bias && L->b_dt != DT_BF16) return -3;
        float *f = (float *)malloc((size_t)(rows * L->n) * sizeof(float));
        if (!f) return -2;
        int rc = hfd_int4_gemm_a8(x, DT_BF16, rows, (const uint8_t *)L->w, L->scales, L->mins,
                                  (int)L->s_dt, L->group, L->n, L->k,
                                  L->kind == LIN_INT4_A8_TILED, f, nt);
        if (!rc) round_then_bias(f, L, rows, y, nt);
        free(f);
        return rc;
    }
    if (hfd_amx_available()) return lin_amx_rows(L, x, rows, y, nt, bounds);
    if (L->bias && L->b_dt != DT_BF16) return -3;
    if (L->kind == LIN_BF16) {
        const uint16_t *w = (const uint16_t *)L->w, *b = (const uint16_t *)L->bias;
        if (rows <= 4) return hfd_gemv_bf16(x, w, b, y, rows, L->n, L->k, nt);
        return hfd_gemm_bf16(x, w, b, y, rows, L->n, L->k, nt);
    }
    const int int8 = L->kind == LIN_INT8 || L->kind == LIN_INT8_TILED;
    const int tiled = L->kind == LIN_INT8_TILED || L->kind == LIN_INT4_TILED;
    if (!bounds || (!int8 && !is_int4(L))) return -3;
    if (int8 && rows <= bounds[0])
        return hfd_int8_gemv(x, DT_BF16, L->in_scale, (const int8_t *)L->w, L->rowsum,
                             L->scales, (int)L->s_dt, L->bias, L->bias ? DT_BF16 : 0, y, rows,
                             L->n, L->k, tiled, nt);
    float *f = (float *)malloc((size_t)(rows * L->n) * sizeof(float));
    uint16_t *xs = int8 && L->in_scale ? (uint16_t *)malloc((size_t)(rows * L->k) * 2) : NULL;
    if (!f || (int8 && L->in_scale && !xs)) {
        free(f); free(xs);
        return -2;
    }
    if (xs) /* the input scale folded into x as the torch path folds it: bf16(x * in_scale) */
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < L->k; c += 16) {
                __mmask16 mk = mask16(L->k - c);
                store16_bf16(xs + r * L->k + c, mk,
                             _mm512_mul_ps(load16(x, r * L->k + c, DT_BF16, mk),
                                           _mm512_maskz_loadu_ps(mk, L->in_scale + c)));
            }
    int rc;
    if (int8)
        rc = hfd_int8_gemm_bf16(xs ? xs : x, rows, (const int8_t *)L->w, L->scales,
                                (int)L->s_dt, L->n, L->k, tiled, f, nt);
    else if (rows <= bounds[1])
        rc = hfd_int4_linear(x, DT_BF16, rows, (const uint8_t *)L->w, L->scales, L->mins,
                             (int)L->s_dt, L->group, L->n, L->k, tiled, f, nt);
    else
        rc = hfd_int4_gemm_bf16(x, rows, (const uint8_t *)L->w, L->scales, L->mins,
                                (int)L->s_dt, L->group, L->n, L->k, tiled, f, nt);
    if (!rc) round_then_bias(f, L, rows, y, nt);
    free(f);
    free(xs);
    return rc;
}

/* out = bf16(a + b) for n bf16 elements; with m != 0, out = bf16(a + bf16(b * m)) (Granite). */
static void add_bf16(const uint16_t *a, const uint16_t *b, int64_t n, float m, uint16_t *out) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 v = load16(b, c, DT_BF16, mk);
        if (m != 0.f) v = bf16_round(_mm512_mul_ps(v, _mm512_set1_ps(m)));
        store16_bf16(out + c, mk, _mm512_add_ps(load16(a, c, DT_BF16, mk), v));
    }
}

/* a = bf16(bf16(silu(g)) * u) for n bf16 elements (g, u already rounded by their projection). */
static void gated_silu_bf16(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *a) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 gs = load16(g, c, DT_BF16, mk);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), gs));
        __m512 s = bf16_round(_mm512_div_ps(gs, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store16_bf16(a + c, mk, _mm512_mul_ps(s, load16(u, c, DT_BF16, mk)));
    }
}

/* a = bf16(bf16(gelu_tanh(g)) * u) for n bf16 elements (g, u already rounded). */
static void gated_gelu_bf16(const uint16_t *g, const uint16_t *u, int64_t n, uint16_t *a) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 gs = bf16_round(gelu_tanh_ps(load16(g, c, DT_BF16, mk)));
        store16_bf16(a + c, mk, _mm512_mul_ps(gs, load16(u, c, DT_BF16, mk)));
    }
}

/* a = act(a) in place for n bf16 elements, fc1's output already rounded with its bias: ReLU
   (exact), squared ReLU or tanh GELU (evaluated in fp32, rounded once). */
static void plain_act_bf16(int64_t mlp, uint16_t *a, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) {
        __mmask16 mk = mask16(n - c);
        __m512 v = load16(a, c, DT_BF16, mk);
        if (mlp == MLP_RELU) {
            v = relu_ps(v);
        } else if (mlp == MLP_RELU2) {
            v = relu_ps(v);
            v = _mm512_mul_ps(v, v);
        } else {
            v = gelu_tanh_ps(v);
        }
        store16_bf16(a + c, mk, v);
    }
}

/* q [rows, heads * d], k, v [rows, kv_heads * d] (bf16, rotated q and k) from x [rows, hidden]. */
int hfd_decode_attn_in_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                            const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                            uint16_t *q, uint16_t *k, uint16_t *v, const int64_t *bounds,
                            int nthreads) {
    const int64_t H = L->hidden, d = L->head_dim;
    const int64_t nq = L->heads * d, nkv = L->kv_heads * d;
    const int nt = nthreads > 0 ? nthreads : 1;
    uint16_t *h = (uint16_t *)malloc((size_t)(rows * H) * 2);
    if (!h) return -2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) norm_bf16(L, 1, x + r * H, h + r * H);
    int rc = lin_batch(&L->lin[L_Q], h, rows, q, nt, bounds);
    if (!rc) rc = lin_batch(&L->lin[L_K], h, rows, k, nt, bounds);
    if (!rc) rc = lin_batch(&L->lin[L_V], h, rows, v, nt, bounds);
    free(h);
    if (rc) return rc;
    /* cs_stride counts elements; without RoPE, cos / sin may be NULL and are never read */
    const int64_t cs_bytes = L->rope == ROPE_FP32 || L->rope == ROPE_FP32_PAIRS ? 4 : 2;
#pragma omp parallel for num_threads(nt) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t at = r * cs_stride * cs_bytes;
        qk_finish(L, q + r * nq, k + r * nkv, L->rope ? (const char *)cos + at : NULL,
                  L->rope ? (const char *)sin + at : NULL);
    }
    return 0;
}

/* The layer after its attention for each row: out [rows, hidden] from x [rows, hidden] and the
   attention output a [rows, heads * d] (bf16, before the output projection): o_proj, the
   residual adds, the norms and the MLP, as hfd_decode_attn_out_rows computes them. */
int hfd_decode_post_attn_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                              const uint16_t *a, uint16_t *out, const int64_t *bounds,
                              int nthreads) {
    const int64_t H = L->hidden, I = L->inter;
    const int nt = nthreads > 0 ? nthreads : 1, gated = MLP_IS_GATED(L->mlp);
    if (rows <= 0) return 0;
    uint16_t *act = (uint16_t *)malloc((size_t)(rows * I) * 2);  /* the MLP's activation */
    uint16_t *x1 = (uint16_t *)malloc((size_t)(rows * H) * 2);   /* x + attention */
    uint16_t *h = (uint16_t *)malloc((size_t)(rows * H) * 2);    /* o_proj, norm, down out */
    uint16_t *g = gated ? (uint16_t *)malloc((size_t)(rows * I) * 2) : NULL;
    uint16_t *u = gated ? (uint16_t *)malloc((size_t)(rows * I) * 2) : NULL;
    int rc = (!act || !x1 || !h || (gated && (!g || !u))) ? -2 : 0;
    if (!rc) rc = lin_batch(&L->lin[L_O], a, rows, h, nt, bounds);
    if (!rc) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (L->ln3) norm_bf16(L, 3, h + r * H, h + r * H); /* sandwich */
            add_bf16(x + r * H, h + r * H, H, L->resid_mult, x1 + r * H);
            norm_bf16(L, 2, x1 + r * H, h + r * H);
        }
        rc = lin_batch(&L->lin[L_GATE], h, rows, gated ? g : act, nt, bounds);
    }
    if (!rc && gated) rc = lin_batch(&L->lin[L_UP], h, rows, u, nt, bounds);
    if (!rc) {
        if (gated) {
#pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                if (L->mlp == MLP_GATED_GELU_TANH)
                    gated_gelu_bf16(g + r * I, u + r * I, I, act + r * I);
                else
                    gated_silu_bf16(g + r * I, u + r * I, I, act + r * I);
            }
        } else {
#pragma omp parallel for num_threads(nt) schedule(static)
            for (int64_t r = 0; r < rows; r++) plain_act_bf16(L->mlp, act + r * I, I);
        }
        rc = lin_batch(&L->lin[L_DOWN], act, rows, h, nt, bounds);
    }
    if (!rc) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (L->ln4) norm_bf16(L, 4, h + r * H, h + r * H); /* sandwich */
            add_bf16(x1 + r * H, h + r * H, H, L->resid_mult, out + r * H);
        }
    }
    free(act); free(x1); free(h); free(g); free(u);
    return rc;
}

/* The rest of the layer for each row: out [rows, hidden] from x, the rotated q [rows, heads * d]
   and the cache: row r's element (h, s, c) at kc[r * kbs + h * khs + s * kss + c] (likewise vc)
   for s < sk; keep (uint8, NULL: every key) masks key s of row r where keep[r * keep_stride + s]
   is 0. */
int hfd_decode_attn_out_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                             const uint16_t *q, const uint16_t *kc, int64_t kbs, int64_t khs,
                             int64_t kss, const uint16_t *vc, int64_t vbs, int64_t vhs,
                             int64_t vss, int64_t sk, const uint8_t *keep, int64_t keep_stride,
                             uint16_t *out, const int64_t *bounds, int nthreads) {
    const int64_t d = L->head_dim, rep = L->heads / L->kv_heads, nq = L->heads * d;
    const int nt = nthreads > 0 ? nthreads : 1;
    uint16_t *a = (uint16_t *)malloc((size_t)(rows * nq) * 2); /* the attention output */
    const int64_t gh = heads_per_item(rows * L->kv_heads, rep, nt), per = (rep + gh - 1) / gh;
    float *sc = (float *)malloc((size_t)(nt * gh * sk) * sizeof(float));
    int rc = (!a || !sc) ? -2 : 0;
    if (!rc) {
#pragma omp parallel num_threads(nt)
        {
            float *mine = sc + (int64_t)omp_get_thread_num() * gh * sk;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < rows * L->kv_heads * per; t++) {
                const int64_t r = t / (L->kv_heads * per), w = t % (L->kv_heads * per);
                const int64_t j = w / per, h0 = j * rep + (w % per) * gh;
                const int64_t g = (j + 1) * rep - h0 < gh ? (j + 1) * rep - h0 : gh;
                attend_heads(q + r * nq + h0 * d, d, g, kc + r * kbs + j * khs, kss,
                             vc + r * vbs + j * vhs, vss, sk, d,
                             keep ? keep + r * keep_stride : NULL, L->scale, L->softcap,
                             L->window, mine, a + r * nq + h0 * d, d, NULL);
            }
        }
        rc = hfd_decode_post_attn_rows(L, rows, x, a, out, bounds, nt);
    }
    free(a); free(sc);
    return rc;
}

/* Single-query rows of packed requests (continuous batching's decode rows), each over keys of
   its own: for row i, spans[3i .. 3i + 3) = (t, k0, k1), query position t of q attends keys
   k0 .. k1 of k / v with every query head (head h reads kv head h / (heads / kv_heads)), by
   `attend` (the numerics of the decode layer's attention, above). Element (h, t, c) of q at
   q[h * qhs + t * qts + c], of k at k[h * khs + t * kss + c] (likewise v, out); keep (uint8,
   NULL: every key) masks key k0 + s of row i where keep[i * keep_stride + k0 + s] is 0. slots
   (NULL: none): key j is row slots[j] of k / v (at k[h * khs + slots[j] * kss + c]), a paged
   cache's rows read in place through its read index instead of gathered first. d a multiple
   of 32, at most MAX_D. Returns 0, -1 for bad arguments, -2 out of memory. */
int hfd_attend_rows(const uint16_t *q, int64_t qhs, int64_t qts, const uint16_t *k,
                    int64_t khs, int64_t kss, const uint16_t *v, int64_t vhs, int64_t vss,
                    const int64_t *spans, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                    const uint8_t *keep, int64_t keep_stride, float scale, float softcap,
                    uint16_t *out, int64_t ohs, int64_t ots, const int64_t *slots, int nthreads) {
    if (n <= 0) return 0;
    if (d % 32 || d > MAX_D || kv_heads <= 0 || heads % kv_heads) return -1;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t sk = spans[3 * i + 2] - spans[3 * i + 1];
        if (sk < 0) return -1;
        if (sk > most) most = sk;
    }
    const int64_t rep = heads / kv_heads;
    const int nt = nthreads > 0 ? nthreads : 1;
    const int64_t gh = heads_per_item(n * kv_heads, rep, nt), per = (rep + gh - 1) / gh;
    const int chunk = gh > 1 ? 1 : 4; /* work items of one head: a few per grab */
    float *sc = (float *)malloc((size_t)(nt * gh * most + 16) * sizeof(float));
    if (!sc) return -2;
#pragma omp parallel num_threads(nt)
    {
        float *mine = sc + (int64_t)omp_get_thread_num() * gh * most;
#pragma omp for schedule(dynamic, chunk)
        for (int64_t w = 0; w < n * kv_heads * per; w++) { /* gh heads of kv head g at a time */
            const int64_t i = w / (kv_heads * per), u = w % (kv_heads * per);
            const int64_t g = u / per, h = g * rep + (u % per) * gh;
            const int64_t nh = (g + 1) * rep - h < gh ? (g + 1) * rep - h : gh;
            const int64_t t = spans[3 * i], k0 = spans[3 * i + 1], sk = spans[3 * i + 2] - k0;
            const int64_t at = slots ? 0 : k0; /* slots: key j of the spans is slot slots[j] */
            attend_heads(q + h * qhs + t * qts, qhs, nh, k + g * khs + at * kss, kss,
                         v + g * vhs + at * vss, vss, sk, d,
                         keep ? keep + i * keep_stride + k0 : NULL, scale, softcap, 0, mine,
                         out + h * ohs + t * ots, ohs, slots ? slots + k0 : NULL);
        }
    }
    free(sc);
    return 0;
}

/* Rotate-half RoPE of many tokens in place, in the torch path's bf16 numerics (rotate_bf16: each
   product and the sum rounded to bf16, as HF's eager apply_rotary_pos_emb): token t's heads
   [heads, d] at x + t * x_stride (heads d apart), its cos / sin [rot] at cos / sin + t *
   cs_stride; the first rot dims of each head turn, the rest stay. Threads split the tokens. */
int hfd_rope_rows_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t d, int64_t rot,
                       int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                       int64_t cs_stride, int nthreads) {
    if (tokens <= 0) return 0;
    if (rot <= 0 || rot % 2 || rot > d) return -1;
    const int nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && tokens * heads * d > 32768)
    for (int64_t t = 0; t < tokens; t++)
        rotate_bf16(x + t * x_stride, heads, d, rot, cos + t * cs_stride, sin + t * cs_stride);
    return 0;
}

/* RMSNorm of `rows` bf16 rows of n in the decode layer's numerics (rms_norm_bf16, style NORM_RMS
   / NORM_RMS_FP32 / NORM_RMS_UNIT): out [rows, n] from x [rows, n], weight w [n]. */
int hfd_rms_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w, float eps,
                      int style, uint16_t *out, int nthreads) {
    if (rows <= 0) return 0;
    if (n <= 0 || (style != NORM_RMS && style != NORM_RMS_FP32 && style != NORM_RMS_UNIT))
        return -1;
    const int nt = nthreads > 0 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1 && rows * n > 32768)
    for (int64_t r = 0; r < rows; r++) rms_norm_bf16(x + r * n, w, n, eps, style, out + r * n);
    return 0;
}

/* y[i] = e^x[i] for i < n (fp32) by exp_ps, the exponential of the kernels' softmax, SiLU,
   GELU and tanh: what the tiers' tests compare (each tier's exp_ps, to the bit). */
int hfd_exp_f32(const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mk = mask16(n - i);
        _mm512_mask_storeu_ps(y + i, mk, exp_ps(_mm512_maskz_loadu_ps(mk, x + i)));
    }
    return 0;
}
