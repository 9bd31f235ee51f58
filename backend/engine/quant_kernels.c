/* Matmuls with quantized weights (quant.py has the formats), for fused_decode.c's
   gemm_share. Appended after fused_decode.c, which declares gemm_dot_q and dequant_rows.

   int8 (q = 1): w [N][K] int8, scale [N]: w[r][k] = w8[r][k] * scale[r]. The row scale
   is applied once, to the finished dot product.
   int4 (q = 2): w [N][K / 2] bytes, in chunks of 16 weights per 8 bytes (byte j: weight j
   in the low nibble, j + 8 in the high one; the value is nibble - 8), scale [N][G] with
   G = ceil(K / 128): one per group of 128 along K. K % 16 == 0.

   Few inputs (the dot way): one weight row at a time, as gemm_rows_*: the quantized bytes
   are widened to float32 in registers (int4: the group's scale applied there too) and
   never written anywhere, so a step streams a quarter (int8: half) of a bf16 model's bytes.
   Many inputs: gemm_share turns each tile of 96 rows once into bf16 (dequant_tile: the
   quantized integers, which bf16 holds exactly), the bf16 micro-kernel multiplies it one
   scale group at a time (int8: the whole row), and the group's sums are scaled into the
   outputs (quant_tile_pass). The scales thus apply as in the dot way, after the products,
   and the micro-kernel reads half the bytes a float32 tile would need. Where the compiler
   targets AVX-512 BF16, the conversion to bf16 is one instruction per 16 weights.
   From DEQUANT_MIN_ROWS rows (fused_decode.py) dequant_matrix feeds oneDNN instead. */
#ifdef VECTOR
#define QGROUP 128

/* 8 int8 weights as float32 */
static inline __m256 load8_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* A chunk of 16 int4 weights (8 bytes): weights 0..7 and 8..15 as float32 (-8..7). */
static inline void load16_i4(const uint8_t* p, __m256* lo, __m256* hi) {
    const __m128i b = _mm_loadl_epi64((const __m128i*)p);
    const __m128i mask = _mm_set1_epi8(0x0F), eight = _mm_set1_epi8(8);
    /* both halves in one register: low nibbles in bytes 0..7, high ones in 8..15 */
    const __m128i v = _mm_sub_epi8(_mm_and_si128(_mm_unpacklo_epi64(b, _mm_srli_epi16(b, 4)),
                                                 mask), eight);
    *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

/* The M (compile-time) sums v[m] of one row as gemm_rows_* leaves them: U partial
   accumulators per input. */
static inline void reduce_rows(__m256* a, int64_t U, int64_t M, float* v) {
    if (M == 8 && U == 1) {
        _mm256_storeu_ps(v, hsum8x8(a));
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        __m256 sum = a[m];
        for (int64_t u = 1; u < U; u++) sum = _mm256_add_ps(sum, a[u * M + m]);
        v[m] = hsum8(sum);
    }
}

static inline void store_rows(float* y, int64_t ldy, int64_t r, const float* v, float s,
                              float b, int acc, int64_t M) {
    for (int64_t m = 0; m < M; m++) {
        float* dst = y + m * ldy + r;
        *dst = acc ? *dst + (v[m] * s + b) : v[m] * s + b;
    }
}

#ifdef __AVX512F__
/* One input, one int8 row: 64 weights a step in 512-bit registers, where the CPU has them
   (the same ops as the AVX2 loop, half the instructions: the loop is instruction-bound). */
static inline float dot_i8_512(const int8_t* w, const float* x, int64_t K) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __builtin_prefetch(w + k + 512);
        for (int u = 0; u < 4; u++) {
            const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i*)(w + k + 16 * u))));
            a[u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + k + 16 * u), a[u]);
        }
    }
    __m256 t = _mm256_setzero_ps();
    for (; k < K; k += 8) t = _mm256_fmadd_ps(load8_i8(w + k), _mm256_loadu_ps(x + k), t);
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]),
                                              _mm512_add_ps(a[2], a[3]))) + hsum8(t);
}
#endif

/* Rows [r0, r1) of y (+)= x w^T (+ bias) for M inputs x [M][K], int8 w. */
static inline __attribute__((always_inline)) void gemm_rows_i8(
        const float* x, int64_t K, const int8_t* w, const float* scale, const void* bias,
        int bf16, float* y, int64_t ldy, int64_t r0, int64_t r1, int acc, const int64_t M) {
    /* one input: 64 weights (a cache line) a step, 8 accumulators */
    const int64_t U = M == 1 ? 8 : M <= 4 ? 2 : 1;
#ifdef __AVX512F__
    if (M == 1) {
        for (int64_t r = r0; r < r1; r++) {
            const float v = dot_i8_512(w + r * K, x, K);
            store_rows(y, ldy, r, &v, scale[r], bias ? load1(bias, r, bf16) : 0.f, acc, 1);
        }
        return;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        const int8_t* wr = w + r * K;
        __m256 a[8];
        for (int64_t i = 0; i < U * M; i++) a[i] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 * U <= K; k += 8 * U) {
            __builtin_prefetch(wr + k + 512);
            for (int64_t u = 0; u < U; u++) {
                const __m256 wv = load8_i8(wr + k + 8 * u);
                for (int64_t m = 0; m < M; m++)
                    a[u * M + m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k + 8 * u),
                                                   a[u * M + m]);
            }
        }
        for (; k < K; k += 8) {
            const __m256 wv = load8_i8(wr + k);
            for (int64_t m = 0; m < M; m++)
                a[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), a[m]);
        }
        float v[8];
        reduce_rows(a, U, M, v);
        store_rows(y, ldy, r, v, scale[r], bias ? load1(bias, r, bf16) : 0.f, acc, M);
    }
}

/* The same for int4 w: each chunk's two halves go to accumulators u = 0 and U - 1; one
   input's group sums are scaled into its total once per group (M <= 4), or the weights
   are scaled as they are widened (M > 4: too few registers for a second set). */
static inline __attribute__((always_inline)) void gemm_rows_i4(
        const float* x, int64_t K, const uint8_t* w, const float* scale, const void* bias,
        int bf16, float* y, int64_t ldy, int64_t r0, int64_t r1, int acc, const int64_t M) {
    const int64_t U = M <= 4 ? 2 : 1, G = (K + QGROUP - 1) / QGROUP;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t* wr = w + r * (K / 2);
        const float* sr = scale + r * G;
        __m256 a[8], t[8];
        for (int64_t i = 0; i < U * M; i++) t[i] = _mm256_setzero_ps();
        for (int64_t g0 = 0; g0 < K; g0 += QGROUP) {
            const int64_t g1 = g0 + QGROUP < K ? g0 + QGROUP : K;
            const __m256 s = _mm256_set1_ps(sr[g0 / QGROUP]);
            if (M <= 4)
                for (int64_t i = 0; i < U * M; i++) a[i] = _mm256_setzero_ps();
            __builtin_prefetch(wr + g0 / 2 + 256);
            for (int64_t k = g0; k < g1; k += 16) {
                __m256 lo, hi;
                load16_i4(wr + k / 2, &lo, &hi);
                if (M > 4) {
                    lo = _mm256_mul_ps(lo, s);
                    hi = _mm256_mul_ps(hi, s);
                }
                __m256* dst = M <= 4 ? a : t;
                for (int64_t m = 0; m < M; m++) {
                    dst[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * K + k), dst[m]);
                    dst[(U - 1) * M + m] = _mm256_fmadd_ps(
                        hi, _mm256_loadu_ps(x + m * K + k + 8), dst[(U - 1) * M + m]);
                }
            }
            if (M <= 4)
                for (int64_t i = 0; i < U * M; i++) t[i] = _mm256_fmadd_ps(a[i], s, t[i]);
        }
        float v[8];
        reduce_rows(t, U, M, v);
        store_rows(y, ldy, r, v, 1.f, bias ? load1(bias, r, bf16) : 0.f, acc, M);
    }
}

/* Rows [r0, r1) of y (+)= x w^T (+ bias) for inputs [m0, m0 + mm): up to 8 inputs share
   one pass over the rows; more go 8 at a time over tiles of 128 rows (a tile read once
   from memory stays in L2 for the next 8). */
static void gemm_dot_q(const float* x, int64_t m0, int64_t mm, int64_t K, const void* w,
                       const float* scale, int q, const void* bias, int bf16, float* y,
                       int64_t N, int64_t r0, int64_t r1, int acc) {
    const int64_t tile = mm <= 8 ? r1 - r0 : 128;
#define QCASE(MM)                                                                       \
    if (q == 1) gemm_rows_i8(xm, K, (const int8_t*)w, scale, bias, bf16, ym, N, t0, t1, \
                             acc, MM);                                                  \
    else gemm_rows_i4(xm, K, (const uint8_t*)w, scale, bias, bf16, ym, N, t0, t1, acc, MM);
    for (int64_t t0 = r0; t0 < r1; t0 += tile) {
        const int64_t t1 = t0 + tile < r1 ? t0 + tile : r1;
        for (int64_t i = m0; i < m0 + mm; i += 8) {
            const float* xm = x + i * K;
            float* ym = y + i * N;
            ROWS_1_TO_8(m0 + mm - i, QCASE)  /* fused_decode.c */
        }
    }
#undef QCASE
}

/* 8 floats holding small integers (|v| < 256) as bf16, exactly: their high halves. */
static inline __m128i bf16x8_exact(__m256 v) {
    const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* The columns of a scale group: int8's one group is the whole row. */
static inline int64_t group_cols(int q, int64_t K) { return q == 1 ? K : QGROUP; }

/* wt = rows [t0, t1) of w as bf16 integers (no scale), group by group: group g's block
   [t1 - t0][kg] starts at wt + g0 (t1 - t0), for the micro-kernel's row stride kg. */
static void dequant_tile(const void* w, int q, int64_t K, int64_t t0, int64_t t1,
                         uint16_t* wt) {
    const int64_t rows = t1 - t0, gc = group_cols(q, K);
    for (int64_t r = t0; r < t1; r++) {
        for (int64_t g0 = 0; g0 < K; g0 += gc) {
            const int64_t kg = K - g0 < gc ? K - g0 : gc;
            uint16_t* o = wt + g0 * rows + (r - t0) * kg;
            if (q == 1) {
                const int8_t* wr = (const int8_t*)w + r * K + g0;
                int64_t k = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                /* 16 at a time, one conversion instruction: 3 ops where AVX2 takes 10 */
                for (; k + 16 <= kg; k += 16)
                    _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                            _mm_loadu_si128((const __m128i*)(wr + k))))));
#endif
                for (; k < kg; k += 8)
                    _mm_storeu_si128((__m128i*)(o + k), bf16x8_exact(load8_i8(wr + k)));
            } else {
                const uint8_t* wr = (const uint8_t*)w + r * (K / 2) + g0 / 2;
                for (int64_t k = 0; k < kg; k += 16) {
                    __m256 lo, hi;
                    load16_i4(wr + k / 2, &lo, &hi);
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                    _mm256_storeu_si256((__m256i*)(o + k), (__m256i)_mm512_cvtneps_pbh(
                        _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1)));
#else
                    _mm_storeu_si128((__m128i*)(o + k), bf16x8_exact(lo));
                    _mm_storeu_si128((__m128i*)(o + k + 8), bf16x8_exact(hi));
#endif
                }
            }
        }
    }
}

/* out [t1 - t0][16] = the tile's rows times 16 inputs (xp: [K][16]), scales applied: the
   micro-kernel per scale group, each group's sums scaled into out. */
static void quant_tile_pass(const float* xp, int64_t K, const uint16_t* wt,
                            const float* scale, int q, int64_t t0, int64_t t1, float* out) {
    const int64_t rows = t1 - t0, gc = group_cols(q, K), G = (K + QGROUP - 1) / QGROUP;
    float part[WIDE_TILE * 16] __attribute__((aligned(32)));
    for (int64_t g0 = 0; g0 < K; g0 += gc) {
        const int64_t kg = K - g0 < gc ? K - g0 : gc;
        for (int64_t r = 0; r < rows; r += 6)
            k6x16_bf16(xp + g0 * 16, kg, wt + g0 * rows + r * kg, part + r * 16);
        for (int64_t r = 0; r < rows; r++) {
            const __m256 s = _mm256_set1_ps(q == 1 ? scale[t0 + r]
                                                   : scale[(t0 + r) * G + g0 / QGROUP]);
            float* o = out + r * 16;
            const float* pr = part + r * 16;
            for (int64_t h = 0; h < 16; h += 8) {
                const __m256 v = _mm256_mul_ps(_mm256_load_ps(pr + h), s);
                _mm256_store_ps(o + h, g0 ? _mm256_add_ps(_mm256_load_ps(o + h), v) : v);
            }
        }
    }
}

/* out [r1 - r0][K] = rows [r0, r1) of w dequantized to float32 (scales applied: the same
   products as quant.py's dequantize). */
static void dequant_rows(const void* w, const float* scale, int q, int64_t K, int64_t r0,
                         int64_t r1, float* out) {
    const int64_t G = (K + QGROUP - 1) / QGROUP;
    for (int64_t r = r0; r < r1; r++) {
        float* o = out + (r - r0) * K;
        if (q == 1) {
            const int8_t* wr = (const int8_t*)w + r * K;
            const __m256 s = _mm256_set1_ps(scale[r]);
            for (int64_t k = 0; k < K; k += 8)
                _mm256_storeu_ps(o + k, _mm256_mul_ps(load8_i8(wr + k), s));
        } else {
            const uint8_t* wr = (const uint8_t*)w + r * (K / 2);
            for (int64_t k = 0; k < K; k += 16) {
                const __m256 s = _mm256_set1_ps(scale[r * G + k / QGROUP]);
                __m256 lo, hi;
                load16_i4(wr + k / 2, &lo, &hi);
                _mm256_storeu_ps(o + k, _mm256_mul_ps(lo, s));
                _mm256_storeu_ps(o + k + 8, _mm256_mul_ps(hi, s));
            }
        }
    }
}
#endif
