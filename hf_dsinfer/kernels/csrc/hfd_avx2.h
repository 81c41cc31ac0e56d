/* The int8, int4 and bf16 dot-product loops of the avx2 tier (and the attention's probabilities
 * times V), in 256-bit AVX2 instructions.
 *
 * Included by hfd_simd.h. Elsewhere the kernels are written once with AVX-512 intrinsics, and on
 * AVX2 SIMDe runs each 512-bit op as two 256-bit ones; for the int8 and int4 dot products that
 * emulation is the bottleneck: vpdpbusd (u8 x s8, exact int32 sums of 4 products) becomes ~10
 * AVX2 ops per half (x split into nibbles so that vpmaddubsw's int16 pair sums cannot saturate),
 * and the int4 kernel's lane permutes go through memory. A Llama-1.1B shaped int8 GEMV ran at
 * ~10 GB/s and the int4 one at 1-2 GB/s on one Zen 5 core capped to avx2 (28-36 and 25 GB/s in
 * its own AVX-512 code), far below memory bandwidth. These loops compute the same integer sums
 * and the same fp32 operations per lane, in the same order, so every tier still returns the
 * same bits (tests/kernels/test_native_tiers.py):
 *
 * int8 (int8_dots_avx2): x is the same 24-bit fixed point v (int8_fixed), stored as two int16
 *   planes v = 4096 hi + lo, lo in [-2048, 2047], hi in [-2048, 2048] (int8_planes16), and the
 *   weights are widened to int16 (vpmovsxbw) for vpmaddwd: exact int32 pair sums, no offset and
 *   no row sum to remove. A lane sums K / 8 products of at most 128 * 2048, so K < 65536 (the
 *   byte-plane kernel's bound); the lanes are summed in int64. Per 32 weights: 2 widenings,
 *   4 vpmaddwd, 4 adds, against 6 nibble vpmaddubsw + 6 vpmaddwd + shifts in the emulation.
 *
 * int4 (int4_dots_avx2): the byte planes of x (cpu_decode.c: prepare_input_dt) meet the codes
 *   (0..15) in vpmaddubsw, which cannot saturate here (|pair| <= 2 * 15 * 255), so no nibble
 *   split is needed: the even and odd columns' pairs add in int16 (<= 15300) and vpmaddwd by 1
 *   (by 256 for the middle byte) gives each dword lane the integer sum vpdpbusd gives it. Lane
 *   groups, scales and the fp32 epilogue follow cpu_decode.c's int4_dots lane for lane, with
 *   16 lanes as two halves of 8; the halves meet in the reduction in gcc's order for
 *   _mm512_reduce_add_ps (lanes i and i + 8 first).
 *
 * AVX-VNNI (the avx2_vnni tier, HFD_AVX_VNNI): the int4 loops take vpdpbusd on ymm for the
 *   vpmaddubsw + vpmaddwd pairs (the low and middle planes times the codes, the codes times the
 *   signed high plane: u8 x s8 either way), and the int8 loops vpdpwssd for vpmaddwd + add;
 *   both give the same int32 lane sums, so the same bits. Measured on Zen 5 (2026-11-25):
 *   int4 dots 1.38-1.43 -> 1.05-1.08 ns per 32 code bytes and row (one core, L1-resident
 *   codes); Llama-1.1B shaped int4 decode 1.06x and prefill 1.17x, int8 prefill 1.28x (its
 *   batch-1 decode is bound by memory), batch-16 int8 decode 1.24x (docs/performance.md).
 */
#ifndef HFD_AVX2_H
#define HFD_AVX2_H

#if defined(__AVX2__) && !defined(__AVX512F__)
#define HFD_AVX2_DOTS 1
#include <immintrin.h>
#if HFD_VNNI_INSNS /* hfd_simd.h */
#define HFD_AVX_VNNI 1
#else
#define HFD_AVX_VNNI 0
#endif

/* bytes of x as int8_input stores it for the dot products of this tier */
#define INT8_X_BYTES(kp) (4 * (kp))

/* int8_fixed's v as two int16 planes at p: lo (kp values) then hi (kp values), v = 4096 hi +
   lo exactly. Returns the value of one unit. */
static inline double int8_planes16(const void *x, int dt, const float *in_scale, int64_t K,
                                   int64_t kp, float *xf, uint8_t *p) {
    const double unit = int8_fixed(x, dt, in_scale, K, kp, xf);
    int16_t *lo = (int16_t *)p, *hi = lo + kp;
    const __m256i half = _mm256_set1_epi32(2048), low = _mm256_set1_epi32(4095);
    for (int64_t k = 0; k < kp; k += 16) {
        __m256i v[2], l[2], h[2];
        for (int i = 0; i < 2; i++) {
            v[i] = _mm256_load_si256((const __m256i *)(xf + k + 8 * i));
            /* balanced: lo = ((v + 2048) mod 4096) - 2048, hi = (v - lo) / 4096 */
            l[i] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(v[i], half), low), half);
            h[i] = _mm256_srai_epi32(_mm256_sub_epi32(v[i], l[i]), 12);
        }
        /* vpackssdw packs per 128-bit lane: 0xD8 puts the 16 values back in order */
        _mm256_store_si256((__m256i *)(lo + k),
                           _mm256_permute4x64_epi64(_mm256_packs_epi32(l[0], l[1]), 0xD8));
        _mm256_store_si256((__m256i *)(hi + k),
                           _mm256_permute4x64_epi64(_mm256_packs_epi32(h[0], h[1]), 0xD8));
    }
    return unit;
}

/* the int64 sum of 8 int32 lanes */
static inline int64_t hfd_sum8_epi32(__m256i v) {
    int32_t a[8];
    _mm256_storeu_si256((__m256i *)a, v);
    int64_t s = 0;
    for (int i = 0; i < 8; i++) s += a[i];
    return s;
}

/* acc[r] += the int32 pair sums of 32 weights of row r (at w[r]) times the 32 columns of x's
   planes (l0 | l1 low, h0 | h1 high) */
#if HFD_AVX_VNNI
/* AVX-VNNI: vpdpwssd adds the same int32 pair sums (|pair| <= 2 * 128 * 2048, no wrap) */
#define INT8_AVX2_STEP(w, l0, l1, h0, h1, al, ah)                                                \
    for (int r = 0; r < INT8_ROWS; r++) {                                                       \
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r])));      \
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + 16))); \
        al[r] = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(al[r], w0, l0), w1, l1);       \
        ah[r] = _mm256_dpwssd_avx_epi32(_mm256_dpwssd_avx_epi32(ah[r], w0, h0), w1, h1);       \
    }
#else
#define INT8_AVX2_STEP(w, l0, l1, h0, h1, al, ah)                                                \
    for (int r = 0; r < INT8_ROWS; r++) {                                                       \
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r])));      \
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[r] + 16))); \
        al[r] = _mm256_add_epi32(al[r], _mm256_add_epi32(_mm256_madd_epi16(w0, l0),             \
                                                         _mm256_madd_epi16(w1, l1)));           \
        ah[r] = _mm256_add_epi32(ah[r], _mm256_add_epi32(_mm256_madd_epi16(w0, h0),             \
                                                         _mm256_madd_epi16(w1, h1)));           \
    }
#endif

/* int8_dots (hfd_simd.h) on this tier: s[r] = sum_k v[k] * q[r, k] exactly, x as int8_planes16
   stored it at p; the same rows, prefetches and bytes read. */
static inline __attribute__((always_inline)) void int8_dots_avx2(
        const int8_t *const *wr, int rows, const uint8_t *p, int64_t kp, int64_t K, int64_t *s,
        const int8_t *next, const int8_t *end, int tiled) {
    const int16_t *xl = (const int16_t *)p, *xh = xl + kp;
    const int64_t step = tiled ? INT8_ROWS : 1; /* bytes of a row's stream per column */
    __m256i al[INT8_ROWS], ah[INT8_ROWS];
    for (int r = 0; r < INT8_ROWS; r++) al[r] = ah[r] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        if (tiled) {
            if (end) prefetch_tiles(wr[0] + k * step, end);
        } else {
            prefetch_next_block(next, end, k / 64 * INT8_ROWS, INT8_ROWS, 0);
        }
        for (int h = 0; h < 64; h += 32) {
            const __m256i l0 = _mm256_load_si256((const __m256i *)(xl + k + h));
            const __m256i l1 = _mm256_load_si256((const __m256i *)(xl + k + h + 16));
            const __m256i h0 = _mm256_load_si256((const __m256i *)(xh + k + h));
            const __m256i h1 = _mm256_load_si256((const __m256i *)(xh + k + h + 16));
            const int8_t *w[INT8_ROWS];
            for (int r = 0; r < INT8_ROWS; r++) w[r] = wr[r] + k * step + h;
            INT8_AVX2_STEP(w, l0, l1, h0, h1, al, ah)
        }
    }
    if (k < K) { /* row-major only (tiles hold whole 64-column chunks): the last K % 64 columns,
                    copied so that no byte past a row is read; x is 0 past K */
        int8_t tail[INT8_ROWS][64];
        const int8_t *w[INT8_ROWS];
        for (int r = 0; r < INT8_ROWS; r++) {
            memset(tail[r], 0, 64);
            memcpy(tail[r], wr[r] + k, (size_t)(K - k));
        }
        for (int h = 0; h < 64; h += 32) {
            const __m256i l0 = _mm256_load_si256((const __m256i *)(xl + k + h));
            const __m256i l1 = _mm256_load_si256((const __m256i *)(xl + k + h + 16));
            const __m256i h0 = _mm256_load_si256((const __m256i *)(xh + k + h));
            const __m256i h1 = _mm256_load_si256((const __m256i *)(xh + k + h + 16));
            for (int r = 0; r < INT8_ROWS; r++) w[r] = tail[r] + h;
            INT8_AVX2_STEP(w, l0, l1, h0, h1, al, ah)
        }
    }
    for (int r = 0; r < rows; r++) s[r] = hfd_sum8_epi32(al[r]) + 4096 * hfd_sum8_epi32(ah[r]);
}

/* _mm512_reduce_add_ps's order (hfd_simd.h: hfd_reduce_add_ps) on 16 lanes held as lanes 0-7
   in a and 8-15 in b */
static inline float hfd_reduce16_ps(__m256 a, __m256 b) {
    float v[8];
    _mm256_storeu_ps(v, _mm256_add_ps(b, a));
    for (int i = 0; i < 4; i++) v[i] = v[i + 4] + v[i];
    for (int i = 0; i < 2; i++) v[i] = v[i] + v[i + 2];
    return v[0] + v[1];
}

/* vdpbf16ps on this tier: a[0] (lanes 0-7) and a[1] (lanes 8-15) += the pair products of the
   32 bf16 at w with x's 32 (split by hfd_bf16_split into its odd elements xh and even ones xl,
   as fp32), the odd (high) element's product first, each by one fma: hfd_simd.h's emulation
   lane for lane, in 256-bit registers (the emulation's 512-bit vectors live in memory here) */
static inline __attribute__((always_inline)) void hfd_dpbf16_avx2(__m256 a[2], const uint16_t *w,
                                                                  const __m256 xh[2],
                                                                  const __m256 xl[2]) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + 16 * h));
        a[h] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, high)), xh[h], a[h]);
        a[h] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xl[h], a[h]);
    }
}

static inline __attribute__((always_inline)) void hfd_bf16_split(const uint16_t *x, __m256 xh[2],
                                                                 __m256 xl[2]) {
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x + 16 * h));
        xh[h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        xl[h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
}

/* out[i * ldo + r] = the vdpbf16ps dot product of weight row r (w + r * ldw; rows r >= nw read
   row 0 and are not stored) with x row i (x + i * ldx, i < NX, a literal at each call site) over
   K columns, those past the last multiple of 32 as zeros (the masked loads' zeros), reduced in
   _mm512_reduce_add_ps's order: the 4-row bf16 dot loops of cpu_decode.c, cpu_moe.c and
   cpu_experts.c on this tier, the same bits as their AVX-512 form. With one row of x the weight
   rows are streamed one at a time, which reads memory faster than 4 rows side by side
   (docs/performance.md, "Behind the code"); each row's sums are the same either way. */
static inline __attribute__((always_inline)) void bf16_dots_avx2(
        const uint16_t *w, int64_t ldw, int nw, const uint16_t *x, int64_t ldx, const int NX,
        int64_t K, int prefetch, float *out, int64_t ldo) {
    if (NX == 1 && K % 32 == 0) {
        for (int r = 0; r < nw; r++) {
            const uint16_t *wr = w + r * ldw;
            __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
            for (int64_t k = 0; k < K; k += 32) {
                __m256 xh[2], xl[2];
                hfd_bf16_split(x + k, xh, xl);
                _mm_prefetch((const char *)(wr + k) + prefetch, _MM_HINT_T0);
                hfd_dpbf16_avx2(a, wr + k, xh, xl);
            }
            out[r] = hfd_reduce16_ps(a[0], a[1]);
        }
        return;
    }
    __m256 acc[4][4][2];
    const uint16_t *wr[4];
    for (int r = 0; r < 4; r++) {
        wr[r] = w + (r < nw ? r : 0) * ldw;
        for (int i = 0; i < NX; i++) acc[r][i][0] = acc[r][i][1] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256 xh[4][2], xl[4][2];
        for (int i = 0; i < NX; i++) hfd_bf16_split(x + i * ldx + k, xh[i], xl[i]);
        for (int r = 0; r < 4; r++) {
            _mm_prefetch((const char *)(wr[r] + k) + prefetch, _MM_HINT_T0);
            for (int i = 0; i < NX; i++) hfd_dpbf16_avx2(acc[r][i], wr[r] + k, xh[i], xl[i]);
        }
    }
    if (k < K) {
        uint16_t wt[4][32], xt[4][32];
        __m256 xh[4][2], xl[4][2];
        for (int i = 0; i < NX; i++) {
            memset(xt[i], 0, sizeof(xt[i]));
            memcpy(xt[i], x + i * ldx + k, (size_t)(K - k) * 2);
            hfd_bf16_split(xt[i], xh[i], xl[i]);
        }
        for (int r = 0; r < 4; r++) {
            memset(wt[r], 0, sizeof(wt[r]));
            memcpy(wt[r], wr[r] + k, (size_t)(K - k) * 2);
            for (int i = 0; i < NX; i++) hfd_dpbf16_avx2(acc[r][i], wt[r], xh[i], xl[i]);
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < nw; r++) out[i * ldo + r] = hfd_reduce16_ps(acc[r][i][0], acc[r][i][1]);
}

/* The three int16 pair sums of 32 code bytes (even columns: low nibbles e, odd: high nibbles o)
   with x's planes: lo and mid bytes unsigned (x first), hi bytes signed (codes first) */
#define INT4_AVX2_PAIRS(e, o, xel, xol, xem, xom, xeh, xoh, lo16, mid16, hi16)                   \
    const __m256i lo16 = _mm256_add_epi16(_mm256_maddubs_epi16(xel, e), _mm256_maddubs_epi16(xol, o)); \
    const __m256i mid16 = _mm256_add_epi16(_mm256_maddubs_epi16(xem, e), _mm256_maddubs_epi16(xom, o)); \
    const __m256i hi16 = _mm256_add_epi16(_mm256_maddubs_epi16(e, xeh), _mm256_maddubs_epi16(o, xoh))

/* cpu_decode.c's int4_dots on this tier, up to the mins: dot[r] = the fp32 sum of row r's
   scaled group products with x, for the TILE_ROWS rows whose codes start at wr[r] (tiles when
   tiled) with fp32 scales scale[r] (padded with 16 zeros); K columns, groups of 1 << gshift
   (32-256); planes: x's six byte planes, half bytes each; gunit: x's unit per group (padded);
   next / end: as int4_dots prefetches. */
static inline __attribute__((always_inline)) void int4_dots_avx2(
        const uint8_t *const *wr, const float *const *scale, int64_t K, int gshift, int tiled,
        const uint8_t *planes, int64_t half, const float *gunit, const char *next,
        const char *end, float *dot) {
    const int64_t step = tiled ? TILE_ROWS : 1; /* bytes of a row's stream per code byte */
    const uint8_t *xe = planes, *xo = xe + half; /* lo, mid, hi planes 2 * half apart */
    const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i c256 = _mm256_set1_epi16(256);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 acc[TILE_ROWS][2];
    for (int r = 0; r < TILE_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    /* Tiles: whole 512-column runs, lane j (of 16) of chunk 4s + i holds columns 512s + 32j +
       8i .. + 7 (int4_order); a lane's group is (512s + 32j) >> gshift, 256 h >> gshift + that
       of lane j - 8h in half h */
    const int64_t runs = tiled ? K / 512 : 0;
    const __m256i lidx = _mm256_srli_epi32(_mm256_slli_epi32(lane, 5), gshift);
    for (int64_t s = 0; s < runs; s++) {
        const int64_t gb = (512 * s) >> gshift;
        for (int h = 0; h < 2; h++) {
            __m256i lm[TILE_ROWS], hi[TILE_ROWS]; /* lo + 256 mid, hi: exact int32 */
            for (int r = 0; r < TILE_ROWS; r++) lm[r] = hi[r] = _mm256_setzero_si256();
            for (int64_t c = 4 * s; c < 4 * s + 4; c++) {
                const int64_t o = c * 64 + 32 * h;
                const __m256i xel = _mm256_loadu_si256((const __m256i *)(xe + o));
                const __m256i xol = _mm256_loadu_si256((const __m256i *)(xo + o));
                const __m256i xem = _mm256_loadu_si256((const __m256i *)(xe + 2 * half + o));
                const __m256i xom = _mm256_loadu_si256((const __m256i *)(xo + 2 * half + o));
                const __m256i xeh = _mm256_loadu_si256((const __m256i *)(xe + 4 * half + o));
                const __m256i xoh = _mm256_loadu_si256((const __m256i *)(xo + 4 * half + o));
                if (h == 0) prefetch_tiles(wr[0] + c * 64 * step, end);
                for (int r = 0; r < TILE_ROWS; r++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wr[r] + c * 64 * step + 32 * h));
                    const __m256i e = _mm256_and_si256(v, nibble);
                    const __m256i od = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#if HFD_AVX_VNNI
                    const __m256i m = _mm256_dpbusd_avx_epi32(
                        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), xem, e), xom, od);
                    lm[r] = _mm256_add_epi32(
                        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(lm[r], xel, e), xol, od),
                        _mm256_slli_epi32(m, 8));
                    hi[r] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(hi[r], e, xeh), od, xoh);
#else
                    INT4_AVX2_PAIRS(e, od, xel, xol, xem, xom, xeh, xoh, lo16, mid16, hi16);
                    lm[r] = _mm256_add_epi32(lm[r], _mm256_add_epi32(_mm256_madd_epi16(lo16, ones),
                                                                     _mm256_madd_epi16(mid16, c256)));
                    hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(hi16, ones));
#endif
                }
            }
            const int64_t g = gb + ((256 * h) >> gshift);
            __m256 unit = _mm256_loadu_ps(gunit + g);
            if (gshift != 5) unit = _mm256_permutevar8x32_ps(unit, lidx);
            for (int r = 0; r < TILE_ROWS; r++) {
                __m256 t = _mm256_cvtepi32_ps(lm[r]);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[r]), _mm256_set1_ps(65536.f), t);
                __m256 sc = _mm256_loadu_ps(scale[r] + g);
                if (gshift != 5) sc = _mm256_permutevar8x32_ps(sc, lidx);
                acc[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(t, unit), sc, acc[r][h]);
            }
        }
    }
    /* 128-column chunks (row-major, or tiles past the last whole run): lane j's 8 columns
       128 c + 8 j .. lie in group (128 c + 8 j) >> gshift; (64 h) >> gs + that of lane j - 8h
       in half h (gs = min(gshift, 7): a chunk lies in one group from 128 up) */
    const int gs = gshift < 7 ? gshift : 7;
    const __m256i gidx = _mm256_srli_epi32(_mm256_slli_epi32(lane, 3), gs);
    for (int64_t c = 4 * runs; c < (K + 127) / 128; c++) {
        const int64_t bytes = K - c * 128 >= 128 ? 64 : (K - c * 128) / 2;
        if (tiled)
            prefetch_tiles(wr[0] + c * 64 * step, end);
        else
            prefetch_next_block(next, end, TILE_ROWS * c, TILE_ROWS, 0);
        const int64_t g0 = (c * 128) >> gshift;
        for (int h = 0; h < 2; h++) {
            const int64_t o = c * 64 + 32 * h, g = g0 + ((64 * h) >> gs);
            const __m256i xel = _mm256_loadu_si256((const __m256i *)(xe + o));
            const __m256i xol = _mm256_loadu_si256((const __m256i *)(xo + o));
            const __m256i xem = _mm256_loadu_si256((const __m256i *)(xe + 2 * half + o));
            const __m256i xom = _mm256_loadu_si256((const __m256i *)(xo + 2 * half + o));
            const __m256i xeh = _mm256_loadu_si256((const __m256i *)(xe + 4 * half + o));
            const __m256i xoh = _mm256_loadu_si256((const __m256i *)(xo + 4 * half + o));
            const __m256 unit = _mm256_permutevar8x32_ps(_mm256_loadu_ps(gunit + g), gidx);
            for (int r = 0; r < TILE_ROWS; r++) {
                /* a partial last chunk (K % 128: 16, 32 or 48 bytes): its bytes, then zeros,
                   loaded from the row itself (a copy into a zeroed buffer read back as a vector
                   stalled on store forwarding at every block of SmolLM2's K = 576 rows) */
                const uint8_t *at = wr[r] + c * 64 * step + 32 * h;
                const __m256i v = bytes - 32 * h >= 32 ? _mm256_loadu_si256((const __m256i *)at)
                    : bytes - 32 * h == 16 ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)at))
                    : _mm256_setzero_si256();
                const __m256i e = _mm256_and_si256(v, nibble);
                const __m256i od = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#if HFD_AVX_VNNI
                const __m256i z = _mm256_setzero_si256();
                const __m256i lo = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, xel, e), xol, od);
                const __m256i mid = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, xem, e), xom, od);
                const __m256i hh = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(z, e, xeh), od, xoh);
                const __m256i sum = _mm256_add_epi32(
                    lo, _mm256_add_epi32(_mm256_slli_epi32(mid, 8), _mm256_slli_epi32(hh, 16)));
#else
                INT4_AVX2_PAIRS(e, od, xel, xol, xem, xom, xeh, xoh, lo16, mid16, hi16);
                /* lo + 256 mid + 65536 hi, |sum| < 2^31 */
                const __m256i sum = _mm256_add_epi32(
                    _mm256_add_epi32(_mm256_madd_epi16(lo16, ones), _mm256_madd_epi16(mid16, c256)),
                    _mm256_slli_epi32(_mm256_madd_epi16(hi16, ones), 16));
#endif
                const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(sum), unit);
                const __m256 sc = _mm256_permutevar8x32_ps(_mm256_loadu_ps(scale[r] + g), gidx);
                acc[r][h] = _mm256_fmadd_ps(t, sc, acc[r][h]);
            }
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) dot[r] = hfd_reduce16_ps(acc[r][0], acc[r][1]);
}

/* 8 bf16 at p as fp32 (exact) */
static inline __m256 hfd_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 values of dtype dt from element i on as fp32 (exact conversions: load16's values); n < 8
   reads n and gives 0 past them (through a buffer: hfd_load8_in avoids it inside an array) */
static inline __attribute__((always_inline)) __m256 hfd_load8(const void *p, int64_t i, int dt,
                                                              int64_t n) {
    const int size = dt == DT_F32 ? 4 : 2;
    uint8_t buf[32];
    const uint8_t *at = (const uint8_t *)p + i * size;
    if (n < 8) {
        memset(buf, 0, sizeof(buf));
        memcpy(buf, at, (size_t)((n > 0 ? n : 0) * size));
        at = buf;
    }
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)at);
    if (dt == DT_BF16) return hfd_bf16x8((const uint16_t *)at);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)at));
}

/* hfd_load8 of the n values (n <= 0 or >= 8 too) of an array of `total` elements from element i:
   where 8 lie inside the array they are loaded whole and the lanes past n zeroed (+0, as the
   buffer gives), so no vector is read back from scalar stores (that store-forwarding stall was
   ~20% of a8_dots' time on SmolLM2's fp16 scales and ~10% of the int4 dots' on its mins,
   2026-11-27); only at the array's end through hfd_load8's buffer. */
static inline __attribute__((always_inline)) __m256 hfd_load8_in(const void *p, int64_t i, int dt,
                                                                 int64_t n, int64_t total) {
    if (n >= 8) return hfd_load8(p, i, dt, 8);
    if (n <= 0) return _mm256_setzero_ps();
    if (i + 8 <= total) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        return _mm256_and_ps(hfd_load8(p, i, dt, 8),
                             _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lane)));
    }
    return hfd_load8(p, i, dt, n);
}

/* r[i] (8 dwords each) -> r[j] holding dword j of every input row: an 8 x 8 transpose.
   always_inline: out of line (gcc chose so once exp_ps grew, 2026-11-27) its arrays went
   through memory at every call, 8% of a SmolLM2 W4A8 step */
static inline __attribute__((always_inline)) void transpose8_epi32(__m256i r[8]) {
    __m256i u[8];
    for (int i = 0; i < 8; i += 2) {
        u[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        u[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* r[i + c], 128-bit lane l: dword 4l + c of rows i.. */
        r[i] = _mm256_unpacklo_epi64(u[i], u[i + 2]);
        r[i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 2]);
        r[i + 2] = _mm256_unpacklo_epi64(u[i + 1], u[i + 3]);
        r[i + 3] = _mm256_unpackhi_epi64(u[i + 1], u[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        u[c] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x20);
        u[c + 4] = _mm256_permute2x128_si256(r[c], r[c + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) r[i] = u[i];
}

/* 8 lanes stored as bf16 at p: bf16_bits (hfd_simd.h) lane for lane, round to nearest even,
   a NaN kept as (bits >> 16) | 0x40 */
static inline void hfd_store8_bf16(uint16_t *p, __m256 v) {
    const __m256i r = hfd_bf16_bits8(v); /* hfd_simd.h */
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(r),
                                                    _mm256_extracti128_si256(r, 1)));
}

/* dst[0 .. n) = fp32 of src's elements i .. i + n (the values load16 gives) */
static inline void hfd_to_f32(float *dst, const void *src, int64_t i, int64_t n, int dt) {
    if (dt == DT_BF16) { /* the int4 scales' usual dtype: a shift, no tail buffer (int4_setup
                            per block of rows was ~5% of an int4 decode step with hfd_load8) */
        const uint16_t *s = (const uint16_t *)src + i;
        int64_t c = 0;
        for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, hfd_bf16x8(s + c));
        for (; c < n; c++) {
            const uint32_t u = (uint32_t)s[c] << 16;
            memcpy(dst + c, &u, 4);
        }
        return;
    }
    /* fp32, fp16: whole vectors, then the rest one value at a time (a tail through a buffer
       read back as a vector stalled on store forwarding) */
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(dst + c, hfd_load8(src, i + c, dt, 8));
    for (; c < n; c++) dst[c] = load_f32(src, i + c, dt);
}

/* sum_g a[i + g] * b[g] for g < n (a of dtype dt holding `total` elements, b fp32), in
   int4_dots' order: 16 lanes each summing every 16th product by fma (lanes past n add
   fma(0, 0, .)), reduced as _mm512_reduce_add_ps. The last n % 16: a by hfd_load8_in, b by a
   masked load (both +0 past n). */
static inline float hfd_dot16_f32(const void *a, int64_t i, int dt, const float *b, int64_t n,
                                  int64_t total) {
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= n; g += 16) {
        m0 = _mm256_fmadd_ps(hfd_load8(a, i + g, dt, 8), _mm256_loadu_ps(b + g), m0);
        m1 = _mm256_fmadd_ps(hfd_load8(a, i + g + 8, dt, 8), _mm256_loadu_ps(b + g + 8), m1);
    }
    if (g < n) {
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256i k0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - g)), lane);
        const __m256i k1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - g - 8)), lane);
        m0 = _mm256_fmadd_ps(hfd_load8_in(a, i + g, dt, n - g, total),
                             _mm256_maskload_ps(b + g, k0), m0);
        m1 = _mm256_fmadd_ps(hfd_load8_in(a, i + g + 8, dt, n - g - 8, total),
                             _mm256_maskload_ps(b + g + 8, k1), m1);
    }
    return hfd_reduce16_ps(m0, m1);
}

#else
#define HFD_AVX2_DOTS 0
#define HFD_AVX_VNNI 0
#define INT8_X_BYTES(kp) (3 * (kp))
#endif

#endif
