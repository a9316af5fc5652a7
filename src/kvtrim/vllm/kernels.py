"""kvtrim's own CPU kernel for the decode steps' logits of the methods fed attention (TOVA, H2O, LazyEviction):
`QK^T` of each request's query over its blocks, read where they lie in vLLM's paged cache (no gather of the
request's blocks into a copy, which the torch functions of `kvtrim.vllm.layout` / `layout_amx` need and which
costs the most of a step's logits), every request and KV head of a layer in one parallel loop; with the logits'
softmax and, when the backend replaces vLLM's attention for a step (`table_attention`), the attention output from the
request's values in the same pass.

The kernel is C++ built once per machine and Python environment through PyTorch's extension point
(`torch.utils.cpp_extension.load_inline`, cached by PyTorch, ~30 s the first time: a compiler is what vLLM's CPU build
needs too; `build`: one process at a time, a killed build's lock removed; `load`: at most `BUILD_TIMEOUT_S`). It reads the blocks of
vLLM's CPU kernels "vec"/"vec16" (keys channel-major per block, values token-major) and "amx" (keys packed in channel
pairs per 16 tokens, values in token pairs per 16 channels), with AVX-512 or AVX2 paths where the CPU has them, in
float32 or bfloat16, accumulates in float32 and rounds to the cache's dtype, as the torch functions' product does.
`table_key_probs(layout)` gives the function the worker's attention backend calls (`QueryTap.step_probs`: the
logits, scaled, their softmax): the kernel's, or torch's when the kernel does not build (the worker logs which,
once); `table_attention(layout)` the probabilities with the attention output (the kernel's only);
`table_key_logits(layout)` the logits alone (benchmarks/serving/logits_cost.py, tests).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import threading
import time
from types import ModuleType
from typing import Callable

import torch

from kvtrim.attention import softmax_probabilities
from kvtrim.methods.base import one_line
from kvtrim.vllm import layout as cpu_vec
from kvtrim.vllm import layout_amx

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static inline float bits_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
static inline float as_float(float x) { return x; }
static inline float as_float(c10::BFloat16 x) { return bits_float(static_cast<uint32_t>(x.x) << 16); }

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// 8 consecutive values as floats (AVX2 machines: AMD's before Zen 4, Intel's before Skylake-X)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

// one query row against one block's keys (bs tokens): acc[0..bs)
template <typename T>
static inline void block_logits(const T* __restrict__ keys, const float* __restrict__ q, const T* __restrict__ q_raw,
                                int64_t bs, int64_t d, bool amx, float* __restrict__ acc) {
  if (!amx) {  // keys (d, bs): [c, t]
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bs % 16 == 0 && bs <= 256) {  // the block's tokens in registers, every channel added in
        __m512 a[16];
        const int64_t n = bs / 16;
        for (int64_t v = 0; v < n; ++v) a[v] = _mm512_setzero_ps();
        for (int64_t c = 0; c < d; ++c) {
          const uint16_t* k = reinterpret_cast<const uint16_t*>(keys + c * bs);
          const __m512 qc = _mm512_set1_ps(q[c]);
          for (int64_t v = 0; v < n; ++v) {
            __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + 16 * v)));
            a[v] = _mm512_fmadd_ps(qc, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), a[v]);
          }
        }
        for (int64_t v = 0; v < n; ++v) _mm512_storeu_ps(acc + 16 * v, a[v]);
        return;
      }
    }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (bs % 8 == 0) {  // 64 tokens at a time in 8 registers (8 tokens in one when fewer are left), every channel added in
      for (int64_t t0 = 0; t0 < bs;) {
        const int64_t n = bs - t0 >= 64 ? 8 : 1;
        __m256 a[8];
        for (int64_t v = 0; v < n; ++v) a[v] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; ++c) {
          const T* k = keys + c * bs + t0;
          const __m256 qc = _mm256_set1_ps(q[c]);
          for (int64_t v = 0; v < n; ++v) a[v] = _mm256_fmadd_ps(qc, load8(k + 8 * v), a[v]);
        }
        for (int64_t v = 0; v < n; ++v) _mm256_storeu_ps(acc + t0 + 8 * v, a[v]);
        t0 += 8 * n;
      }
      return;
    }
#endif
    std::fill(acc, acc + bs, 0.0f);
    for (int64_t c = 0; c < d; ++c) {
      const T* __restrict__ k = keys + c * bs;
      const float qc = q[c];
      for (int64_t t = 0; t < bs; ++t) acc[t] += qc * as_float(k[t]);
    }
    return;
  }
  // "amx": keys (bs / 16, d / 2, 16, 2): [t / 16, c / 2, t % 16, c % 2], a token's channel pair one 32-bit word
  const uint32_t* __restrict__ words = reinterpret_cast<const uint32_t*>(keys);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  // one bfloat16 pair product per token and channel pair: the query's pair broadcast, float sums (two chains, the
  // even and the odd pairs, so that each product does not wait for the one before)
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q_raw);
  for (int64_t tile = 0; tile < bs / 16; ++tile) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    const uint32_t* w = words + tile * (d / 2) * 16;
    for (int64_t p = 0; p + 1 < d / 2; p += 2) {
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + p * 16),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[p])));
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + (p + 1) * 16),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[p + 1])));
    }
    if ((d / 2) % 2) {
      const int64_t p = d / 2 - 1;
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + p * 16),
                            (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[p])));
    }
    _mm512_storeu_ps(acc + tile * 16, _mm512_add_ps(a0, a1));
  }
#else
  std::fill(acc, acc + bs, 0.0f);
  for (int64_t tile = 0; tile < bs / 16; ++tile) {
    float* __restrict__ a = acc + tile * 16;
    for (int64_t p = 0; p < d / 2; ++p) {
      const uint32_t* __restrict__ w = words + (tile * (d / 2) + p) * 16;
      const float q0 = q[2 * p], q1 = q[2 * p + 1];
      for (int64_t j = 0; j < 16; ++j) a[j] += q0 * bits_float(w[j] << 16) + q1 * bits_float(w[j] & 0xFFFF0000u);
    }
  }
#endif
}

// logits[r, i, u * bs + t] = sum_c query[r, i, c] * key(block table[r, u], KV head i / group, token t, channel c)
template <typename T>
static void run(const T* cache, int64_t block_stride, int64_t head_stride, int64_t h, int64_t bs, int64_t d,
                const int64_t* table, int64_t r_count, int64_t u_count, const T* query, int64_t q_heads, bool amx,
                T* out) {
  const int64_t group = q_heads / h;
  at::parallel_for(0, r_count * u_count * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(d), acc(bs);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv_head = item % h, ru = item / h, r = ru / u_count, u = ru % u_count;
      const T* keys = cache + table[ru] * block_stride + kv_head * head_stride;  // the slab's first half
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = kv_head * group + g;
        const T* qrow = query + (r * q_heads + i) * d;
        for (int64_t c = 0; c < d; ++c) q[c] = as_float(qrow[c]);
        block_logits(keys, q.data(), qrow, bs, d, amx, acc.data());
        T* o = out + (r * q_heads + i) * u_count * bs + u * bs;
        for (int64_t t = 0; t < bs; ++t) o[t] = static_cast<T>(acc[t]);
      }
    }
  });
}

#if defined(__AVX512F__)
// exp of 16 floats: 2^n e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to r^7 (relative
// error under 1e-8, below float's half ulp: within an ulp of torch's exp)
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));  // (softmax's x - max <= 0; below this exp is 0 in float)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: r exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// exp16's steps on 8 floats; 2^n (n >= -149) as two factors that are each a normal float (AVX2 has no scalef): the
// product rounds once, as scalef does
static inline __m256 pow2(__m256i e) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
}
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-103.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  for (float c : {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(_mm256_sub_epi32(ni, half))), pow2(half));
}
static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}
#endif

static inline uint32_t float_bits(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}
// x rounded to T and back, as float: bfloat16's round to nearest even (x finite: no NaN case), in integer ops a loop
// vectorises
template <typename T>
static inline float rounded(float x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint32_t bits = float_bits(x);
    return bits_float((bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u);
  } else {
    return x;
  }
}

// row[0..n) <- exp(row - max) / sum, in place (float)
static inline void softmax_row(float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.0f;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + t));
  m = _mm512_reduce_max_ps(top);
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 top = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(row + t));
    m = hmax8(top);
  }
#endif
  for (; t < n; ++t) m = std::max(m, row[t]);
  t = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), mv));
    _mm512_storeu_ps(row + t, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (t < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + t), mv)));
    _mm512_mask_storeu_ps(row + t, k, e);
    acc = _mm512_add_ps(acc, e);
    t = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), mv));
    _mm256_storeu_ps(row + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (t < n) {  // the tail: lanes past n read and written as nothing, added as 0
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - t)), lane);
    const __m256 e = _mm256_and_ps(_mm256_castsi256_ps(k), exp8(_mm256_sub_ps(_mm256_maskload_ps(row + t, k), mv)));
    _mm256_maskstore_ps(row + t, k, e);
    acc = _mm256_add_ps(acc, e);
    t = n;
  }
  sum = hsum8(acc);
#endif
  for (; t < n; ++t) sum += (row[t] = std::exp(row[t] - m));
  const float inv = 1.0f / sum;
  for (int64_t u = 0; u < n; ++u) row[u] *= inv;
}

// out[0..d) += sum over the block's first n tokens of p[t] * value(t) (float): "vec" values (bs, d) token-major;
// "amx" values (d / 16, bs / 2, 16, 2): [c / 16, t / 2, c % 16, t % 2], a channel's token pair one 32-bit word. Only
// the first n tokens are read (a slot past the request's entries may hold anything)
template <typename T>
static inline void block_values(const T* __restrict__ values, const float* __restrict__ p, int64_t n, int64_t bs,
                                int64_t d, bool amx, float* __restrict__ out) {
  if (!amx) {
    for (int64_t t = 0; t < n; ++t) {
      const T* __restrict__ v = values + t * d;
      const float pt = p[t];
      for (int64_t c = 0; c < d; ++c) out[c] += pt * as_float(v[c]);
    }
    return;
  }
  const uint32_t* __restrict__ words = reinterpret_cast<const uint32_t*>(values);
  for (int64_t tile = 0; tile < d / 16; ++tile) {
    float* __restrict__ o = out + tile * 16;
    for (int64_t pair = 0; 2 * pair < n; ++pair) {
      const uint32_t* __restrict__ w = words + (tile * (bs / 2) + pair) * 16;
      const float p0 = p[2 * pair];
      if (2 * pair + 1 < n) {
        const float p1 = p[2 * pair + 1];
        for (int64_t j = 0; j < 16; ++j) o[j] += p0 * bits_float(w[j] << 16) + p1 * bits_float(w[j] & 0xFFFF0000u);
      } else {
        for (int64_t j = 0; j < 16; ++j) o[j] += p0 * bits_float(w[j] << 16);
      }
    }
  }
}

// probs[r, i, :lengths[r]] = softmax(T(T(logits) * scale)) in float, rounded to T (kvtrim.attention.
// softmax_probabilities' steps); 0 past lengths[r]. With attn (not null): attn[r, i, :] = those rounded probabilities
// times the request's values, summed in float and rounded to T (probs @ values, as kvtrim's attention function in
// transformers computes a layer's output from them). One task per request and KV head: its query heads' whole rows.
template <typename T>
static void run_probs(const T* cache, int64_t block_stride, int64_t head_stride, int64_t h, int64_t bs, int64_t d,
                      const int64_t* table, const int64_t* lengths, int64_t r_count, int64_t u_count, const T* query,
                      int64_t q_heads, float scale, bool amx, T* out, T* attn) {
  const int64_t group = q_heads / h, width = u_count * bs;
  at::parallel_for(0, r_count * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(d), row(width), acc(d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv_head = item % h, r = item / h, n = lengths[r], used = (n + bs - 1) / bs;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t i = kv_head * group + g;
        const T* qrow = query + (r * q_heads + i) * d;
        for (int64_t c = 0; c < d; ++c) q[c] = as_float(qrow[c]);
        for (int64_t u = 0; u < used; ++u) {
          const T* keys = cache + table[r * u_count + u] * block_stride + kv_head * head_stride;
          block_logits(keys, q.data(), qrow, bs, d, amx, row.data() + u * bs);
        }
        float* __restrict__ x = row.data();
        for (int64_t t = 0; t < n; ++t) x[t] = rounded<T>(rounded<T>(x[t]) * scale);
        softmax_row(x, n);
        for (int64_t t = 0; t < n; ++t) x[t] = rounded<T>(x[t]);
        T* o = out + (r * q_heads + i) * width;
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          uint16_t* __restrict__ o16 = reinterpret_cast<uint16_t*>(o);
          for (int64_t t = 0; t < n; ++t) o16[t] = static_cast<uint16_t>(float_bits(x[t]) >> 16);
        } else {
          std::memcpy(o, x, n * sizeof(float));
        }
        std::fill(o + n, o + width, static_cast<T>(0.0f));
        if (attn == nullptr) continue;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t u = 0; u < used; ++u) {  // the value half follows the key half in each (block, head) slab
          const T* values = cache + table[r * u_count + u] * block_stride + kv_head * head_stride + bs * d;
          block_values(values, x + u * bs, std::min(bs, n - u * bs), bs, d, amx, acc.data());
        }
        T* a = attn + (r * q_heads + i) * d;
        for (int64_t c = 0; c < d; ++c) a[c] = static_cast<T>(acc[c]);
      }
    }
  });
}

// what both entry points need of their inputs
static void check_inputs(const torch::Tensor& kv_cache, const torch::Tensor& query, bool amx) {
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.stride(3) == 1 && kv_cache.stride(2) == kv_cache.size(3)
              && kv_cache.stride(1) == kv_cache.size(2) * kv_cache.size(3), "kv_cache: (blocks, h, bs, 2d), slabs contiguous");
  TORCH_CHECK(query.is_contiguous() && query.scalar_type() == kv_cache.scalar_type(), "query: contiguous, the cache's dtype");
  TORCH_CHECK(!amx || kv_cache.scalar_type() == at::kBFloat16, "the amx packing holds bfloat16 only");
}

// the probabilities `(R, q_heads, U * bs)` and, when `with_attention`, the attention output `(R, q_heads, d)` (else
// an empty tensor)
std::vector<torch::Tensor> table_key_probs(torch::Tensor kv_cache, torch::Tensor block_table, torch::Tensor query,
                                           torch::Tensor lengths, double scale, bool amx, bool with_attention) {
  check_inputs(kv_cache, query, amx);
  auto table = block_table.contiguous();
  auto lens = lengths.to(at::kLong).contiguous();
  const int64_t h = kv_cache.size(1), bs = kv_cache.size(2), d = kv_cache.size(3) / 2;
  const int64_t r_count = table.size(0), u_count = table.size(1), q_heads = query.size(1);
  TORCH_CHECK(lens.numel() == r_count, "lengths: one per row of the block table");
  for (int64_t r = 0; r < r_count; ++r)
    TORCH_CHECK(lens.data_ptr<int64_t>()[r] >= 1 && lens.data_ptr<int64_t>()[r] <= u_count * bs, "a length past its blocks");
  auto out = torch::empty({r_count, q_heads, u_count * bs}, kv_cache.options());
  auto attn = torch::empty({with_attention ? r_count : 0, q_heads, d}, kv_cache.options());
  const float s = static_cast<float>(scale);
  if (kv_cache.scalar_type() == at::kBFloat16) {
    run_probs(kv_cache.data_ptr<c10::BFloat16>(), kv_cache.stride(0), kv_cache.stride(1), h, bs, d,
              table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), r_count, u_count,
              query.data_ptr<c10::BFloat16>(), q_heads, s, amx, out.data_ptr<c10::BFloat16>(),
              with_attention ? attn.data_ptr<c10::BFloat16>() : nullptr);
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat, "kv_cache: float32 or bfloat16");
    run_probs(kv_cache.data_ptr<float>(), kv_cache.stride(0), kv_cache.stride(1), h, bs, d, table.data_ptr<int64_t>(),
              lens.data_ptr<int64_t>(), r_count, u_count, query.data_ptr<float>(), q_heads, s, amx,
              out.data_ptr<float>(), with_attention ? attn.data_ptr<float>() : nullptr);
  }
  return {out, attn};
}

torch::Tensor table_key_logits(torch::Tensor kv_cache, torch::Tensor block_table, torch::Tensor query, bool amx) {
  check_inputs(kv_cache, query, amx);
  auto table = block_table.contiguous();
  const int64_t h = kv_cache.size(1), bs = kv_cache.size(2), d = kv_cache.size(3) / 2;
  const int64_t r_count = table.size(0), u_count = table.size(1), q_heads = query.size(1);
  auto out = torch::empty({r_count, q_heads, u_count * bs}, kv_cache.options());
  if (kv_cache.scalar_type() == at::kBFloat16) {
    run(kv_cache.data_ptr<c10::BFloat16>(), kv_cache.stride(0), kv_cache.stride(1), h, bs, d, table.data_ptr<int64_t>(),
        r_count, u_count, query.data_ptr<c10::BFloat16>(), q_heads, amx, out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(kv_cache.scalar_type() == at::kFloat, "kv_cache: float32 or bfloat16");
    run(kv_cache.data_ptr<float>(), kv_cache.stride(0), kv_cache.stride(1), h, bs, d, table.data_ptr<int64_t>(), r_count,
        u_count, query.data_ptr<float>(), q_heads, amx, out.data_ptr<float>());
  }
  return out;
}
"""

#: the layouts the kernel reads, by module: True for "amx"'s packing
KERNEL_LAYOUTS = {cpu_vec: False, layout_amx: True}


#: the longest a worker waits for the kernel (another worker's build included) before it goes on with the torch
#: functions; a first build takes ~30 s
BUILD_TIMEOUT_S = 300.0


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """The built kernel module (built once per machine and Python environment: PyTorch caches it) and one line
    saying how, or None and why not (no compiler, a build that failed or took over `BUILD_TIMEOUT_S`)."""
    start = time.perf_counter()
    try:
        module, stale = _within(functools.partial(build, kernel_name()), BUILD_TIMEOUT_S)
    except Exception as err:  # noqa: BLE001 - no compiler, no headers, too slow: the torch functions do the work
        return None, f"kvtrim's C++ kernel did not build ({one_line(err)[:200]})"
    removed = "; a build killed half-way had left its lock: removed" if stale else ""
    return module, f"kvtrim's C++ kernel (loaded in {time.perf_counter() - start:.1f} s{removed})"


def kernel_name() -> str:
    """The kernel's extension name: its source, the kind of CPU (`-march=native`), the Python environment and torch
    (the build flags name the environment's include paths: two environments sharing one name rebuild it in turn)."""
    machine = hashlib.sha1(f"{_cpu_model()}|{sys.prefix}|{torch.__version__}".encode()).hexdigest()[:8]
    return f"kvtrim_step_logits_{hashlib.sha1(_SOURCE.encode()).hexdigest()[:8]}_{machine}"


def build(name: str, source: str = _SOURCE, functions: tuple[str, ...] = ("table_key_logits", "table_key_probs")) -> tuple[ModuleType, bool]:
    """Build (or load, when built) `source` as extension `name` in its own folder under PyTorch's extension root,
    one process at a time, and whether a lock left by a build killed half-way was removed first.

    PyTorch guards a build folder with a `lock` file a killed build leaves behind, on which every later build waits
    forever. Here every build of the folder holds an OS lock on `build.lock` first (released by the OS when its
    process dies): under it no other build runs, so a `lock` found is a dead build's."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = os.path.join(root, "kvtrim", name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "build.lock"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        stale = os.path.exists(os.path.join(folder, "lock"))
        if stale:
            os.remove(os.path.join(folder, "lock"))
        module = cpp_extension.load_inline(name, cpp_sources=source, functions=list(functions),
                                           extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                           extra_ldflags=["-fopenmp"], build_directory=folder, verbose=False)
    return module, stale


def _within(fn: Callable, timeout_s: float):
    """`fn()` run in a thread, its result within `timeout_s` seconds or TimeoutError (the thread is left to finish:
    a build that ends later is cached for the next start)."""
    out: list = []

    def run():
        try:
            out.append((True, fn()))
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            out.append((False, err))

    thread = threading.Thread(target=run, name="kvtrim-kernel-build", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not out:
        raise TimeoutError(f"not built within {timeout_s:.0f} s")
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return ""


def _kernel(layout: ModuleType) -> tuple[ModuleType | None, str]:
    """The built kernel module for `layout` and one line naming what computes its step's numbers (for the worker's
    log), or None and why torch does instead."""
    if layout not in KERNEL_LAYOUTS:
        return None, "torch ops (the kernel reads vLLM's CPU layouts only)"
    module, how = load()
    return module, how if module is not None else f"torch ops: {how}"


def table_key_logits(layout: ModuleType) -> tuple[Callable, str]:
    """The function computing a layer's decode-step logits on `layout`'s blocks, with the signature of
    `kvtrim.vllm.layout.table_key_logits`: the kernel's for the CPU layouts it reads, else the layout's own; and
    one line naming it (for the worker's log)."""
    module, how = _kernel(layout)
    if module is None:
        return layout.table_key_logits, how
    amx = KERNEL_LAYOUTS[layout]

    def kernel_logits(kv_cache: torch.Tensor, block_table: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        return module.table_key_logits(kv_cache, block_table, query.contiguous(), amx)

    return kernel_logits, how


def table_key_probs(layout: ModuleType) -> tuple[Callable, str]:
    """The function computing a layer's decode-step probabilities on `layout`'s blocks, `fn(kv_cache, block_table
    (R, U), query (R, q_heads, head_dim), lengths (R,), scale)` -> `(R, q_heads, U * block_size)` in the cache's dtype,
    slot order: row `r`'s first `lengths[r]` entries get `softmax_probabilities`' probabilities of the query over
    them (the logits rounded to the cache's dtype, scaled, softmax in float32, rounded back), the rest 0. The kernel's
    (its exp and sums in another order: within an ulp of torch's) for the CPU layouts it reads, else
    `torch_key_probs`; and one line naming it (for the worker's log)."""
    module, how = _kernel(layout)
    if module is None:
        return torch_key_probs(layout), how
    amx = KERNEL_LAYOUTS[layout]

    def kernel_probs(kv_cache, block_table, query, lengths, scale):
        return module.table_key_probs(kv_cache, block_table, query.contiguous(), lengths, scale, amx, False)[0]

    return kernel_probs, how


def table_attention(layout: ModuleType) -> Callable | None:
    """The kernel's function computing a layer's decode-step probabilities (`table_key_probs`' function) and, in the
    same pass over each request's blocks, the attention output `(R, q_heads, head_dim)`: those probabilities (as
    rounded to the cache's dtype) times the request's values, summed in float32, rounded to the cache's dtype (what
    kvtrim's attention function computes in transformers); `fn(...)` -> `(probs, output)`. None where the kernel does
    not read `layout` or did not build (the backend then runs vLLM's attention and `table_key_probs` after it)."""
    module, _ = _kernel(layout)
    if module is None:
        return None
    amx = KERNEL_LAYOUTS[layout]

    def kernel_attention(kv_cache, block_table, query, lengths, scale):
        return tuple(module.table_key_probs(kv_cache, block_table, query.contiguous(), lengths, scale, amx, True))

    return kernel_attention


def torch_key_probs(layout: ModuleType) -> Callable:
    """`table_key_probs`' function in torch: `softmax_probabilities` on the layout's logits, past each length masked."""

    def torch_probs(kv_cache, block_table, query, lengths, scale):
        logits = layout.table_key_logits(kv_cache, block_table, query)
        inside = torch.arange(logits.shape[-1]) < lengths[:, None]
        probs = softmax_probabilities(logits[:, :, None], inside[:, None, None], scale)[:, :, 0]
        return probs.masked_fill_(~inside[:, None], 0)

    return torch_probs
