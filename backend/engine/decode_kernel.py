"""A paged decode-attention kernel for the CPU, in C, compiled on first use.

Why a kernel: with torch ops, decode attention has to gather every sequence's K/V blocks
into a dense scratch copy and then run SDPA on tiny per-(sequence, KV head) problems. At
batch 32 and context 512 (bench model, bf16, 2 cores) that costs 1 ms of gathering and
2.4 ms of SDPA per layer, ~8x what reading the 17 MB of K/V takes. This kernel reads each
block where it lies in the cache, once, converts bf16 to fp32 in registers and
accumulates in fp32: per (sequence, KV head) task, pass 1 computes the G query heads'
scores against every cached key (G = heads / KV heads, so K is read once per KV head),
a softmax, and pass 2 sums the values.

It is built with the system C compiler (``cc``) into a cache directory keyed by the
source, flags and CPU, then loaded with ``ctypes``; OpenMP comes from the ``libgomp.so.1``
that torch has already loaded, so both share one thread pool. Where no compiler is found
or the build fails, ``load_decode_kernel`` returns None and attention uses torch ops.
Supports float32 and bfloat16 caches (float16 uses torch ops).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from . import fused_decode
from .quant import QuantizedWeight
from .weights import DecoderWeights

log = logging.getLogger("sluice.engine")

_SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <float.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
#define LOAD_F32(x) (x)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
static inline __m256 load8_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Blocks lie anywhere in the cache: without prefetching the ones ahead, every block costs
   a TLB miss and a DRAM round trip (measured 3.5x slower than contiguous blocks). In a
   decode step the K/V come from DRAM (the layer's weights stream through the cache in
   between): prefetching 3 blocks ahead into L2 (locality 1) ran 0.70 ms against 1.0 ms
   for 1 block into L1 (batch 32, context 520, bf16, 2 threads); in cache both run 0.5. */
#ifndef PREFETCH
#define PREFETCH 3  /* blocks ahead */
#endif
static inline void prefetch_block(const void* p, int64_t nbytes) {
    for (int64_t off = 0; off < nbytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 1);
}

/* Softmax of each of the G rows of s [G, len], in place. */
static void softmax_rows(float* s, int64_t G, int64_t len) {
    for (int64_t g = 0; g < G; g++) {
        float* sg = s + g * len;
        float mx = -FLT_MAX, sum = 0.f;
        for (int64_t t = 0; t < len; t++) mx = sg[t] > mx ? sg[t] : mx;
        for (int64_t t = 0; t < len; t++) { sg[t] = expf(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; t++) sg[t] *= inv;
    }
}

/* q: fp32, token t's head h at q[t * q_stride + h * D]. K/V cache: [kvh, nb, bs, D].
   Sequence b: flat token tokens[b], block table tables[b * width ...], context ctx[b].
   out: fp32, token t's head h at out[t * out_stride + h * D]. Query head h reads KV head
   h / G (Hugging Face's repeat_kv order). One task per (sequence, KV head): scores of
   its G query heads against every key (s [G, len]), softmax, then the values summed
   into acc [G, D]. */
#define TASK_BEGIN                                                                      \
    const int64_t G = H / kvh;                                                          \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(nthreads)")              \
    for (int64_t task = 0; task < n * kvh; task++) {                                    \
        const int64_t b = task / kvh, j = task % kvh, len = ctx[b];                     \
        const float* qb = q + tokens[b] * q_stride + j * G * D;                         \
        const int64_t* table = tables + b * width;                                      \
        float* s = (float*)malloc(sizeof(float) * (G * len + G * D + bs * D));          \
        float* acc = s + G * len;                                                       \
        float* row = acc + G * D;                                                       \
        memset(acc, 0, sizeof(float) * G * D);

#define TASK_END                                                                        \
        memcpy(out + tokens[b] * out_stride + j * G * D, acc, sizeof(float) * G * D);  \
        free(s);                                                                        \
    }

#define KERNEL_ARGS(T)                                                                  \
    const float* q, int64_t q_stride, const T* kc, const T* vc,                         \
    const int64_t* tokens, const int64_t* tables, const int64_t* ctx,                   \
    int64_t n, int64_t width, int64_t H, int64_t kvh, int64_t nb, int64_t bs,           \
    int64_t D, float scale, float* out, int64_t out_stride, int nthreads

/* Portable version: any head_dim, any CPU. */
#define DEFINE_SCALAR(NAME, T, LOAD)                                                    \
static void NAME(KERNEL_ARGS(T)) {                                                      \
    TASK_BEGIN                                                                          \
    for (int64_t t0 = 0; t0 < len; t0 += bs) {                                          \
        const T* kb = kc + ((j * nb + table[t0 / bs]) * bs) * D;                        \
        const int64_t m = len - t0 < bs ? len - t0 : bs;                                \
        for (int64_t i = 0; i < m * D; i++) row[i] = LOAD(kb[i]);                       \
        for (int64_t g = 0; g < G; g++)                                                 \
            for (int64_t i = 0; i < m; i++) {                                           \
                float dot = 0.f;                                                        \
                for (int64_t d = 0; d < D; d++) dot += qb[g * D + d] * row[i * D + d];  \
                s[g * len + t0 + i] = dot * scale;                                      \
            }                                                                           \
    }                                                                                   \
    softmax_rows(s, G, len);                                                            \
    for (int64_t t0 = 0; t0 < len; t0 += bs) {                                          \
        const T* vb = vc + ((j * nb + table[t0 / bs]) * bs) * D;                        \
        const int64_t m = len - t0 < bs ? len - t0 : bs;                                \
        for (int64_t i = 0; i < m * D; i++) row[i] = LOAD(vb[i]);                       \
        for (int64_t g = 0; g < G; g++)                                                 \
            for (int64_t i = 0; i < m; i++) {                                           \
                const float p = s[g * len + t0 + i];                                    \
                for (int64_t d = 0; d < D; d++) acc[g * D + d] += p * row[i * D + d];   \
            }                                                                           \
    }                                                                                   \
    TASK_END                                                                            \
}

DEFINE_SCALAR(scalar_f32, float, LOAD_F32)
DEFINE_SCALAR(scalar_bf16, uint16_t, bf16_to_f32)

#ifdef VECTOR
/* 16 values at p as two fp32 vectors. bf16: one 32-byte load whose 16-bit halves are
   interleaved with zeros, 3 instructions for 16 values where widening 8 at a time takes 4;
   unpack works within 128-bit lanes, so lo holds elements 0-3, 8-11 and hi 4-7, 12-15
   (PERMUTED). Dot products do not mind if q is permuted alike (perm16); value sums come
   out permuted and are put back in order at the end (unperm16). */
static inline void load16_bf16(const uint16_t* p, __m256* lo, __m256* hi) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)p), z = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, x));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, x));
}
static inline void load16_f32(const float* p, __m256* lo, __m256* hi) {
    *lo = _mm256_loadu_ps(p);
    *hi = _mm256_loadu_ps(p + 8);
}
/* n floats (n % 16 == 0), 16 at a time: natural order <-> load16_bf16's order. */
static inline void perm16(const float* src, float* dst, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m256 a = _mm256_loadu_ps(src + i), b = _mm256_loadu_ps(src + i + 8);
        _mm256_storeu_ps(dst + i, _mm256_permute2f128_ps(a, b, 0x20));
        _mm256_storeu_ps(dst + i + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
}
static inline void unperm16(float* x, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) {
        const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + i + 8);
        _mm256_storeu_ps(x + i, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(x + i + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}
/* The 8 sums of a[0..7] as one vector (lane i = sum of a[i]). */
static inline __m256 hsum8x8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* AVX2 version for head_dim % 16 == 0 and G in {1, 2, 4, 8}: K and V are widened to fp32
   16 lanes at a time straight from the cache (load16_*), with fp32 FMAs. G is a
   compile-time constant in each instance so the accumulators live in registers: W tokens'
   scores (W * G <= 8 FMA chains, summed 8 at once by hsum8x8) or CW 16-column groups of
   values run at once, so the loops are not bound by FMA latency. Measured at batch 32,
   context 520, bf16, 2 threads: the score pass is ~55 % of the time, values ~40 %. */
#define DEFINE_VECTOR_TASK(NAME, T, LOAD16, PERMUTED)                                   \
static inline __attribute__((always_inline)) void NAME(                                 \
        const float* qb, const T* kc, const T* vc, const int64_t* table, int64_t len,   \
        int64_t j, int64_t nb, int64_t bs, int64_t D, float scale, float* s,            \
        float* acc, const int64_t G) {                                                  \
    const int64_t W = G <= 2 ? 4 : G <= 4 ? 2 : 1;                                      \
    float qp[G * D];                                                                    \
    if (PERMUTED) { perm16(qb, qp, G * D); qb = qp; }                                   \
    for (int64_t t0 = 0; t0 < len && t0 < PREFETCH * bs; t0 += bs)                     \
        prefetch_block(kc + ((j * nb + table[t0 / bs]) * bs) * D, bs * D * sizeof(T));  \
    for (int64_t t0 = 0; t0 < len; t0 += bs) {                                          \
        const T* kb = kc + ((j * nb + table[t0 / bs]) * bs) * D;                        \
        const int64_t m = len - t0 < bs ? len - t0 : bs;                                \
        if (t0 + PREFETCH * bs < len)                                                   \
            prefetch_block(kc + ((j * nb + table[t0 / bs + PREFETCH]) * bs) * D,        \
                           bs * D * sizeof(T));                                         \
        int64_t i = 0;                                                                  \
        for (; i + W <= m; i += W) {                                                    \
            __m256 a[8];                                                                \
            for (int64_t x = 0; x < W * G; x++) a[x] = _mm256_setzero_ps();             \
            for (int64_t d = 0; d < D; d += 16) {                                       \
                for (int64_t w = 0; w < W; w++) {                                       \
                    __m256 klo, khi;                                                    \
                    LOAD16(kb + (i + w) * D + d, &klo, &khi);                           \
                    for (int64_t g = 0; g < G; g++) {                                   \
                        a[w * G + g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), \
                                                       klo, a[w * G + g]);              \
                        a[w * G + g] = _mm256_fmadd_ps(                                 \
                            _mm256_loadu_ps(qb + g * D + d + 8), khi, a[w * G + g]);    \
                    }                                                                   \
                }                                                                       \
            }                                                                           \
            if (W * G == 8) {                                                           \
                float r[8];                                                             \
                _mm256_storeu_ps(r, hsum8x8(a));                                        \
                for (int64_t w = 0; w < W; w++)                                         \
                    for (int64_t g = 0; g < G; g++)                                     \
                        s[g * len + t0 + i + w] = r[w * G + g] * scale;                 \
            } else {                                                                    \
                for (int64_t w = 0; w < W; w++)                                         \
                    for (int64_t g = 0; g < G; g++)                                     \
                        s[g * len + t0 + i + w] = hsum8(a[w * G + g]) * scale;          \
            }                                                                           \
        }                                                                               \
        for (; i < m; i++) {                                                            \
            __m256 a[8];                                                                \
            for (int64_t g = 0; g < G; g++) a[g] = _mm256_setzero_ps();                 \
            for (int64_t d = 0; d < D; d += 16) {                                       \
                __m256 klo, khi;                                                        \
                LOAD16(kb + i * D + d, &klo, &khi);                                     \
                for (int64_t g = 0; g < G; g++) {                                       \
                    a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d), klo, a[g]); \
                    a[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qb + g * D + d + 8), khi,    \
                                           a[g]);                                       \
                }                                                                       \
            }                                                                           \
            for (int64_t g = 0; g < G; g++) s[g * len + t0 + i] = hsum8(a[g]) * scale;  \
        }                                                                               \
    }                                                                                   \
    for (int64_t t0 = 0; t0 < len && t0 < PREFETCH * bs; t0 += bs)                     \
        prefetch_block(vc + ((j * nb + table[t0 / bs]) * bs) * D, bs * D * sizeof(T));  \
    softmax_rows(s, G, len);                                                            \
    /* values: CW 16-column groups per pass (2 G CW accumulators) */                    \
    const int64_t CW = G <= 2 && D % 32 == 0 ? 2 : 1;                                   \
    for (int64_t t0 = 0; t0 < len; t0 += bs) {                                          \
        const T* vb = vc + ((j * nb + table[t0 / bs]) * bs) * D;                        \
        const int64_t m = len - t0 < bs ? len - t0 : bs;                                \
        if (t0 + PREFETCH * bs < len)                                                   \
            prefetch_block(vc + ((j * nb + table[t0 / bs + PREFETCH]) * bs) * D,        \
                           bs * D * sizeof(T));                                         \
        if (CW == 2) VALUE_PASS(T, LOAD16, G, 2) else VALUE_PASS(T, LOAD16, G, 1)       \
    }                                                                                   \
    if (PERMUTED) unperm16(acc, G * D);                                                 \
}

/* acc[g, d .. d + 16 CW) += sum over the block's m tokens of p[g, t] v[t, d ..]. */
#define VALUE_PASS(T, LOAD16, G, CW) {                                                  \
        for (int64_t d = 0; d < D; d += 16 * CW) {                                      \
            __m256 a[2 * 8 * CW];                                                       \
            for (int64_t g = 0; g < G; g++)                                             \
                for (int64_t c = 0; c < 2 * CW; c++)                                    \
                    a[g * 2 * CW + c] = _mm256_loadu_ps(acc + g * D + d + 8 * c);       \
            for (int64_t i = 0; i < m; i++) {                                           \
                __m256 v[2 * CW];                                                       \
                for (int64_t c = 0; c < CW; c++)                                        \
                    LOAD16(vb + i * D + d + 16 * c, &v[2 * c], &v[2 * c + 1]);          \
                for (int64_t g = 0; g < G; g++) {                                       \
                    const __m256 p = _mm256_broadcast_ss(s + g * len + t0 + i);         \
                    for (int64_t c = 0; c < 2 * CW; c++)                                \
                        a[g * 2 * CW + c] = _mm256_fmadd_ps(p, v[c], a[g * 2 * CW + c]); \
                }                                                                       \
            }                                                                           \
            for (int64_t g = 0; g < G; g++)                                             \
                for (int64_t c = 0; c < 2 * CW; c++)                                    \
                    _mm256_storeu_ps(acc + g * D + d + 8 * c, a[g * 2 * CW + c]);       \
        }                                                                               \
    }

#define DEFINE_VECTOR(NAME, TASK, T)                                                    \
static void NAME(KERNEL_ARGS(T)) {                                                      \
    TASK_BEGIN                                                                          \
    (void)row;                                                                          \
    switch (G) {                                                                        \
    case 1: TASK(qb, kc, vc, table, len, j, nb, bs, D, scale, s, acc, 1); break;        \
    case 2: TASK(qb, kc, vc, table, len, j, nb, bs, D, scale, s, acc, 2); break;        \
    case 4: TASK(qb, kc, vc, table, len, j, nb, bs, D, scale, s, acc, 4); break;        \
    default: TASK(qb, kc, vc, table, len, j, nb, bs, D, scale, s, acc, 8); break;       \
    }                                                                                   \
    TASK_END                                                                            \
}

DEFINE_VECTOR_TASK(task_f32, float, load16_f32, 0)
DEFINE_VECTOR_TASK(task_bf16, uint16_t, load16_bf16, 1)
DEFINE_VECTOR(vector_f32, task_f32, float)
DEFINE_VECTOR(vector_bf16, task_bf16, uint16_t)
#endif

#ifdef VECTOR
#define VECTOR_OK (D % 16 == 0 && (H / kvh == 1 || H / kvh == 2 || H / kvh == 4 \
                                    || H / kvh == 8))
#define DISPATCH(V, S) if (VECTOR_OK) V(q, q_stride, kc, vc, tokens,                     \
    tables, ctx, n, width, H, kvh, nb, bs, D, scale, out, out_stride, nthreads);         \
    else S(q, q_stride, kc, vc, tokens, tables, ctx, n, width, H, kvh, nb, bs, D, scale, \
           out, out_stride, nthreads);
#else
#define DISPATCH(V, S) S(q, q_stride, kc, vc, tokens, tables, ctx, n, width, H, kvh, nb,  \
                         bs, D, scale, out, out_stride, nthreads);
#endif

void decode_attention_f32(KERNEL_ARGS(float)) { DISPATCH(vector_f32, scalar_f32) }
void decode_attention_bf16(KERNEL_ARGS(uint16_t)) { DISPATCH(vector_bf16, scalar_bf16) }
""" + fused_decode.SOURCE

# -ffast-math lets the dot products vectorize (reassociation) and expf use the vector
# math library; every value the kernel sees is finite (it never reads past a context).
# It is a compile flag only: linked with -ffast-math, a shared library carries a
# constructor (crtfastmath.o) that turns on flush-to-zero for the whole process when it is
# loaded, and every float computed afterwards, anywhere in the server, loses subnormals.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
_FLAGS = (*_COMPILE_FLAGS, "|", *_LINK_FLAGS)  # the cache key
_SYMBOLS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}


class DecodeKernel:
    """The compiled kernel; call it per layer (see ``attention._decode_attention``)."""

    native_dtypes = False  # float32 q and out only (attention widens bf16 rows for it)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                chunk: Any, scale: float, out: torch.Tensor) -> bool:
        """No prefill kernel in C: SDPA runs prefill chunks."""
        return False

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib  # keeps the library loaded
        self._fns: dict[torch.dtype, Any] = {}
        for dtype, name in _SYMBOLS.items():
            fn = getattr(lib, name)
            fn.restype = None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           *([ctypes.c_int64] * 7), ctypes.c_float, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int]
            self._fns[dtype] = fn

    def fused_decoder(self, weights: DecoderWeights) -> fused_decode.FusedDecoder | None:
        """The fused decode step over these weights; None where this build (no AVX2) or
        the decoder (dtype, shapes, layout) cannot use it."""
        if not hasattr(self._lib, "fused_available") \
                or not fused_decode.FusedDecoder.supports(weights):
            return None
        return fused_decode.FusedDecoder(self._lib, weights)

    def quantized_matmul(self, weight: QuantizedWeight,
                         bias: torch.Tensor | None) -> fused_decode.QuantizedMatmul | None:
        """The C matmul of a quantized matrix (``quant_kernels.c``); None where this build
        (no AVX2) or the matrix (device, layout) cannot use it."""
        if not hasattr(self._lib, "fused_available") or weight.device.type != "cpu" \
                or not weight.is_contiguous() or weight.shape[1] % 8 or (
                    bias is not None and (bias.dtype not in (torch.bfloat16, torch.float32)
                                          or not bias.is_contiguous())):
            return None
        return fused_decode.QuantizedMatmul(self._lib, weight, bias)

    def supports(self, cache: torch.Tensor) -> bool:
        return cache.device.type == "cpu" and cache.dtype in self._fns \
            and cache.is_contiguous()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tokens: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor,
                 scale: float, out: torch.Tensor) -> None:
        """Attend decode tokens ``tokens`` of q [T, H, D] (fp32, rows may be strided)
        over their paged K/V; write out [T, H * D] (fp32, contiguous) at those rows.

        ``tables`` [n, width] int64 (padded), ``context_lens`` [n] int64: keys
        0..len-1 of each sequence, K/V for all of them already in the cache.
        """
        kvh, nb, bs, d = k_cache.shape
        _, heads, _ = q.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != d \
                or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError("decode kernel: q must be fp32 [T, H, D] with dense heads, "
                             "out fp32 contiguous")
        n, width = tables.shape
        self._fns[k_cache.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tokens.data_ptr(), tables.data_ptr(), context_lens.data_ptr(),
            n, width, heads, kvh, nb, bs, d, scale, out.data_ptr(), out.stride(0),
            torch.get_num_threads())


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "kernels"


def cpu_flags() -> str:
    """The CPU's feature flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def load_decode_kernel(cache_dir: Path | None = None) -> DecodeKernel | None:
    """Build (once per source, flags and CPU) and load the kernel; None if impossible."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("no C compiler: decode attention uses torch ops")
        return None
    key = hashlib.sha256("\0".join((_SOURCE, *_FLAGS, cpu_flags())).encode()).hexdigest()
    out_dir = cache_dir or _cache_dir()
    lib_path = out_dir / f"decode_attention-{key[:16]}.so"
    try:
        if not lib_path.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
                src = Path(tmp) / "decode_attention.c"
                src.write_text(_SOURCE)
                obj = Path(tmp) / "decode_attention.o"
                built = Path(tmp) / "lib.so"
                subprocess.run([compiler, *_COMPILE_FLAGS, "-c", str(src), "-o", str(obj)],
                               check=True, capture_output=True, timeout=120)
                subprocess.run([compiler, *_LINK_FLAGS, str(obj), "-o", str(built), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(built, lib_path)  # atomic: concurrent builders agree
        return DecodeKernel(ctypes.CDLL(str(lib_path)))
    except (OSError, subprocess.SubprocessError, AttributeError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("decode attention kernel unavailable (%s %s); using torch ops",
                    exc, detail.decode(errors="replace")[-500:])
        return None
