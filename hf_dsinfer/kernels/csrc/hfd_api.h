/* The library's exported functions and the structs they take: what _native.py's _declare binds
 * through ctypes (and kernels/decode.py mirrors as ctypes Structures), and what C callers such as
 * the test driver tests/kernels/native_driver.c link against. The kernels' files include it, so
 * the compiler checks each definition against its declaration here. Plain C, no SIMD types.
 *
 * Dtype codes (x_dt, s_dt, o_dt, ...): 0 fp32, 1 bf16, 2 fp16 (hfd_simd.h: DT_*). Return codes:
 * 0, -1 bad arguments, -2 out of memory, -3 not computable here (use another kernel). */
#ifndef HFD_API_H
#define HFD_API_H

#include <stdint.h>

/* The version of this interface: bump it with any change to a struct, an enum or a function
 * signature below. kernels/abi.py holds the same number and refuses a library whose hfd_abi()
 * reports another, or other struct sizes (a stale or foreign build). */
#ifndef HFD_ABI_VERSION
#define HFD_ABI_VERSION 9
#endif

/* Fills info[0 .. n) with: HFD_ABI_VERSION, sizeof(hfd_lin), sizeof(hfd_layer), L_COUNT,
 * offsetof(hfd_layer, lin), offsetof(hfd_layer, resid_mult), sizeof(hfd_kv_span); returns how
 * many it wrote. */
#define HFD_ABI_FIELDS 7
int64_t hfd_abi(int64_t *info, int64_t n);

/* ---- cpu_decode.c: one decoder layer for one token ---- */

/* kinds of linear; the _TILED ones store their weight as row tiles (hfd_simd.h: tile_row).
   LIN_INT4_A8*: 4-bit codes (as LIN_INT4*) times 8-bit activations, in hfd_int4_gemm_a8's
   numbers (ABI 6). */
enum { LIN_BF16 = 0, LIN_INT8 = 1, LIN_INT4 = 2, LIN_INT8_TILED = 3, LIN_INT4_TILED = 4,
       LIN_INT4_A8 = 5, LIN_INT4_A8_TILED = 6 };

/* A linear layer y = x W^T + bias as the model stores it (mirrored by a ctypes Structure in
   hf_dsinfer/kernels/decode.py). */
typedef struct {
    int64_t kind, n, k, group; /* group: int4 group size */
    int64_t s_dt, b_dt;        /* dtypes of scales / mins and of bias */
    const void *w;             /* bf16 [n, k] | int8 [n, k] | uint8 [n, k / 2], or tiles */
    const void *scales;        /* int8: [n]; int4: [n, k / group] */
    const void *mins;          /* int4: [n, k / group] */
    const float *in_scale;     /* int8: [k] input equalization, or NULL */
    const int32_t *rowsum;     /* int8: [n] sums of each row of q */
    const void *bias;          /* [n] or NULL */
} hfd_lin;

enum { L_Q, L_K, L_V, L_O, L_GATE, L_UP, L_DOWN, L_COUNT };

/* norm: RMSNorm (Llama), LayerNorm with optional bias (OPT), or an RMSNorm whose weight
   multiply is in fp32 (OLMo 2: bf16(w * normalized); Gemma: bf16(normalized * (1 + w))), for
   every norm of the layer (q / k norms included); mlp: SiLU-gated (gate, up, down),
   fc1 -> ReLU -> fc2 (OPT: L_GATE is fc1, L_UP unused, L_DOWN is fc2) or tanh-GELU-gated
   (Gemma's GeGLU), or (ABI 8) fc1 -> squared ReLU -> fc2 (Nemotron, Arcee) or fc1 -> tanh GELU
   -> fc2 (StarCoder2); rope: none, rotate-half with bf16 cos / sin (each product rounded), or with
   fp32 cos / sin (OLMo 2: the rotation in fp32, rounded once); the _PAIRS ones (ABI 7) rotate
   interleaved pairs (2j, 2j + 1) by cos / sin [j], the first half of Llama's cat(freqs, freqs)
   tables as HF passes them (ERNIE 4.5 in fp32; Helium, GLM, GLM-4 in bf16). */
enum { NORM_RMS = 0, NORM_LAYER = 1, NORM_RMS_FP32 = 2, NORM_RMS_UNIT = 3 };
enum { MLP_GATED_SILU = 0, MLP_RELU = 1, MLP_GATED_GELU_TANH = 2, MLP_RELU2 = 3, MLP_GELU_TANH = 4 };
/* the MLPs with a gate and an up projection (the others: fc1 -> activation -> fc2) */
#define MLP_IS_GATED(m) ((m) == MLP_GATED_SILU || (m) == MLP_GATED_GELU_TANH)
enum { ROPE_NONE = 0, ROPE_BF16 = 1, ROPE_FP32 = 2, ROPE_BF16_PAIRS = 3, ROPE_FP32_PAIRS = 4 };

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, inter;
    float eps1, eps2, scale; /* scale: of q . k in the softmax */
    float q_scale;           /* OPT: q = bf16(q_proj(h) * q_scale) before attention; 0: none */
    const uint16_t *ln1, *ln2;     /* bf16 [hidden], or NULL: no norm (OLMo 2's pre-norms) */
    const uint16_t *ln1_b, *ln2_b; /* LayerNorm biases, bf16 [hidden], or NULL */
    int64_t norm, rope, mlp;       /* NORM_*, ROPE_*, MLP_* */
    hfd_lin lin[L_COUNT];
    const uint16_t *q_norm, *k_norm; /* per-head RMSNorm weights, bf16 [head_dim], or NULL */
    float q_eps, k_eps;
    float resid_mult; /* Granite: x + bf16(branch * resid_mult); 0: x + branch; after a
                         post-norm (ABI 9, Peri-LN): x + bf16(norm(branch) * resid_mult) */
    /* ABI 2 */
    const uint16_t *ln3, *ln4; /* sandwich (Gemma 2/3, OLMo 2): norms of the attention and the
                                  MLP output before each residual add, bf16 [hidden], or NULL */
    float eps3, eps4;
    float softcap;        /* Gemma 2: attention logits s -> softcap * tanh(s / softcap); 0: none */
    int64_t window;       /* sliding window: each query attends its last `window` keys; 0: all */
    int64_t qk_norm_full; /* q / k norms over the whole projection (weights [heads * d] and
                             [kv_heads * d], OLMo 2); 0: over each head (weights [d]) */
    /* ABI 3 */
    int64_t rotary_dim; /* partial rotary (Phi-3 / Phi-4-mini's partial_rotary_factor): only the
                           first rotary_dim (even, <= head_dim) dims of each q / k head rotate,
                           with cos / sin of rotary_dim values; the rest pass through; 0: all */
    /* ABI 7 */
    int64_t qk_norm_after_rope; /* the q / k norms apply to the rotated q and k (HunYuan);
                                   0: before RoPE (Qwen3, Gemma 3, OLMo 2) */
} hfd_layer;

/* cos / sin: bf16 [r], or fp32 [r] for a ROPE_FP32 / ROPE_FP32_PAIRS layer (the same pointers); r: the layer's
   rotary_dim, or head_dim where that is 0. */
int hfd_decode_attn_in(const hfd_layer *L, const uint16_t *x, const uint16_t *cos,
                       const uint16_t *sin, uint16_t *q, uint16_t *k, uint16_t *v, int nthreads);
int hfd_decode_attn_out(const hfd_layer *L, const uint16_t *x, const uint16_t *q,
                        const uint16_t *kc, int64_t khs, int64_t kss, const uint16_t *vc,
                        int64_t vhs, int64_t vss, int64_t sk, const uint8_t *keep,
                        uint16_t *out, int nthreads);
int hfd_decode_attn_out_slots(const hfd_layer *L, const uint16_t *x, const uint16_t *q,
                              const uint16_t *kc, int64_t khs, int64_t kss, const uint16_t *vc,
                              int64_t vhs, int64_t vss, int64_t sk, const uint8_t *keep,
                              const int64_t *slots, uint16_t *out, int nthreads);
int hfd_decode_layers(const hfd_layer *const *L, int64_t count, const uint16_t *x,
                      const uint16_t *cos, const uint16_t *sin, uint16_t *const *kc,
                      uint16_t *const *vc, const int64_t *strides, int64_t n,
                      const uint8_t *keep, uint16_t *out, int nthreads);
int hfd_decode_attn_in_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                            const uint16_t *cos, const uint16_t *sin, int64_t cs_stride,
                            uint16_t *q, uint16_t *k, uint16_t *v, const int64_t *bounds,
                            int nthreads);
int hfd_decode_attn_out_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                             const uint16_t *q, const uint16_t *kc, int64_t kbs, int64_t khs,
                             int64_t kss, const uint16_t *vc, int64_t vbs, int64_t vhs,
                             int64_t vss, int64_t sk, const uint8_t *keep, int64_t keep_stride,
                             uint16_t *out, const int64_t *bounds, int nthreads);
int hfd_decode_post_attn_rows(const hfd_layer *L, int64_t rows, const uint16_t *x,
                              const uint16_t *a, uint16_t *out, const int64_t *bounds,
                              int nthreads);
int hfd_attend_rows(const uint16_t *q, int64_t qhs, int64_t qts, const uint16_t *k,
                    int64_t khs, int64_t kss, const uint16_t *v, int64_t vhs, int64_t vss,
                    const int64_t *spans, int64_t n, int64_t heads, int64_t kv_heads, int64_t d,
                    const uint8_t *keep, int64_t keep_stride, float scale, float softcap,
                    uint16_t *out, int64_t ohs, int64_t ots, const int64_t *slots, int nthreads);
int hfd_rope_rows_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t d, int64_t rot,
                       int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
                       int64_t cs_stride, int nthreads);
int hfd_rms_rows_bf16(const uint16_t *x, int64_t rows, int64_t n, const uint16_t *w, float eps,
                      int style, uint16_t *out, int nthreads);
int hfd_exp_f32(const float *x, int64_t n, float *y);
int hfd_int4_linear(const void *x, int x_dt, int64_t M, const uint8_t *w, const void *scales,
                    const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                    float *y, int nthreads);
int hfd_int4_a8_rows(const void *x, int x_dt, int64_t M, const uint8_t *w, const void *scales,
                     const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                     float *y, int nthreads);

/* ---- cpu_qgemm.c: int4 / int8 / bf16 weights times bf16 rows, a panel in cache at a time ---- */

int hfd_int4_gemm_bf16(const uint16_t *x, int64_t M, const uint8_t *packed, const void *scales,
                       const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                       float *y, int nthreads);
int hfd_int4_gemm_a8(const void *x, int x_dt, int64_t M, const uint8_t *packed,
                     const void *scales, const void *mins, int s_dt, int64_t group, int64_t N,
                     int64_t K, int tiled, float *y, int nthreads);
int hfd_int8_gemm_bf16(const uint16_t *x, int64_t M, const int8_t *q, const void *scales,
                       int s_dt, int64_t N, int64_t K, int tiled, float *y, int nthreads);
/* internal (cpu_decode.c's batch-1 W4A8 dots): one row of x [K] quantized as hfd_int4_gemm_a8
   quantizes each row: bytes q + 128 [K] in its octet order, unit and gsum [K / group] */
void hfd_a8_quantize_row(const void *x, int x_dt, int64_t K, int64_t group, uint8_t *xq,
                         float *unit, float *gsum);
/* internal (cpu_moe.c's hfd_int4_amx): rows n0 .. n0 + rows of a 4-bit weight as bf16 */
void hfd_int4_panel_bf16(const uint8_t *packed, const void *scales, const void *mins, int s_dt,
                         int64_t group, int64_t K, int tiled, int64_t n0, int64_t rows,
                         uint16_t *out, int64_t ldo, uint8_t *tmp, float *sf, float *mf);
int hfd_gemm_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t M, int64_t N, int64_t K, int nthreads);

/* ---- cpu_moe.c: MoE experts and the AMX linears ---- */

int hfd_moe_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down,
                 const int64_t *offsets, int64_t E, int64_t H, int64_t I, uint16_t *a,
                 uint16_t *y, const float *rw, int act, int allow_amx, int nthreads);
int hfd_linear_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int64_t M, int64_t N, int64_t K, int nthreads);
int hfd_int8_amx(const void *x, int x_dt, const float *in_scale, const int8_t *q,
                 const int32_t *rowsum, const void *scales, int s_dt, const void *bias,
                 int b_dt, void *y, int64_t M, int64_t N, int64_t K, int nthreads);
int hfd_int4_amx(const uint16_t *x, int64_t M, const uint8_t *packed, const void *scales,
                 const void *mins, int s_dt, int64_t group, int64_t N, int64_t K, int tiled,
                 uint16_t *y, int nthreads);
int hfd_amx_available(void);
int hfd_amx_int8_available(void);

/* ---- cpu_experts.c: bf16 products of a few rows (decode), weights [K, N] or [N, K] ---- */

int hfd_matmul_kn_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       float *acc, int64_t M, int64_t K, int64_t N, int nthreads);
int hfd_gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                  int64_t M, int64_t N, int64_t K, int nthreads);

/* ---- cpu_quant.c: int8 GEMV, dequantization, 4-bit KV codes ---- */

/* One span of a token-major 4-bit KV cache (see hfd_attend_kv_int4). */
typedef struct {
    const uint8_t *kp, *ks, *km, *vp, *vs, *vm;
    int64_t p_stride, s_stride, tokens;
} hfd_kv_span;

int hfd_int8_gemv(const void *x, int x_dt, const float *in_scale, const int8_t *q,
                  const int32_t *rowsum, const void *scales, int s_dt, const void *bias,
                  int b_dt, void *y, int64_t M, int64_t N, int64_t K, int tiled, int nthreads);
int hfd_advise_hugepages(void *p, int64_t nbytes);
/* 1 where the int8 / int4 dot products run the 256-bit loops of hfd_avx2.h (the avx2 tier),
   2 where those loops use AVX-VNNI (avx2_vnni), 0 where they run the AVX-512 code (native or
   emulated) */
int hfd_avx2_dots(void);
int hfd_dequant_int4_rows(const uint8_t *packed, const void *scales, const void *mins, int s_dt,
                          int64_t group, int64_t K, int64_t row0, int64_t row1, void *out,
                          int o_dt, int tiled, int nthreads);
int hfd_dequant_int8_rows(const int8_t *q, const void *scales, int s_dt, const float *in_scale,
                          int64_t K, int64_t row0, int64_t row1, void *out, int o_dt, int tiled,
                          int nthreads);
int hfd_dequant_kv_int4(const uint8_t *packed, const uint8_t *scales, const uint8_t *mins,
                        int64_t p_stride, int64_t s_stride, int64_t tokens, int64_t units,
                        int64_t D, int64_t group, void *out, int o_dt, int64_t out_stride,
                        int nthreads);
int hfd_quant_kv_int4(const void *x, int x_dt, int64_t n, int64_t D, int64_t group,
                      uint8_t *packed, uint16_t *scales, uint16_t *mins, int nthreads);
int hfd_attend_kv_int4(const void *q, int q_dt, const hfd_kv_span *spans, int nspans,
                       int64_t rows, int64_t heads, int64_t kv_heads, int64_t D, int64_t group,
                       const uint8_t *keep, int64_t keep_stride, float scale, int p_dt,
                       void *out, int o_dt, int nthreads);

#endif
