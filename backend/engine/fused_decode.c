/* The fused decode steps (fused_decode.py). Not compiled alone: decode_kernel.py appends
   it to the decode-attention kernel's source and builds both into one library, so it uses
   that source's helpers (bf16_to_f32, load8_*, load16_bf16, hsum8, hsum8x8) and its
   attention tasks (task_bf16, task_f32). Everything is AVX2 + FMA only (VECTOR). */
#ifdef VECTOR
#include <omp.h>

typedef struct {
    const void* qkv_w; const void* qkv_b; const void* o_w; const void* o_b;
    const void* gate_up_w; const void* down_w; const void* in_norm; const void* post_norm;
    void* k_cache; void* v_cache;
    /* quantized models (FusedModel.quant): the matrices' scales (quant_kernels.c) */
    const float* qkv_s; const float* o_s; const float* gate_up_s; const float* down_s;
} FusedLayer;

typedef struct {
    int64_t layers, hidden, inter, heads, kv_heads, head_dim, num_blocks, block_size;
    int64_t bf16;  /* 1: weights and caches bfloat16; 0: float32 */
    float eps, scale;
    const void* embed;
    const void* final_norm;
    const FusedLayer* layer;
    /* 0: the matrices in the model dtype (bf16); 1: int8, 2: int4 (quant_kernels.c;
       norms, biases and caches stay in the model dtype) */
    int64_t quant;
    const float* embed_s;
    int64_t embed_quant;  /* the embedding's own format (int4 models keep it in int8) */
} FusedModel;

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static inline float load1(const void* p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

/* Quantized matrices (q = 1 int8, 2 int4), defined in quant_kernels.c (appended to this
   source): the dot way, and rows dequantized to float32 (scales applied). */
static void gemm_dot_q(const float* x, int64_t m0, int64_t mm, int64_t K, const void* w,
                       const float* scale, int q, const void* bias, int bf16, float* y,
                       int64_t N, int64_t r0, int64_t r1, int acc);
static void dequant_rows(const void* w, const float* scale, int q, int64_t K, int64_t r0,
                         int64_t r1, float* out);
static void dequant_tile(const void* w, int q, int64_t K, int64_t t0, int64_t t1,
                         uint16_t* wt);
static void quant_tile_pass(const float* xp, int64_t K, const uint16_t* wt,
                            const float* scale, int q, int64_t t0, int64_t t1, float* out);

/* This thread's share [lo, hi) of n items, in multiples of `align`. */
static inline void share(int64_t n, int64_t align, int64_t* lo, int64_t* hi) {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t units = (n + align - 1) / align;
    *lo = units * t / nt * align;
    *hi = units * (t + 1) / nt * align;
    if (*hi > n) *hi = n;
    if (*lo > n) *lo = n;
}

/* y[m * ldy + r] (+)= sum_{k < K} x[m * ld + k] * w[r * ld + k] (+ bias[r]) for r in
   [r0, r1), m < M (compile-time). One row of w at a time, read once for all M inputs, with U
   independent accumulators per input. Measured on the bench model's 33 weights (bf16,
   2 threads): one row at a time streams 45-50 GB/s; 8 rows at once (8 interleaved
   streams) only 17 GB/s. K % 8 == 0. */
#define DEFINE_GEMM(NAME, T, LOAD8, LOAD1)                                              \
static inline __attribute__((always_inline)) void NAME(                                 \
        const float* x, int64_t ld, int64_t K, const T* w, const T* bias, float* y,     \
        int64_t ldy, int64_t r0, int64_t r1, int acc, const int64_t M) {                \
    const int64_t U = M == 1 ? 4 : M <= 4 ? 2 : 1;                                      \
    for (int64_t r = r0; r < r1; r++) {                                                 \
        const T* wr = w + r * ld;                                                       \
        __m256 a[8];                                                                    \
        for (int64_t i = 0; i < U * M; i++) a[i] = _mm256_setzero_ps();                 \
        int64_t k = 0;                                                                  \
        for (; k + 8 * U <= K; k += 8 * U) {                                            \
            __builtin_prefetch((const char*)(wr + k) + 256);                            \
            for (int64_t u = 0; u < U; u++) {                                           \
                const __m256 wv = LOAD8(wr + k + 8 * u);                                \
                for (int64_t m = 0; m < M; m++)                                         \
                    a[u * M + m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ld + k + 8 * u), \
                                                   a[u * M + m]);                       \
            }                                                                           \
        }                                                                               \
        for (; k < K; k += 8) {                                                         \
            const __m256 wv = LOAD8(wr + k);                                            \
            for (int64_t m = 0; m < M; m++)                                             \
                a[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ld + k), a[m]);      \
        }                                                                               \
        float v[8];                                                                     \
        if (M == 8) {  /* U == 1: the 8 sums at once */                                 \
            _mm256_storeu_ps(v, hsum8x8(a));                                            \
        } else {                                                                        \
            for (int64_t m = 0; m < M; m++) {                                           \
                __m256 sum = a[m];                                                      \
                for (int64_t u = 1; u < U; u++) sum = _mm256_add_ps(sum, a[u * M + m]); \
                v[m] = hsum8(sum);                                                      \
            }                                                                           \
        }                                                                               \
        const float b = bias ? LOAD1(bias[r]) : 0.f;                                    \
        for (int64_t m = 0; m < M; m++) {                                               \
            float* dst = y + m * ldy + r;                                               \
            *dst = acc ? *dst + (v[m] + b) : v[m] + b;                                  \
        }                                                                               \
    }                                                                                   \
}

DEFINE_GEMM(gemm_rows_f32, float, load8_f32, LOAD_F32)
DEFINE_GEMM(gemm_rows_bf16, uint16_t, load8_bf16, bf16_to_f32)

/* dst[i * ldd + j] = src[j][i] for i, j < 8: eight rows of 8 floats become 8 columns. */
static inline void transpose8x8(const float* const src[8], float* dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(src[j]);
    for (int j = 0; j < 8; j += 2) {
        t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
        t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    r[0] = _mm256_shuffle_ps(t[0], t[2], 0x44); r[1] = _mm256_shuffle_ps(t[0], t[2], 0xEE);
    r[2] = _mm256_shuffle_ps(t[1], t[3], 0x44); r[3] = _mm256_shuffle_ps(t[1], t[3], 0xEE);
    r[4] = _mm256_shuffle_ps(t[4], t[6], 0x44); r[5] = _mm256_shuffle_ps(t[4], t[6], 0xEE);
    r[6] = _mm256_shuffle_ps(t[5], t[7], 0x44); r[7] = _mm256_shuffle_ps(t[5], t[7], 0xEE);
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* The 6 x 16 micro-kernel of the wide matmuls: out[i * 16 + m] = sum_k w[i][k] xT[k][m]
   for 6 weight rows (row stride rs bytes) and 16 inputs (xT [K][16], 32-byte aligned).
   Twelve accumulators, two input vectors and one broadcast weight fill the 16 ymm
   registers; written in assembly because GCC merges the two broadcasts of a bf16 pair
   into one kept register and spills (39 against 90 GFLOP/s on one core, L1-resident).
   A bf16 pair (w[k], w[k+1]) is one 32-bit broadcast: << 16 gives w[k] as fp32, & the
   high half gives w[k+1]. Each step also prefetches the next 6-row block (the block is
   6 K elements, read 24 bytes per step): without it the rows stream from DRAM at a
   quarter of the compute rate (140 against 169 GFLOP/s over the bench model's matmuls). */
static const uint32_t HIGH_HALF[8] __attribute__((aligned(32))) = {
    0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u,
    0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u, 0xFFFF0000u};
#define K6_ZERO "vxorps %%ymm0, %%ymm0, %%ymm0\n\t vxorps %%ymm1, %%ymm1, %%ymm1\n\t"          \
    "vxorps %%ymm2, %%ymm2, %%ymm2\n\t vxorps %%ymm3, %%ymm3, %%ymm3\n\t"                    \
    "vxorps %%ymm4, %%ymm4, %%ymm4\n\t vxorps %%ymm5, %%ymm5, %%ymm5\n\t"                    \
    "vxorps %%ymm6, %%ymm6, %%ymm6\n\t vxorps %%ymm7, %%ymm7, %%ymm7\n\t"                    \
    "vxorps %%ymm8, %%ymm8, %%ymm8\n\t vxorps %%ymm9, %%ymm9, %%ymm9\n\t"                    \
    "vxorps %%ymm10, %%ymm10, %%ymm10\n\t vxorps %%ymm11, %%ymm11, %%ymm11\n\t"
#define K6_STORE "vmovaps %%ymm0, (%[out])\n\t vmovaps %%ymm1, 32(%[out])\n\t"                 \
    "vmovaps %%ymm2, 64(%[out])\n\t vmovaps %%ymm3, 96(%[out])\n\t"                           \
    "vmovaps %%ymm4, 128(%[out])\n\t vmovaps %%ymm5, 160(%[out])\n\t"                         \
    "vmovaps %%ymm6, 192(%[out])\n\t vmovaps %%ymm7, 224(%[out])\n\t"                         \
    "vmovaps %%ymm8, 256(%[out])\n\t vmovaps %%ymm9, 288(%[out])\n\t"                         \
    "vmovaps %%ymm10, 320(%[out])\n\t vmovaps %%ymm11, 352(%[out])\n\t"
/* one weight row: broadcast (CONVERT), then into its two accumulators */
#define K6_ROW(LOAD, CONVERT, ADDR, A0, A1) LOAD " " ADDR ", %%ymm14\n\t" CONVERT             \
    "vfmadd231ps %%ymm12, %%ymm14, %%ymm" A0 "\n\t vfmadd231ps %%ymm13, %%ymm14, %%ymm" A1 "\n\t"
#define K6_ROWS(LOAD, CONVERT)                                                          \
    K6_ROW(LOAD, CONVERT, "(%[w])", "0", "1")                                           \
    K6_ROW(LOAD, CONVERT, "(%[w],%[rs],1)", "2", "3")                                   \
    K6_ROW(LOAD, CONVERT, "(%[w],%[rs],2)", "4", "5")                                   \
    K6_ROW(LOAD, CONVERT, "(%[w3])", "6", "7")                                          \
    K6_ROW(LOAD, CONVERT, "(%[w3],%[rs],1)", "8", "9")                                  \
    K6_ROW(LOAD, CONVERT, "(%[w3],%[rs],2)", "10", "11")
/* End of a step: prefetch 24 bytes on into the next block (6 rows x 4 bytes a step), the
   inputs XBYTES on, each row 4 bytes on; loop. */
#define K6_NEXT(XBYTES) "prefetcht0 (%[pf])\n\t add $24, %[pf]\n\t"                      \
    "add $" XBYTES ", %[x]\n\t add $4, %[w]\n\t add $4, %[w3]\n\t"                          \
    "dec %[steps]\n\t jnz 1b\n\t"
#define K6_OUTPUTS [x] "+r"(xT), [w] "+r"(w), [w3] "+r"(w3), [steps] "+r"(steps), [pf] "+r"(pf)
#define K6_CLOBBERS "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6",  \
    "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"

static inline void k6x16_bf16(const float* xT, int64_t K, const uint16_t* w, float* out) {
    const int64_t rs = 2 * K;
    int64_t steps = K / 2;
    const uint16_t* w3 = w + 3 * K;
    const char* pf = (const char*)(w + 6 * K);
    __asm__ volatile(
        K6_ZERO
        "vmovaps (%[mask]), %%ymm15\n\t"
        "1:\n\t"
        "vmovaps (%[x]), %%ymm12\n\t vmovaps 32(%[x]), %%ymm13\n\t"
        K6_ROWS("vpbroadcastd", "vpslld $16, %%ymm14, %%ymm14\n\t")
        "vmovaps 64(%[x]), %%ymm12\n\t vmovaps 96(%[x]), %%ymm13\n\t"
        K6_ROWS("vpbroadcastd", "vpand %%ymm15, %%ymm14, %%ymm14\n\t")
        K6_NEXT("128")
        K6_STORE
        : K6_OUTPUTS
        : [rs] "r"(rs), [out] "r"(out), [mask] "r"(HIGH_HALF)
        : K6_CLOBBERS);
}

static inline void k6x16_f32(const float* xT, int64_t K, const float* w, float* out) {
    const int64_t rs = 4 * K;
    int64_t steps = K;
    const float* w3 = w + 3 * K;
    const char* pf = (const char*)(w + 6 * K);
    __asm__ volatile(
        K6_ZERO
        "1:\n\t"
        "vmovaps (%[x]), %%ymm12\n\t vmovaps 32(%[x]), %%ymm13\n\t"
        K6_ROWS("vbroadcastss", "")
        K6_NEXT("64")
        K6_STORE
        : K6_OUTPUTS
        : [rs] "r"(rs), [out] "r"(out)
        : K6_CLOBBERS);
}

static const float ZEROS8[8] = {0.f};

/* Rows [r0, r1) of y (+)= x w^T (+ bias) for inputs [m0, m0 + mm), the dot-product way:
   up to 8 inputs share one pass over the weight rows. More inputs go 8 at a time over
   tiles of 128 weight rows, and K in chunks of 512, so that a tile read once from memory
   stays in L2 and the 8 inputs' chunk (16 KB) in L1 across the passes. */
/* CASE(M) for M = min(n, 8), M a compile-time constant (the kernels specialise on it). */
#define ROWS_1_TO_8(n, CASE)                                                            \
    switch ((n) < 8 ? (n) : 8) {                                                        \
    case 1: { CASE(1) break; }                                                          \
    case 2: { CASE(2) break; }                                                          \
    case 3: { CASE(3) break; }                                                          \
    case 4: { CASE(4) break; }                                                          \
    case 5: { CASE(5) break; }                                                          \
    case 6: { CASE(6) break; }                                                          \
    case 7: { CASE(7) break; }                                                          \
    default: { CASE(8) break; }                                                         \
    }

static void gemm_dot(const float* x, int64_t m0, int64_t mm, int64_t K, const void* w,
                     const void* bias, float* y, int64_t N, int64_t r0, int64_t r1, int acc,
                     int bf16) {
    const int64_t tile = mm <= 8 ? r1 - r0 : 128, kc = mm <= 8 ? K : 512;
#define GEMM_CASE(MM)                                                                   \
    if (bf16) gemm_rows_bf16(xm, K, kl, (const uint16_t*)w + k0,                        \
                             k0 ? NULL : (const uint16_t*)bias, ym, N, t0, t1,          \
                             acc || k0, MM);                                            \
    else gemm_rows_f32(xm, K, kl, (const float*)w + k0, k0 ? NULL : (const float*)bias, \
                       ym, N, t0, t1, acc || k0, MM);
    for (int64_t t0 = r0; t0 < r1; t0 += tile) {
        const int64_t t1 = t0 + tile < r1 ? t0 + tile : r1;
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            const int64_t kl = K - k0 < kc ? K - k0 : kc;
            for (int64_t i = m0; i < m0 + mm; i += 8) {
                const float* xm = x + i * K + k0;
                float* ym = y + i * N;
                ROWS_1_TO_8(m0 + mm - i, GEMM_CASE)
            }
        }
    }
#undef GEMM_CASE
}

/* Inputs at which a pass of 16 pays (padded with zero inputs): below, the dot kernel. On
   the bench model (2 threads) 16 inputs take 7.6 ms in one wide pass against 10.6 ms the
   dot way, 12 inputs 7.6 against 8.7, 8 inputs 7.6 against 7.3. */
#define WIDE_MIN 10
/* The same for quantized weights (quant_kernels.c), whose wide way first converts each tile:
   the dot way, converting in registers, stays ahead to more inputs. One step's matrices of
   the bench model, int8, in bf16's time (`python -m backend.bench.quant --matmul-rows
   16,24,32,48` with this at 10, 32 and 64): 16 inputs 1.33x wide, 1.17x the dot way; 24:
   1.07x the dot way; 32: 1.17x wide, 1.19-1.24x the dot way; 48: 1.11x wide, 1.29x. */
#define QWIDE_MIN 32
#define WIDE_TILE 96  /* weight rows per tile: 16 blocks of 6, 8-row aligned for the transposes */

/* The calling thread's share of y (+)= x w^T (+ bias), x [n, K], w [N, K]. No barrier.
   Fewer than WIDE_MIN inputs: the dot kernel (reading each weight once, the step is
   memory-bound). More: inputs 16 at a time through the 6 x 16 micro-kernel, over tiles of
   96 weight rows (a tile stays in L2 for the next 16), from xT, this thread's copy of x
   transposed per 16 inputs ([passes][K][16], zero-padded; K * 16 * ceil(n / 16) floats);
   the outputs come back transposed through 8 x 8 blocks. Leftover inputs (n % 16 <
   WIDE_MIN) and the share's last rows (< 24) go the dot way.
   Quantized w (q = 1 int8, 2 int4; see quant_kernels.c): bf16 is the bias's dtype; the dot
   way dequantizes in registers, the wide way turns each tile of 96 rows once into exact
   bf16 integers in wt (this thread's, at least WIDE_TILE * K / 2 floats) for the bf16
   micro-kernel, and applies the scales to its sums. */
static void gemm_share(const float* x, int64_t n, int64_t K, const void* w, const void* bias,
                       float* y, int64_t N, int acc, int bf16, float* xT, const float* scale,
                       int q, float* wt) {
    int64_t r0, r1;
    /* The split depends on n and K alone, never on xT: a thread whose scratch could not be
       allocated still takes the rows the others leave it (the dot way). */
    const int wide = n >= (q ? QWIDE_MIN : WIDE_MIN) && K > 0;
    share(N, wide ? 24 : 8, &r0, &r1);
    if (r0 >= r1) return;
#define GEMM_DOT(M0, MM, R0, R1)                                                        \
    if (q) gemm_dot_q(x, M0, MM, K, w, scale, q, bias, bf16, y, N, R0, R1, acc);        \
    else gemm_dot(x, M0, MM, K, w, bias, y, N, R0, R1, acc, bf16);
    if (!wide || xT == NULL || (q && wt == NULL)) {
        GEMM_DOT(0, n, r0, r1)
        return;
    }
    const int64_t rend = r0 + (r1 - r0) / 24 * 24;
    const int64_t passes = n % 16 >= WIDE_MIN ? (n + 15) / 16 : n / 16;
    const int64_t done = passes * 16 < n ? passes * 16 : n;  /* inputs done wide */
    for (int64_t p = 0; p < passes; p++)
        for (int64_t half = 0; half < 16; half += 8)
            for (int64_t k = 0; k < K; k += 8) {
                const float* src[8];
                for (int j = 0; j < 8; j++) {
                    const int64_t m = p * 16 + half + j;
                    src[j] = m < n ? x + m * K + k : ZEROS8;
                }
                transpose8x8(src, xT + (p * K + k) * 16 + half, 16);
            }
    float out[WIDE_TILE * 16] __attribute__((aligned(32)));
    for (int64_t t0 = r0; t0 < rend; t0 += WIDE_TILE) {
        const int64_t t1 = t0 + WIDE_TILE < rend ? t0 + WIDE_TILE : rend;
        if (q) dequant_tile(w, q, K, t0, t1, (uint16_t*)wt);
        for (int64_t p = 0; p < passes; p++) {
            const float* xp = xT + p * K * 16;
            if (q) quant_tile_pass(xp, K, (const uint16_t*)wt, scale, q, t0, t1, out);
            else for (int64_t r = t0; r < t1; r += 6) {
                if (bf16) k6x16_bf16(xp, K, (const uint16_t*)w + r * K, out + (r - t0) * 16);
                else k6x16_f32(xp, K, (const float*)w + r * K, out + (r - t0) * 16);
            }
            const int64_t nn = n - p * 16 < 16 ? n - p * 16 : 16;
            for (int64_t r = t0; r < t1; r += 8) {
                const __m256 b = bias == NULL ? _mm256_setzero_ps()
                    : bf16 ? load8_bf16((const uint16_t*)bias + r) : load8_f32((const float*)bias + r);
                for (int64_t half = 0; half < nn; half += 8) {
                    const float* src[8];
                    float blk[64];
                    for (int j = 0; j < 8; j++) src[j] = out + (r - t0 + j) * 16 + half;
                    transpose8x8(src, blk, 8);
                    for (int64_t m = half; m < nn && m < half + 8; m++) {
                        float* dst = y + (p * 16 + m) * N + r;
                        __m256 v = _mm256_add_ps(_mm256_loadu_ps(blk + (m - half) * 8), b);
                        if (acc) v = _mm256_add_ps(v, _mm256_loadu_ps(dst));
                        _mm256_storeu_ps(dst, v);
                    }
                }
            }
        }
    }
    if (done < n) { GEMM_DOT(done, n - done, r0, rend) }
    if (rend < r1) { GEMM_DOT(0, n, rend, r1) }
#undef GEMM_DOT
}

/* Floats of xT for gemm_share: n inputs, K up to max_k. */
static int64_t wide_scratch_floats(int64_t n, int64_t max_k) {
    return n < WIDE_MIN ? 0 : (n + 15) / 16 * 16 * max_k;
}

/* RMSNorm of the rows of h [n, E] this thread owns (m = tid, tid + nt, ...) into x. */
static void norm_rows(const float* h, float* x, int64_t n, int64_t E, const void* w,
                      float eps, int bf16) {
    const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    for (int64_t m = t; m < n; m += nt) {
        const float* hm = h + m * E;
        float* xm = x + m * E;
        float ss = 0.f;
        for (int64_t e = 0; e < E; e++) ss += hm[e] * hm[e];
        const float r = 1.f / sqrtf(ss / (float)E + eps);
        for (int64_t e = 0; e < E; e++) xm[e] = hm[e] * r * load1(w, e, bf16);
    }
}

/* Rotary on the q and k heads of this thread's rows of qkv [n, QKV] (in place), then
   their k and v into the layer's paged cache (rounded to its dtype). tmp: D floats. */
static void rope_write_rows(const FusedModel* M, const FusedLayer* L, float* qkv, int64_t n,
                            const float* cos, const float* sin, const int64_t* tables,
                            int64_t width, const int64_t* ctx, float* tmp) {
    const int64_t H = M->heads, KVH = M->kv_heads, D = M->head_dim, bs = M->block_size,
                  nb = M->num_blocks, QKV = (H + 2 * KVH) * D;
    const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
    for (int64_t m = tid; m < n; m += nt) {
        float* row = qkv + m * QKV;
        const float* c = cos + m * D;
        const float* sn = sin + m * D;
        const int64_t half = D / 2;
        for (int64_t hh = 0; hh < H + KVH; hh++) {  /* two halves: loops that vectorize */
            float* v = row + hh * D;
            for (int64_t d = 0; d < half; d++) tmp[d] = v[d] * c[d] + v[d + half] * sn[d];
            for (int64_t d = half; d < D; d++) tmp[d] = v[d] * c[d] + v[d - half] * sn[d];
            memcpy(v, tmp, sizeof(float) * D);
        }
        const int64_t pos = ctx[m] - 1;
        const int64_t slot = tables[m * width + pos / bs] * bs + pos % bs;
        for (int64_t j = 0; j < KVH; j++) {
            const float* kv_k = row + (H + j) * D;
            const float* kv_v = row + (H + KVH + j) * D;
            const int64_t at = (j * nb * bs + slot) * D;
            if (M->bf16) {
                uint16_t* kc = (uint16_t*)L->k_cache + at;
                uint16_t* vc = (uint16_t*)L->v_cache + at;
                for (int64_t d = 0; d < D; d++) {
                    kc[d] = f32_to_bf16(kv_k[d]);
                    vc[d] = f32_to_bf16(kv_v[d]);
                }
            } else {
                memcpy((float*)L->k_cache + at, kv_k, sizeof(float) * D);
                memcpy((float*)L->v_cache + at, kv_v, sizeof(float) * D);
            }
        }
    }
}

/* Decode attention of the n rows of qkv (keys already in the cache) into att [n, H D]:
   one task per (row, KV head), shared out dynamically; ends with a barrier. s: G * max
   context floats, acc: G * D floats, both the calling thread's. */
static void attend_rows(const FusedModel* M, const FusedLayer* L, const float* qkv, int64_t n,
                        const int64_t* tables, int64_t width, const int64_t* ctx, float* att,
                        float* s, float* acc) {
    const int64_t H = M->heads, KVH = M->kv_heads, D = M->head_dim, G = H / KVH,
                  bs = M->block_size, nb = M->num_blocks, QKV = (H + 2 * KVH) * D;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * KVH; task++) {
        const int64_t b = task / KVH, j = task % KVH;
        const float* qb = qkv + b * QKV + j * G * D;
        const int64_t* table = tables + b * width;
        memset(acc, 0, sizeof(float) * G * D);
#define ATTEND(TASK, T, GG) TASK(qb, (const T*)L->k_cache, (const T*)L->v_cache, table, \
                                 ctx[b], j, nb, bs, D, M->scale, s, acc, GG)
#define ATTEND_G(TASK, T) switch (G) {                                                  \
        case 1: ATTEND(TASK, T, 1); break;                                              \
        case 2: ATTEND(TASK, T, 2); break;                                              \
        case 4: ATTEND(TASK, T, 4); break;                                              \
        default: ATTEND(TASK, T, 8); break;                                             \
        }
        if (M->bf16) { ATTEND_G(task_bf16, uint16_t) } else { ATTEND_G(task_f32, float) }
#undef ATTEND_G
#undef ATTEND
        memcpy(att + b * H * D + j * G * D, acc, sizeof(float) * G * D);
    }
}

/* act [n, I] = silu(gu[:, :I]) * gu[:, I:], this thread's share. */
static void silu_mul_share(const float* gu, float* act, int64_t n, int64_t I) {
    int64_t lo, hi;
    share(n * I, 8, &lo, &hi);
    for (int64_t i = lo; i < hi;) {  /* row by row, so the inner loop vectorizes */
        const int64_t m = i / I, c0 = i % I, c1 = hi - m * I < I ? hi - m * I : I;
        const float* g = gu + m * 2 * I;
        const float* u = g + I;
        float* a = act + m * I;
        for (int64_t c = c0; c < c1; c++) a[c] = g[c] / (1.f + expf(-g[c])) * u[c];
        i = m * I + c1;
    }
}

/* This thread's xT for gemm_share (NULL when n needs none), 64-byte aligned. */
static float* wide_scratch(int64_t n, int64_t max_k) {
    const int64_t floats = wide_scratch_floats(n, max_k);
    return floats ? (float*)aligned_alloc(64, (size_t)(floats * 4 + 63) / 64 * 64) : NULL;
}

/* This thread's wt for gemm_share on quantized weights (NULL when n needs none). */
static float* tile_scratch(int64_t n, int64_t max_k) {
    return n < WIDE_MIN ? NULL : (float*)aligned_alloc(64, (size_t)(WIDE_TILE * max_k * 4 + 63)
                                                              / 64 * 64);
}

static float* attention_scratch(const FusedModel* M, int64_t width) {
    const int64_t G = M->heads / M->kv_heads, D = M->head_dim;
    return (float*)malloc(sizeof(float) * (G * width * M->block_size + G * D + D));
}

/* One decode step of n sequences through every layer. ids [n]; cos, sin [n, D]
   (sin already signed: rotate(x)[d] = x[d] cos[d] + x[(d + D/2) % D] sin[d]); tables
   [n, width] and ctx [n] as the decode kernel takes them (the new token is at position
   ctx - 1). out [n, E] gets the final-normed hidden states; scratch holds
   n * (2E + (H + 2KVH) D + H D + 3I) floats. */
void fused_forward(const FusedModel* M, int64_t n, const int64_t* ids, const float* cos,
                   const float* sin, const int64_t* tables, int64_t width,
                   const int64_t* ctx, float* out, float* scratch, int nthreads) {
    const int64_t E = M->hidden, I = M->inter, H = M->heads, KVH = M->kv_heads,
                  D = M->head_dim, G = H / KVH;
    const int64_t QKV = (H + 2 * KVH) * D, bf16 = M->bf16;
    float* h = scratch;            /* [n, E] residual stream */
    float* x = h + n * E;          /* [n, E] normed */
    float* qkv = x + n * E;        /* [n, QKV] */
    float* att = qkv + n * QKV;    /* [n, H D] */
    float* gu = att + n * H * D;   /* [n, 2 I] */
    float* act = gu + n * 2 * I;   /* [n, I] */
    #pragma omp parallel num_threads(nthreads)
    {
        float* s = attention_scratch(M, width);
        float* acc = s + G * width * M->block_size;
        float* tmp = acc + G * D;
        const int64_t max_k = E > H * D ? (E > I ? E : I) : (H * D > I ? H * D : I);
        float* xT = wide_scratch(n, max_k);
        const int q = (int)M->quant;
        float* wt = q ? tile_scratch(n, max_k) : NULL;
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        for (int64_t m = tid; m < n; m += nt) {
            if (M->embed_quant)
                dequant_rows(M->embed, M->embed_s, (int)M->embed_quant, E, ids[m], ids[m] + 1,
                             h + m * E);
            else for (int64_t e = 0; e < E; e++) h[m * E + e] = load1(M->embed, ids[m] * E + e, bf16);
        }
        #pragma omp barrier
        for (int64_t l = 0; l < M->layers; l++) {
            const FusedLayer* L = M->layer + l;
            norm_rows(h, x, n, E, L->in_norm, M->eps, bf16);
            #pragma omp barrier
            gemm_share(x, n, E, L->qkv_w, L->qkv_b, qkv, QKV, 0, bf16, xT, L->qkv_s, q, wt);
            #pragma omp barrier
            rope_write_rows(M, L, qkv, n, cos, sin, tables, width, ctx, tmp);
            #pragma omp barrier
            attend_rows(M, L, qkv, n, tables, width, ctx, att, s, acc);
            gemm_share(att, n, H * D, L->o_w, L->o_b, h, E, 1, bf16, xT, L->o_s, q, wt);
            #pragma omp barrier
            norm_rows(h, x, n, E, L->post_norm, M->eps, bf16);
            #pragma omp barrier
            gemm_share(x, n, E, L->gate_up_w, NULL, gu, 2 * I, 0, bf16, xT, L->gate_up_s, q, wt);
            #pragma omp barrier
            silu_mul_share(gu, act, n, I);
            #pragma omp barrier
            gemm_share(act, n, I, L->down_w, NULL, h, E, 1, bf16, xT, L->down_s, q, wt);
            #pragma omp barrier
        }
        norm_rows(h, out, n, E, M->final_norm, M->eps, bf16);
        free(wt);
        free(xT);
        free(s);
    }
}

/* y [n, N] = x [n, K] w^T (+ bias): the LM head of a fused step. wide = 0 keeps every
   row count on the dot kernel (the matmul bench's side-by-side). */
void fused_linear(const float* x, int64_t n, int64_t K, const void* w, const void* bias,
                  float* y, int64_t N, int64_t bf16, int64_t wide, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float* xT = wide ? wide_scratch(n, K) : NULL;
        gemm_share(x, n, K, w, bias, y, N, 0, (int)bf16, xT, NULL, 0, NULL);
        free(xT);
    }
}

/* y [n, N] = x [n, K] w^T (+ bias) for a quantized w (q = 1 int8, 2 int4, with its scale;
   quant_kernels.c), bias in the model dtype (bias_bf16), any n: the quantized model's
   matmuls outside the fused steps (prefill chunks, steps of many rows, the LM head). */
void fused_linear_q(const float* x, int64_t n, int64_t K, const void* w, const float* scale,
                    int64_t q, const void* bias, int64_t bias_bf16, float* y, int64_t N,
                    int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        float* xT = wide_scratch(n, K);
        float* wt = tile_scratch(n, K);
        gemm_share(x, n, K, w, bias, y, N, 0, (int)bias_bf16, xT, scale, (int)q, wt);
        free(wt);
        free(xT);
    }
}

/* out [r1 - r0][K] = rows [r0, r1) of a quantized w (q = 1 int8, 2 int4) in float32, the
   rows shared between the threads: a tile for oneDNN to multiply (QuantizedMatmul). */
void dequant_matrix(const void* w, const float* scale, int64_t q, int64_t K, int64_t r0,
                    int64_t r1, float* out, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t lo, hi;
        share(r1 - r0, 8, &lo, &hi);
        if (lo < hi) dequant_rows(w, scale, (int)q, K, r0 + lo, r0 + hi, out + lo * K);
    }
}

/* Larger decode steps run their matmuls in oneDNN; these are the pieces between them. */

/* Layer `layer`: rotary on qkv [n, QKV] (in place), K/V into the cache, attention into
   att [n, H D]. */
void fused_rope_attend(const FusedModel* M, int64_t layer, float* qkv, int64_t n,
                       const float* cos, const float* sin, const int64_t* tables,
                       int64_t width, const int64_t* ctx, float* att, int nthreads) {
    const FusedLayer* L = M->layer + layer;
    const int64_t G = M->heads / M->kv_heads, D = M->head_dim;
    #pragma omp parallel num_threads(nthreads)
    {
        float* s = attention_scratch(M, width);
        float* acc = s + G * width * M->block_size;
        rope_write_rows(M, L, qkv, n, cos, sin, tables, width, ctx, acc + G * D);
        #pragma omp barrier
        attend_rows(M, L, qkv, n, tables, width, ctx, att, s, acc);
        free(s);
    }
}

/* h [n, E] += delta (unless NULL); out = rmsnorm(h) * w. */
void fused_add_norm(float* h, const float* delta, int64_t n, int64_t E, const void* w,
                    float eps, int64_t bf16, float* out, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    {
        if (delta) {
            int64_t lo, hi;
            share(n * E, 8, &lo, &hi);
            for (int64_t i = lo; i < hi; i++) h[i] += delta[i];
            #pragma omp barrier
        }
        norm_rows(h, out, n, E, w, eps, (int)bf16);
    }
}

/* act [n, I] = silu(gu[:, :I]) * gu[:, I:]. */
void fused_silu_mul(const float* gu, int64_t n, int64_t I, float* act, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    silu_mul_share(gu, act, n, I);
}

/* out[m] = the first index of the largest of x[m, :V] (greedy sampling; torch's argmax
   over a [32, 32000] batch takes ~1 ms on this CPU, one scalar pass per row), or -1 for a
   row holding a NaN (torch picks the first NaN; those rows go back to it). */
void argmax_rows(const float* x, int64_t n, int64_t V, int64_t* out, int nthreads) {
    #pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t m = 0; m < n; m++) {
        const float* r = x + m * V;
        __m256 best = _mm256_set1_ps(-INFINITY);
        /* NaNs are found on the bits (-ffast-math may fold float NaN tests away) */
        const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
        const __m256i inf_bits = _mm256_set1_epi32(0x7f800000);
        __m256i nan = _mm256_setzero_si256();
        int64_t v = 0;
        for (; v + 8 <= V; v += 8) {
            const __m256 xv = _mm256_loadu_ps(r + v);
            best = _mm256_max_ps(best, xv);
            nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(
                _mm256_and_si256(_mm256_castps_si256(xv), abs_mask), inf_bits));
        }
        int has_nan = !_mm256_testz_si256(nan, nan);
        float mx = -INFINITY, lanes[8];
        _mm256_storeu_ps(lanes, best);
        for (int k = 0; k < 8; k++) mx = lanes[k] > mx ? lanes[k] : mx;
        for (; v < V; v++) {
            uint32_t bits;
            memcpy(&bits, r + v, 4);
            has_nan |= (bits & 0x7fffffffu) > 0x7f800000u;
            mx = r[v] > mx ? r[v] : mx;
        }
        if (has_nan) { out[m] = -1; continue; }
        /* the first index holding it: 8 lanes compared at a time */
        const __m256 target = _mm256_set1_ps(mx);
        int64_t at = 0;
        for (; at + 8 <= V; at += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + at), target,
                                                             _CMP_EQ_OQ));
            if (hit) { at += __builtin_ctz((unsigned)hit); break; }
        }
        if (at + 8 > V || r[at] != mx)
            while (at < V && r[at] != mx) at++;
        out[m] = at < V ? at : -1;
    }
}

int fused_available(void) { return 1; }
#endif
