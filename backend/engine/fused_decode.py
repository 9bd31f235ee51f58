"""A whole decode step of a small batch in one C call, on the CPU.

Why: a decode step of one sequence moves every weight once (80 MB for the bench model in
bf16) and does little else, so its floor is the time to stream the weights. Through torch
ops the bench model's step runs ~80 small ops per layer (norms, rotary halves, casts,
slices, residual adds) that together cost as much as the weight stream: ~2.5 ms of a
6 ms step. Here one call runs all layers inside one OpenMP region:

    h = embed[ids]                                       (fp32)
    per layer: x = rmsnorm(h); qkv = x W_qkv (+ b); rotary on q, k; K/V into the paged
               cache; attention (the decode kernel's task); h += att W_o (+ b);
               x = rmsnorm(h); g, u = x W_gate_up; h += (silu(g) * u) W_down
    out = rmsnorm(h)

Weights (bf16 or fp32) are read where they lie and widened in registers; activations,
norms and sums stay fp32 (as the multi-row path's prepacked fp32 matmuls do). Each matmul
splits its output rows between the threads, so each thread streams one contiguous slice
of the weight. ``linear`` is the same matmul alone (the LM head).

Used for steps where every sequence decodes and there are at most ``MAX_ROWS`` of them;
larger batches are compute-bound and run oneDNN's prepacked matmuls (``linear.py``).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from .models.llama import LlamaForCausalLM

# Decode steps of up to this many sequences run all in C (``FusedDecoder.forward``); larger
# ones keep oneDNN's prepacked matmuls (``forward_packed``). Measured on the bench model's
# weights (bf16, 2-core AVX2 CPU): the C matmuls beat oneDNN's at 1-32 inputs (32: layers
# 12.3 against 13.1 ms, LM head 7.8 against 8.4-9.1 ms), tie at 48 and lose at 64.
MAX_ROWS = 32

SOURCE = r"""
#ifdef VECTOR
#include <omp.h>

typedef struct {
    const void* qkv_w; const void* qkv_b; const void* o_w; const void* o_b;
    const void* gate_up_w; const void* down_w; const void* in_norm; const void* post_norm;
    void* k_cache; void* v_cache;
} FusedLayer;

typedef struct {
    int64_t layers, hidden, inter, heads, kv_heads, head_dim, num_blocks, block_size;
    int64_t bf16;  /* 1: weights and caches bfloat16; 0: float32 */
    float eps, scale;
    const void* embed;
    const void* final_norm;
    const FusedLayer* layer;
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

/* The calling thread's share of y (+)= x w^T (+ bias), x [n, K], w [N, K]. No barrier.
   Up to 8 inputs share one pass over the weight slice. More inputs go 8 at a time over
   tiles of 128 weight rows, so that a tile read once from memory stays in L2 for the
   other passes. */
static void gemm_share(const float* x, int64_t n, int64_t K, const void* w, const void* bias,
                       float* y, int64_t N, int acc, int bf16) {
    int64_t r0, r1;
    share(N, 8, &r0, &r1);
    if (r0 >= r1) return;
    /* Many inputs: 8 at a time over 128-row tiles of w, and K in chunks of 512, so that
       the tile stays in L2 and the 8 inputs' chunk (16 KB) in L1 across the passes. */
    const int64_t tile = n <= 8 ? r1 - r0 : 128, kc = n <= 8 ? K : 512;
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
            for (int64_t m0 = 0; m0 < n; m0 += 8) {
                const float* xm = x + m0 * K + k0;
                float* ym = y + m0 * N;
                switch (n - m0 < 8 ? n - m0 : 8) {
                case 1: { GEMM_CASE(1) break; }
                case 2: { GEMM_CASE(2) break; }
                case 3: { GEMM_CASE(3) break; }
                case 4: { GEMM_CASE(4) break; }
                case 5: { GEMM_CASE(5) break; }
                case 6: { GEMM_CASE(6) break; }
                case 7: { GEMM_CASE(7) break; }
                default: { GEMM_CASE(8) break; }
                }
            }
        }
    }
#undef GEMM_CASE
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
        const int64_t nt = omp_get_num_threads(), tid = omp_get_thread_num();
        for (int64_t m = tid; m < n; m += nt)
            for (int64_t e = 0; e < E; e++) h[m * E + e] = load1(M->embed, ids[m] * E + e, bf16);
        #pragma omp barrier
        for (int64_t l = 0; l < M->layers; l++) {
            const FusedLayer* L = M->layer + l;
            norm_rows(h, x, n, E, L->in_norm, M->eps, bf16);
            #pragma omp barrier
            gemm_share(x, n, E, L->qkv_w, L->qkv_b, qkv, QKV, 0, bf16);
            #pragma omp barrier
            rope_write_rows(M, L, qkv, n, cos, sin, tables, width, ctx, tmp);
            #pragma omp barrier
            attend_rows(M, L, qkv, n, tables, width, ctx, att, s, acc);
            gemm_share(att, n, H * D, L->o_w, L->o_b, h, E, 1, bf16);
            #pragma omp barrier
            norm_rows(h, x, n, E, L->post_norm, M->eps, bf16);
            #pragma omp barrier
            gemm_share(x, n, E, L->gate_up_w, NULL, gu, 2 * I, 0, bf16);
            #pragma omp barrier
            silu_mul_share(gu, act, n, I);
            #pragma omp barrier
            gemm_share(act, n, I, L->down_w, NULL, h, E, 1, bf16);
            #pragma omp barrier
        }
        norm_rows(h, out, n, E, M->final_norm, M->eps, bf16);
        free(s);
    }
}

/* y [n, N] = x [n, K] w^T (+ bias): the LM head of a fused step. */
void fused_linear(const float* x, int64_t n, int64_t K, const void* w, const void* bias,
                  float* y, int64_t N, int64_t bf16, int nthreads) {
    #pragma omp parallel num_threads(nthreads)
    gemm_share(x, n, K, w, bias, y, N, 0, (int)bf16);
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
"""


_LAYER_FIELDS = ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w", "in_norm", "post_norm",
                 "k_cache", "v_cache")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _LAYER_FIELDS]


class _Model(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in (
        "layers", "hidden", "inter", "heads", "kv_heads", "head_dim", "num_blocks",
        "block_size", "bf16")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("embed", ctypes.c_void_p), ("final_norm", ctypes.c_void_p),
        ("layer", ctypes.POINTER(_Layer))]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _fn(lib: ctypes.CDLL, name: str, *args: Any) -> Any:
    """A C function returning void; every one takes the thread count last."""
    fn = getattr(lib, name)
    fn.restype = None
    fn.argtypes = [*args, ctypes.c_int]
    return fn


class FusedDecoder:
    """The fused step bound to one model's weights (and, at first use, its KV cache)."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM) -> None:
        i64, ptr, model_p = ctypes.c_int64, ctypes.c_void_p, ctypes.POINTER(_Model)
        self._forward = _fn(lib, "fused_forward", model_p, i64, ptr, ptr, ptr, ptr, i64, ptr,
                            ptr, ptr)
        self._linear = _fn(lib, "fused_linear", ptr, i64, i64, ptr, ptr, ptr, i64, i64)
        self._rope_attend = _fn(lib, "fused_rope_attend", model_p, i64, ptr, i64, ptr, ptr,
                                ptr, i64, ptr, ptr)
        self._add_norm = _fn(lib, "fused_add_norm", ptr, ptr, i64, i64, ptr, ctypes.c_float,
                             i64, ptr)
        self._silu_mul = _fn(lib, "fused_silu_mul", ptr, i64, i64, ptr)
        self._argmax = _fn(lib, "argmax_rows", ptr, i64, i64, ptr)
        self.model = model
        self.dtype = model.dtype
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._struct: _Model | None = None
        self._layers: ctypes.Array[_Layer] | None = None
        self._key: tuple[int, ...] = ()
        cfg = model.config
        self._scratch_per_row = (2 * cfg.hidden_size + (cfg.num_attention_heads
                                 + 2 * cfg.num_key_value_heads) * cfg.head_dim
                                 + cfg.q_size + 3 * cfg.intermediate_size)

    @staticmethod
    def supports(model: LlamaForCausalLM) -> bool:
        """Whether the fused step can run ``model`` (dtype, shapes, layout)."""
        cfg = model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        m = model.model
        weights = [m.embed_tokens.weight, model.lm_head_weight]
        layers: list[Any] = list(m.layers)
        for layer in layers:
            weights += [layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
                        layer.mlp.gate_up_weight, layer.mlp.down_proj.weight]
        return (model.dtype in (torch.bfloat16, torch.float32)
                and m.embed_tokens.weight.device.type == "cpu"
                and cfg.head_dim % 16 == 0 and heads % kv_heads == 0
                and heads // kv_heads in (1, 2, 4, 8)
                and cfg.hidden_size % 8 == 0 and cfg.intermediate_size % 8 == 0
                and cfg.q_size % 8 == 0
                and all(w.is_contiguous() for w in weights))

    def _weights_key(self) -> tuple[int, ...]:
        """Where the weights are now: the C struct holds their addresses, so a model moved
        or reloaded after binding (``.to()``, ``load_state_dict(assign=True)``) rebinds."""
        m = self.model.model
        layers: list[Any] = list(m.layers)
        return (m.embed_tokens.weight.data_ptr(), self.model.lm_head_weight.data_ptr(),
                *(p.data_ptr() for layer in layers for p in (
                    layer.self_attn.qkv_weight, layer.self_attn.o_proj.weight,
                    layer.mlp.gate_up_weight, layer.mlp.down_proj.weight)))

    def _bind(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> _Model:
        key = self._weights_key()
        if self._struct is not None and self._caches is kv_caches and self._key == key:
            return self._struct
        if self.model.dtype != self.dtype:
            raise ValueError("fused decode: the model's dtype changed after it was bound")
        for k, v in kv_caches:
            if k.dtype != self.dtype or v.dtype != self.dtype or not k.is_contiguous() \
                    or not v.is_contiguous():
                raise ValueError("fused decode: the KV cache must be contiguous and in the "
                                 "model dtype")
        model, cfg = self.model, self.model.config
        layers = (_Layer * cfg.num_hidden_layers)()
        modules: list[Any] = list(model.model.layers)
        for i, (layer, (k, v)) in enumerate(zip(modules, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            layers[i] = _Layer(
                _ptr(attn.qkv_weight), _ptr(attn.qkv_bias), _ptr(attn.o_proj.weight),
                _ptr(attn.o_proj.bias), _ptr(mlp.gate_up_weight), _ptr(mlp.down_proj.weight),
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                _ptr(k), _ptr(v))
        k0 = kv_caches[0][0]
        self._struct = _Model(
            cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, k0.shape[1],
            k0.shape[2], int(self.dtype == torch.bfloat16), cfg.rms_norm_eps,
            cfg.head_dim ** -0.5, _ptr(model.model.embed_tokens.weight),
            _ptr(model.model.norm.weight), layers)
        self._layers, self._caches, self._key = layers, kv_caches, key
        return self._struct

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                tables: torch.Tensor, context_lens: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                scratch: torch.Tensor) -> torch.Tensor:
        """Decode step of n <= MAX_ROWS sequences (token i is sequence i); returns the
        final-normed hidden states [n, hidden] in float32.

        cos, sin: float32 [n, head_dim] (``RotaryEmbedding.cos_sin``); tables [n, width],
        context_lens [n] int64 (``DecodeGroup``); scratch: float32, at least
        ``scratch_numel(n)`` elements.
        """
        n = input_ids.shape[0]
        if not 1 <= n <= MAX_ROWS:
            raise ValueError(f"fused decode takes 1..{MAX_ROWS} sequences, got {n}")
        struct = self._bind(kv_caches)
        out = torch.empty((n, self.model.config.hidden_size), dtype=torch.float32)
        self._forward(ctypes.byref(struct), n, input_ids.data_ptr(), cos.data_ptr(),
                      sin.data_ptr(), tables.data_ptr(), tables.shape[1],
                      context_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
        return out

    def scratch_numel(self, n: int) -> int:
        return n * self._scratch_per_row

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [n <= MAX_ROWS, K] float32 -> x weight^T (+ bias) [n, N] float32; weight (and
        bias) in the model dtype."""
        n, k = x.shape
        if x.dtype != torch.float32 or not x.is_contiguous() or not 1 <= n <= MAX_ROWS \
                or x.device.type != "cpu" or weight.device.type != "cpu" \
                or weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous() \
                or weight.dtype != self.dtype or k % 8 or (bias is not None and (
                    bias.dtype != self.dtype or bias.shape != weight.shape[:1]
                    or not bias.is_contiguous())):
            raise ValueError(f"fused linear: x must be contiguous float32 [1..{MAX_ROWS} rows, "
                             f"K], weight contiguous [N, K] in {self.dtype}, K % 8 == 0")
        y = torch.empty((n, weight.shape[0]), dtype=torch.float32)
        self._linear(x.data_ptr(), n, k, weight.data_ptr(), _ptr(bias), y.data_ptr(),
                     weight.shape[0], int(weight.dtype == torch.bfloat16),
                     torch.get_num_threads())
        return y

    def forward_packed(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       tables: torch.Tensor, context_lens: torch.Tensor,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Decode step of more than ``MAX_ROWS`` sequences: the matmuls run oneDNN's
        prepacked float32 weights (``prepack_cpu_matmuls`` first), everything between them
        runs here, one call per piece: norms fused with the residual adds, rotary + K/V
        write + attention, silu * up. Same arguments and result as ``forward``."""
        model = self.model
        struct = self._bind(kv_caches)
        threads = torch.get_num_threads()
        layers: list[Any] = list(model.model.layers)
        cfg = model.config
        n, hidden, inter = input_ids.shape[0], cfg.hidden_size, cfg.intermediate_size
        h = torch.nn.functional.embedding(input_ids, model.model.embed_tokens.weight).float()
        x = torch.empty_like(h)
        att = torch.empty((n, cfg.q_size), dtype=torch.float32)
        act = torch.empty((n, inter), dtype=torch.float32)
        bf16, eps = int(self.dtype == torch.bfloat16), cfg.rms_norm_eps
        width, tables_p, ctx_p = tables.shape[1], tables.data_ptr(), context_lens.data_ptr()
        norms = [layer.input_layernorm.weight for layer in layers] + [model.model.norm.weight]
        self._add_norm(h.data_ptr(), None, n, hidden, norms[0].data_ptr(), eps, bf16,
                       x.data_ptr(), threads)
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_packed(x)
            self._rope_attend(ctypes.byref(struct), i, qkv.data_ptr(), n, cos.data_ptr(),
                              sin.data_ptr(), tables_p, width, ctx_p, att.data_ptr(), threads)
            o = attn.o_packed(att)
            self._add_norm(h.data_ptr(), o.data_ptr(), n, hidden,
                           layer.post_attention_layernorm.weight.data_ptr(), eps, bf16,
                           x.data_ptr(), threads)
            gate_up = mlp.gate_up_packed(x)
            self._silu_mul(gate_up.data_ptr(), n, inter, act.data_ptr(), threads)
            down = mlp.down_packed(act)
            self._add_norm(h.data_ptr(), down.data_ptr(), n, hidden, norms[i + 1].data_ptr(),
                           eps, bf16, x.data_ptr(), threads)
        return x

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """``logits.argmax(dim=-1).tolist()`` for finite float32 CPU logits [n, vocab]."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous() \
                or logits.device.type != "cpu" or logits.shape[1] == 0:
            return cast(list[int], logits.argmax(dim=-1).tolist())
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr(),
                     torch.get_num_threads())
        picks: list[int] = out.tolist()
        for i, tok in enumerate(picks):
            if tok < 0:  # a NaN row: torch's rule (the first NaN)
                picks[i] = int(logits[i].argmax())
        return picks
