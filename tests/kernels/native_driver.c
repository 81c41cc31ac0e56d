/* Runs the native kernels' exported functions (hf_dsinfer/kernels/csrc/hfd_api.h) on
 * deterministic inputs and writes inputs and outputs to one file, for
 * tests/kernels/test_native_arm64.py: built once for the host and once for aarch64 (run under
 * qemu-aarch64), each against the generic tier's library of its compiler, so the two files can
 * be compared to the bit, and each checked against torch references in Python.
 *
 * Usage: native_driver OUT_FILE. Exit status 0, or 1 when a kernel returned an error code.
 *
 * Record format (little-endian, what the test's _records() reads): u32 name length, the name,
 * u32 dtype (DT_* below), u32 ndim, int64 dims[ndim], then the elements.
 *
 * Inputs come from a fixed integer generator and are exact in their dtype (bf16 values are
 * k / 128 times a power of two), so both builds start from the same bits. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hfd_api.h"

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_U8 = 3, DT_I8 = 4, DT_I32 = 5 };
static const int SIZE[] = {4, 2, 2, 1, 1, 4};
static FILE *out;
static int failures;
static const int NT = 2; /* threads: exercises the kernels' parallel splits */

static void put(const char *name, int dt, int nd, const int64_t *dims, const void *data) {
    uint32_t len = (uint32_t)strlen(name), d = (uint32_t)dt, n = (uint32_t)nd;
    int64_t count = 1;
    for (int i = 0; i < nd; i++) count *= dims[i];
    fwrite(&len, 4, 1, out);
    fwrite(name, 1, len, out);
    fwrite(&d, 4, 1, out);
    fwrite(&n, 4, 1, out);
    fwrite(dims, 8, (size_t)nd, out);
    fwrite(data, (size_t)SIZE[dt], (size_t)count, out);
}
#define PUT(name, dt, data, ...)                                                                \
    do {                                                                                        \
        const int64_t dims_[] = {__VA_ARGS__};                                                  \
        put(name, dt, (int)(sizeof(dims_) / sizeof(dims_[0])), dims_, data);                    \
    } while (0)

static void check(int rc, const char *what) {
    if (rc != 0) {
        fprintf(stderr, "%s returned %d\n", what, rc);
        failures++;
    }
}

/* splitmix64 */
static uint64_t state = 0x243F6A8885A308D3ull;
static uint64_t next(void) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
/* k / 128 * scale with k uniform in [-128, 127]: exact in bf16 for a power-of-two scale */
static float small(float scale) { return (float)((int)(next() >> 56) - 128) / 128.0f * scale; }
static uint16_t bf16_of(float f) { /* f exact in bf16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}
static void *alloc(int64_t bytes) {
    void *p = calloc((size_t)bytes, 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}
static uint16_t *bf16s(int64_t n, float scale) {
    uint16_t *p = alloc(n * 2);
    for (int64_t i = 0; i < n; i++) p[i] = bf16_of(small(scale));
    return p;
}
/* 1 + k / 128 in [0, 2) times scale: positive scales */
static uint16_t *bf16_positive(int64_t n, float scale) {
    uint16_t *p = alloc(n * 2);
    for (int64_t i = 0; i < n; i++) p[i] = bf16_of((1.0f + small(1.0f)) * scale + scale / 128);
    return p;
}
static float *f32s(int64_t n) { /* 24 significant bits */
    float *p = alloc(n * 4);
    for (int64_t i = 0; i < n; i++) p[i] = (float)((int64_t)(next() >> 40) - (1 << 23)) / (1 << 23);
    return p;
}
static int8_t *int8s(int64_t n) {
    int8_t *p = alloc(n);
    for (int64_t i = 0; i < n; i++) p[i] = (int8_t)((int)(next() % 255) - 127);
    return p;
}
static uint8_t *bytes(int64_t n) {
    uint8_t *p = alloc(n);
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)(next() >> 56);
    return p;
}
static int32_t *rowsums(const int8_t *q, int64_t n, int64_t k) {
    int32_t *s = alloc(n * 4);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < k; c++) s[r] += q[r * k + c];
    return s;
}
/* [n, k] row-major -> row tiles [n / 4, k / 64, 4, 64] (hfd_simd.h: tile_row) */
static int8_t *tiled(const int8_t *q, int64_t n, int64_t k) {
    int8_t *t = alloc(n * k);
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < k; c++)
            t[((r / 4) * (k / 64) + c / 64) * 256 + (r % 4) * 64 + c % 64] = q[r * k + c];
    return t;
}

static void int8_cases(void) {
    /* row-major, bf16 x with input equalization and a bias, K not a multiple of 64 */
    const int64_t M = 3, N = 64, K = 320;
    uint16_t *x = bf16s(M * K, 1.0f), *sc = bf16_positive(N, 1.0f / 256), *b = bf16s(N, 0.5f);
    float *in_scale = alloc(K * 4);
    for (int64_t c = 0; c < K; c++) in_scale[c] = 1.0f + small(0.5f);
    int8_t *q = int8s(N * K);
    int32_t *rs = rowsums(q, N, K);
    uint16_t *y = alloc(M * N * 2);
    check(hfd_int8_gemv(x, DT_BF16, in_scale, q, rs, sc, DT_BF16, b, DT_BF16, y, M, N, K, 0, NT),
          "hfd_int8_gemv");
    PUT("int8.x", DT_BF16, x, M, K);
    PUT("int8.in_scale", DT_F32, in_scale, K);
    PUT("int8.q", DT_I8, q, N, K);
    PUT("int8.scales", DT_BF16, sc, N);
    PUT("int8.bias", DT_BF16, b, N);
    PUT("int8.y", DT_BF16, y, M, N);
    uint16_t *d = alloc(16 * K * 2);
    check(hfd_dequant_int8_rows(q, sc, DT_BF16, in_scale, K, 4, 20, d, DT_BF16, 0, NT),
          "hfd_dequant_int8_rows");
    PUT("int8.rows4_20", DT_BF16, d, 16, K);
    /* row tiles, fp32 x and scales, no bias */
    const int64_t M2 = 2, N2 = 32, K2 = 256;
    float *x2 = f32s(M2 * K2), *sc2 = alloc(N2 * 4), *y2 = alloc(M2 * N2 * 4);
    for (int64_t r = 0; r < N2; r++) sc2[r] = (1.5f + small(1.0f)) / 512;
    int8_t *q2 = int8s(N2 * K2), *t2 = tiled(q2, N2, K2);
    int32_t *rs2 = rowsums(q2, N2, K2);
    check(hfd_int8_gemv(x2, DT_F32, NULL, t2, rs2, sc2, DT_F32, NULL, 0, y2, M2, N2, K2, 1, NT),
          "hfd_int8_gemv tiled");
    PUT("int8t.x", DT_F32, x2, M2, K2);
    PUT("int8t.q", DT_I8, q2, N2, K2);
    PUT("int8t.scales", DT_F32, sc2, N2);
    PUT("int8t.y", DT_F32, y2, M2, N2);
    float *d2 = alloc(N2 * K2 * 4);
    check(hfd_dequant_int8_rows(t2, sc2, DT_F32, NULL, K2, 0, N2, d2, DT_F32, 1, NT),
          "hfd_dequant_int8_rows tiled");
    PUT("int8t.rows", DT_F32, d2, N2, K2);
}

static void int4_case(const char *name, int64_t M, int64_t N, int64_t K, int64_t group,
                      int tiled_codes) {
    char key[64];
    uint16_t *x = bf16s(M * K, 2.0f);
    uint8_t *w = bytes(N * K / 2); /* any bytes are codes, row-major or tiles */
    uint16_t *sc = bf16_positive(N * K / group, 1.0f / 64), *mn = bf16s(N * K / group, 1.0f / 8);
    float *y = alloc(M * N * 4);
    check(hfd_int4_linear(x, DT_BF16, M, w, sc, mn, DT_BF16, group, N, K, tiled_codes, y, NT),
          "hfd_int4_linear");
    uint16_t *d = alloc(N * K * 2);
    check(hfd_dequant_int4_rows(w, sc, mn, DT_BF16, group, K, 0, N, d, DT_BF16, tiled_codes, NT),
          "hfd_dequant_int4_rows");
#define KEY(s) (snprintf(key, sizeof(key), "%s.%s", name, s), key)
    PUT(KEY("x"), DT_BF16, x, M, K);
    PUT(KEY("codes"), DT_U8, w, N, K / 2);
    PUT(KEY("scales"), DT_BF16, sc, N, K / group);
    PUT(KEY("mins"), DT_BF16, mn, N, K / group);
    PUT(KEY("y"), DT_F32, y, M, N);
    PUT(KEY("rows"), DT_BF16, d, N, K);
#undef KEY
}

static void kv_cases(void) {
    /* T tokens of U units (2 sequences x 2 kv heads), token-major, as the offload engine keeps
       them; quantize, decode, and attend over the codes in two spans */
    const int64_t T = 6, R = 2, KVH = 2, H = 4, U = R * KVH, D = 64, group = 32, G = D / group;
    uint16_t *k = bf16s(T * U * D, 2.0f), *v = bf16s(T * U * D, 2.0f);
    uint8_t *kp = alloc(T * U * D / 2), *vp = alloc(T * U * D / 2);
    uint16_t *ks = alloc(T * U * G * 2), *km = alloc(T * U * G * 2);
    uint16_t *vs = alloc(T * U * G * 2), *vm = alloc(T * U * G * 2);
    check(hfd_quant_kv_int4(k, DT_BF16, T * U, D, group, kp, ks, km, NT), "hfd_quant_kv_int4");
    check(hfd_quant_kv_int4(v, DT_BF16, T * U, D, group, vp, vs, vm, NT), "hfd_quant_kv_int4");
    PUT("kv.k", DT_BF16, k, T, U, D);
    PUT("kv.v", DT_BF16, v, T, U, D);
    PUT("kv.k_codes", DT_U8, kp, T, U, D / 2);
    PUT("kv.k_scales", DT_F16, ks, T, U, G);
    PUT("kv.k_mins", DT_F16, km, T, U, G);
    PUT("kv.v_codes", DT_U8, vp, T, U, D / 2);
    PUT("kv.v_scales", DT_F16, vs, T, U, G);
    PUT("kv.v_mins", DT_F16, vm, T, U, G);
    float *dk = alloc(U * T * D * 4);
    check(hfd_dequant_kv_int4(kp, (uint8_t *)ks, (uint8_t *)km, U * D / 2, U * G * 2, T, U, D,
                              group, dk, DT_F32, T, NT),
          "hfd_dequant_kv_int4");
    PUT("kv.k_decoded", DT_F32, dk, U, T, D);
    uint16_t *q = bf16s(R * H * D, 1.0f);
    uint8_t keep[2 * 6] = {1, 0, 1, 1, 1, 1, /* row 1 sees every key */ 1, 1, 1, 1, 1, 1};
    const int64_t first = 4, ps = U * D / 2, ss = U * G * 2;
    hfd_kv_span spans[2] = {
        {kp, (uint8_t *)ks, (uint8_t *)km, vp, (uint8_t *)vs, (uint8_t *)vm, ps, ss, first},
        {kp + first * ps, (uint8_t *)ks + first * ss, (uint8_t *)km + first * ss,
         vp + first * ps, (uint8_t *)vs + first * ss, (uint8_t *)vm + first * ss, ps, ss,
         T - first}};
    float *o = alloc(R * H * D * 4);
    check(hfd_attend_kv_int4(q, DT_BF16, spans, 2, R, H, KVH, D, group, keep, T, 0.125f, DT_BF16,
                             o, DT_F32, NT),
          "hfd_attend_kv_int4");
    PUT("kv.q", DT_BF16, q, R, H, D);
    PUT("kv.keep", DT_U8, keep, R, T);
    PUT("kv.out", DT_F32, o, R, H, D);
}

static void moe_case(void) {
    const int64_t E = 4, Hd = 64, I = 96, rows = 6;
    const int64_t offsets[5] = {0, 2, 3, 3, 6}; /* expert 2 gets no row */
    uint16_t *x = bf16s(rows * Hd, 1.0f), *gu = bf16s(E * 2 * I * Hd, 1.0f / 8);
    uint16_t *dn = bf16s(E * Hd * I, 1.0f / 8), *a = alloc(rows * I * 2);
    uint16_t *y = alloc(rows * Hd * 2), *yw = alloc(rows * Hd * 2);
    float *rw = alloc(rows * 4);
    for (int64_t r = 0; r < rows; r++) rw[r] = 0.5f + small(0.25f);
    check(hfd_moe_bf16(x, gu, dn, offsets, E, Hd, I, a, y, NULL, 0, 0, NT), "hfd_moe_bf16");
    check(hfd_moe_bf16(x, gu, dn, offsets, E, Hd, I, a, yw, rw, 0, 0, NT), "hfd_moe_bf16 rw");
    PUT("moe.x", DT_BF16, x, rows, Hd);
    PUT("moe.gate_up", DT_BF16, gu, E, 2 * I, Hd);
    PUT("moe.down", DT_BF16, dn, E, Hd, I);
    int32_t offsets32[5];
    for (int e = 0; e < 5; e++) offsets32[e] = (int32_t)offsets[e];
    PUT("moe.offsets", DT_I32, offsets32, 5);
    PUT("moe.rw", DT_F32, rw, rows);
    PUT("moe.y", DT_BF16, y, rows, Hd);
    PUT("moe.y_weighted", DT_BF16, yw, rows, Hd);
}

/* ---- decoder layers ---- */
enum { HID = 128, HEADS = 4, KVH = 2, HD = 32, INTER = 256, CACHE = 8 };

static hfd_lin lin_bf16(int64_t n, int64_t k, int bias) {
    hfd_lin L = {LIN_BF16, n, k, 0, 0, DT_BF16, bf16s(n * k, 1.0f / 16), NULL, NULL, NULL, NULL,
                 bias ? bf16s(n, 0.25f) : NULL};
    return L;
}
static hfd_lin lin_int8(int64_t n, int64_t k, int tile, int equalize) {
    int8_t *q = int8s(n * k);
    float *in_scale = NULL;
    if (equalize) {
        in_scale = alloc(k * 4);
        for (int64_t c = 0; c < k; c++) in_scale[c] = 1.0f + small(0.5f);
    }
    hfd_lin L = {tile ? LIN_INT8_TILED : LIN_INT8, n, k, 0, DT_BF16, 0,
                 tile ? tiled(q, n, k) : q, bf16_positive(n, 1.0f / 2048), NULL, in_scale,
                 rowsums(q, n, k), NULL};
    return L;
}
static hfd_lin lin_int4(int64_t n, int64_t k, int64_t group, int tile) {
    hfd_lin L = {tile ? LIN_INT4_TILED : LIN_INT4, n, k, group, DT_BF16, 0, bytes(n * k / 2),
                 bf16_positive(n * k / group, 1.0f / 256), bf16s(n * k / group, 1.0f / 32), NULL,
                 NULL, NULL};
    return L;
}
static hfd_layer layer(int opt, int quantized) {
    hfd_layer L = {HID, HEADS, KVH, HD, INTER, 1e-5f, 1e-5f, opt ? 1.0f : 0.17677669f,
                   opt ? 0.17677669f : 0.0f, bf16_positive(HID, 0.5f), bf16_positive(HID, 0.5f),
                   opt ? bf16s(HID, 0.25f) : NULL, opt ? bf16s(HID, 0.25f) : NULL,
                   opt ? NORM_LAYER : NORM_RMS, !opt, opt ? MLP_RELU : MLP_GATED_SILU, {{0}}};
    const int64_t nq = HEADS * HD, nkv = KVH * HD;
    if (quantized) { /* every kind of weight the layer reads */
        L.lin[L_Q] = lin_int4(nq, HID, 32, 1);
        L.lin[L_K] = lin_int4(nkv, HID, 64, 0);
        L.lin[L_V] = lin_int8(nkv, HID, 0, 1);
        L.lin[L_O] = lin_int8(HID, nq, 1, 1);
        L.lin[L_GATE] = lin_int4(INTER, HID, 32, 1);
        L.lin[L_UP] = lin_int8(INTER, HID, 1, 0);
        L.lin[L_DOWN] = lin_int4(HID, INTER, 64, 0);
    } else {
        L.lin[L_Q] = lin_bf16(nq, HID, opt);
        L.lin[L_K] = lin_bf16(nkv, HID, opt);
        L.lin[L_V] = lin_bf16(nkv, HID, opt);
        L.lin[L_O] = lin_bf16(HID, nq, opt);
        L.lin[L_GATE] = lin_bf16(INTER, HID, opt);
        if (!opt) L.lin[L_UP] = lin_bf16(INTER, HID, 0);
        L.lin[L_DOWN] = lin_bf16(HID, INTER, opt);
    }
    return L;
}

/* One decode step of layer L at position n (< CACHE) over caches kc, vc [KVH, CACHE, HD] whose
   tokens 0..n-1 hold data: q, k, v and the layer output; k, v written as token n. */
static void step(const char *name, const hfd_layer *L, const uint16_t *x, const uint16_t *cos,
                 const uint16_t *sin, uint16_t *kc, uint16_t *vc, int64_t n, const uint8_t *keep,
                 uint16_t *o) {
    char key[64];
    uint16_t *q = alloc(HEADS * HD * 2), *k = alloc(KVH * HD * 2), *v = alloc(KVH * HD * 2);
    check(hfd_decode_attn_in(L, x, cos, sin, q, k, v, NT), "hfd_decode_attn_in");
    for (int64_t h = 0; h < KVH; h++) {
        memcpy(kc + (h * CACHE + n) * HD, k + h * HD, HD * 2);
        memcpy(vc + (h * CACHE + n) * HD, v + h * HD, HD * 2);
    }
    check(hfd_decode_attn_out(L, x, q, kc, CACHE * HD, HD, vc, CACHE * HD, HD, n + 1, keep, o,
                              NT),
          "hfd_decode_attn_out");
    snprintf(key, sizeof(key), "%s.q", name);
    PUT(key, DT_BF16, q, HEADS * HD);
    snprintf(key, sizeof(key), "%s.k", name);
    PUT(key, DT_BF16, k, KVH * HD);
    snprintf(key, sizeof(key), "%s.v", name);
    PUT(key, DT_BF16, v, KVH * HD);
    snprintf(key, sizeof(key), "%s.out", name);
    PUT(key, DT_BF16, o, HID);
}

/* The bf16 weights of layer L (a Llama layer of lin_bf16 projections), for the test's
   reference. */
static void put_weights(const char *name, const hfd_layer *L) {
    static const char *const names[L_COUNT] = {"q", "k", "v", "o", "gate", "up", "down"};
    char key[64];
    snprintf(key, sizeof(key), "%s.ln1", name);
    PUT(key, DT_BF16, L->ln1, HID);
    snprintf(key, sizeof(key), "%s.ln2", name);
    PUT(key, DT_BF16, L->ln2, HID);
    for (int i = 0; i < L_COUNT; i++) {
        snprintf(key, sizeof(key), "%s.w_%s", name, names[i]);
        PUT(key, DT_BF16, L->lin[i].w, L->lin[i].n, L->lin[i].k);
    }
}

static void decode_cases(void) {
    const int64_t n = 4; /* the step's token: 4 cached before it */
    const uint8_t keep[5] = {1, 0, 1, 1, 1};
    uint16_t *cos = alloc(HD * 2), *sin = alloc(HD * 2);
    for (int i = 0; i < HD; i++) { /* any values in [-1, 1]: what the kernel does with them */
        cos[i] = bf16_of(small(1.0f));
        sin[i] = bf16_of(small(1.0f));
    }
    hfd_layer layers[3] = {layer(0, 0), layer(0, 1), layer(1, 0)};
    const char *names[3] = {"llama_bf16", "llama_quant", "opt_bf16"};
    uint16_t *x = bf16s(HID, 1.0f), *caches[3][2], *outs[3];
    for (int l = 0; l < 3; l++) {
        caches[l][0] = bf16s(KVH * CACHE * HD, 1.0f);
        caches[l][1] = bf16s(KVH * CACHE * HD, 1.0f);
        outs[l] = alloc(HID * 2);
    }
    /* whole step over the three layers in one call, from copies of the caches */
    uint16_t *kcs[3], *vcs[3], *out = alloc(HID * 2);
    int64_t strides[12];
    const hfd_layer *ptrs[3];
    for (int l = 0; l < 3; l++) {
        kcs[l] = alloc(KVH * CACHE * HD * 2);
        vcs[l] = alloc(KVH * CACHE * HD * 2);
        memcpy(kcs[l], caches[l][0], KVH * CACHE * HD * 2);
        memcpy(vcs[l], caches[l][1], KVH * CACHE * HD * 2);
        strides[4 * l] = strides[4 * l + 2] = CACHE * HD;
        strides[4 * l + 1] = strides[4 * l + 3] = HD;
        ptrs[l] = &layers[l];
    }
    check(hfd_decode_layers(ptrs, 3, x, cos, sin, kcs, vcs, strides, n, keep, out, NT),
          "hfd_decode_layers");
    /* and layer by layer in two calls each */
    const uint16_t *xin = x;
    for (int l = 0; l < 3; l++) {
        step(names[l], &layers[l], xin, cos, sin, caches[l][0], caches[l][1], n, keep, outs[l]);
        xin = outs[l];
    }
    PUT("decode.x", DT_BF16, x, HID);
    PUT("decode.cos", DT_BF16, cos, HD);
    PUT("decode.sin", DT_BF16, sin, HD);
    PUT("decode.keep", DT_U8, keep, n + 1);
    PUT("llama_bf16.kc", DT_BF16, caches[0][0], KVH, CACHE, HD); /* token n: the step's own */
    PUT("llama_bf16.vc", DT_BF16, caches[0][1], KVH, CACHE, HD);
    put_weights("llama_bf16", &layers[0]);
    PUT("decode.layers_out", DT_BF16, out, HID);
    PUT("decode.two_calls_out", DT_BF16, outs[2], HID);
}

int main(int argc, char **argv) {
    if (argc != 2 || !(out = fopen(argv[1], "wb"))) {
        fprintf(stderr, "usage: %s OUT_FILE\n", argv[0]);
        return 2;
    }
    int8_cases();
    int4_case("int4", 2, 64, 640, 64, 0);
    int4_case("int4t", 3, 32, 512, 32, 1);
    kv_cases();
    moe_case();
    decode_cases();
    fclose(out);
    return failures ? 1 : 0;
}
