// Decode attention reading each row's own tokens only, through the engine's paged KV
// cache: the variable-length kernel SDPA lacks on CPU. One query token per row; float32.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vec.h"

// Decode attention through a paged cache: the engine's path. One query token per row.
//
//   q      [rows, q_heads, dim], contiguous
//   k, v   [blocks, block_size, kv_heads, dim] pools, each token's heads contiguous
//   table  [rows, max_blocks] int32: row r's i-th block of block_size tokens
//   lens   [rows] int64: row r attends to its first lens[r] tokens; 0 = dead slot
//
// Returns [rows, q_heads, dim] (zeros for dead slots). One pass over each row's blocks for
// all its heads, with a running softmax rescaled once per block; rows split over threads
// at equal shares of tokens.
//
// Blocks read from cache (a shared prompt prefix, read by many rows) leave only arithmetic,
// so a block's work is laid out for throughput: scores of 8 tokens at once in
// independent accumulators (one dependent FMA chain per token-head was latency-bound),
// each head's scores in one array so exp runs over 8 lanes, and the value sum keeps a
// head's accumulator in registers over several tokens. With AVX2+FMA and dim % 8 == 0;
// other builds and dims run the same steps as plain loops.
namespace paged {

// Tokens per step of the score and value loops: 8 keys fill one score vector, and 8
// tokens of every head (8 KB at 4 kv heads of dim 64) stay in L1 between the heads.
constexpr int64_t kChunk = 8;

// f(std::integral_constant<int, n>{}) for n registers (1 to 8): the accumulator loops take
// their register count as a template argument, so the accumulators stay in registers.
template <typename F>
inline void with_registers(int64_t n, F&& f) {
  switch (n) {
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kVector = true;

// [sum(a0), ..., sum(a7)]: the 8 token accumulators of one head reduced in one pass.
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                    __m256 a6, __m256 a7) {
  const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
  const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

using vec::exp8;
using vec::hmax;
using vec::hsum;

// acc[0, 8 NV) += sum over `count` tokens of w[j] * v[j]: NV independent FMA chains with
// the accumulator in registers, loaded and stored once per call rather than per token.
template <int NV>
inline void add_values(float* acc, const float* w, const float* v, int64_t vt,
                       int64_t count) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int64_t j = 0; j < count; ++j) {
    const __m256 wj = _mm256_broadcast_ss(w + j);
    const float* vj = v + j * vt;
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#else
constexpr bool kVector = false;
#endif

#if defined(__AVX512F__)
// With AVX-512 a head of dim 64 is 4 registers instead of 8: half the instructions for
// the same products. Prompt-prefix blocks shared by many rows are in cache, so there the
// kernel is bound by instructions, not memory.
constexpr bool kWide = true;

// The 16 lanes of a folded into 8 (lo + hi), for the 8-lane reductions above.
inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// Like add_values; a head of up to 4 registers alternates two sets of accumulators over
// the tokens, so 8 FMA chains hide the FMA latency (4 chains left it waiting).
template <int NV>
inline void add_values16(float* acc, const float* w, const float* v, int64_t vt,
                         int64_t count) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  int64_t j = 0;
  if constexpr (NV <= 4) {
    __m512 b[NV];
    for (int i = 0; i < NV; ++i) b[i] = _mm512_setzero_ps();
    for (; j + 1 < count; j += 2) {
      const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[j + 1]);
      const float* v0 = v + j * vt;
      const float* v1 = v0 + vt;
      for (int i = 0; i < NV; ++i) {
        a[i] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v0 + 16 * i), a[i]);
        b[i] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v1 + 16 * i), b[i]);
      }
    }
    for (int i = 0; i < NV; ++i) a[i] = _mm512_add_ps(a[i], b[i]);
  }
  for (; j < count; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j]);
    const float* vj = v + j * vt;
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vj + 16 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#else
constexpr bool kWide = false;
#endif

// The shape of one call, as the block steps below need it.
struct Step {
  int64_t hq, group, d, kt, vt, stride;  // stride: one head's scores (block_size, rounded up)
  float scale;
  bool vector;  // the AVX2 loops (dim % 8 == 0)
  bool wide;    // their AVX-512 form (dim % 16 == 0)
  // Value heads may be narrower or wider than key heads (multi-head latent attention).
  int64_t dv = 0;
  bool vvector = false, vwide = false;  // the same two for the value width
};

// Tokens [j0, j1) of the data read next (`ahead`, `ahead_tokens` tokens of `row` floats;
// null when none), asked for a chunk at a time while this block is computed. Into L2
// (prefetcht1): into L1 measured slower, and so did requests spread finer or a fixed
// few KB ahead; a block ahead, a chunk at a time, measured best here.
inline void prefetch(const float* ahead, int64_t ahead_tokens, int64_t row, int64_t j0,
                     int64_t j1) {
  if (ahead == nullptr) return;
  const int64_t end = std::min(j1, ahead_tokens) * row;
  for (int64_t c = j0 * row; c < end; c += 16) __builtin_prefetch(ahead + c, 0, 2);
}

// s[h * stride + j] = scale * q_h . k_j for the block's `stop` tokens; -inf up to the next
// multiple of 8, so the exp and sums below run over whole vectors. Prefetches this block's
// values meanwhile (vb).
inline void scores(const Step& p, const float* qr, const float* kb, int64_t stop,
                   const float* vb, float* s) {
  const int64_t padded = (stop + kChunk - 1) / kChunk * kChunk;
#if defined(__AVX2__) && defined(__FMA__)
  if (p.vector) {
    const __m256 sc = _mm256_set1_ps(p.scale);
    for (int64_t j0 = 0; j0 < stop; j0 += kChunk) {
      prefetch(vb, stop, p.vt, j0, j0 + kChunk);
      // A short last chunk repeats its last token; those lanes are overwritten below.
      const float* kj[kChunk];
      for (int64_t t = 0; t < kChunk; ++t) kj[t] = kb + std::min(j0 + t, stop - 1) * p.kt;
      for (int64_t h = 0; h < p.hq; ++h) {
        const int64_t off = (h / p.group) * p.d;
        const float* qh = qr + h * p.d;
#if defined(__AVX512F__)
        if (p.wide) {
          __m512 b0 = _mm512_setzero_ps(), b1 = b0, b2 = b0, b3 = b0, b4 = b0, b5 = b0,
                 b6 = b0, b7 = b0;
          for (int64_t x = off; x < off + p.d; x += 16) {
            const __m512 qv = _mm512_loadu_ps(qh + x - off);
            b0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[0] + x), b0);
            b1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[1] + x), b1);
            b2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[2] + x), b2);
            b3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[3] + x), b3);
            b4 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[4] + x), b4);
            b5 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[5] + x), b5);
            b6 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[6] + x), b6);
            b7 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj[7] + x), b7);
          }
          _mm256_storeu_ps(s + h * p.stride + j0,
                           _mm256_mul_ps(sc, hsum8(fold(b0), fold(b1), fold(b2), fold(b3),
                                                   fold(b4), fold(b5), fold(b6), fold(b7))));
          continue;
        }
#endif
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0,
               a6 = a0, a7 = a0;
        for (int64_t x = off; x < off + p.d; x += 8) {
          const __m256 qv = _mm256_loadu_ps(qh + x - off);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[0] + x), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[1] + x), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[2] + x), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[3] + x), a3);
          a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[4] + x), a4);
          a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[5] + x), a5);
          a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[6] + x), a6);
          a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj[7] + x), a7);
        }
        _mm256_storeu_ps(s + h * p.stride + j0,
                         _mm256_mul_ps(sc, hsum8(a0, a1, a2, a3, a4, a5, a6, a7)));
      }
    }
  } else
#endif
  {
    prefetch(vb, stop, p.vt, 0, stop);
    for (int64_t h = 0; h < p.hq; ++h) {
      const float* qh = qr + h * p.d;
      for (int64_t j = 0; j < stop; ++j) {
        const float* kh = kb + j * p.kt + (h / p.group) * p.d;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t x = 0; x < p.d; ++x) dot += qh[x] * kh[x];
        s[h * p.stride + j] = dot * p.scale;
      }
    }
  }
  for (int64_t h = 0; h < p.hq; ++h) {
    std::fill(s + h * p.stride + stop, s + h * p.stride + padded, -INFINITY);
  }
}

// The block's scores become weights exp(s - top): the running maximum `top` moves to the
// block's peak first, rescaling the head's sum and accumulator once per block.
inline void weights(const Step& p, int64_t stop, float* s, float* acc, float* top,
                    float* sum) {
  const int64_t padded = (stop + kChunk - 1) / kChunk * kChunk;
  for (int64_t h = 0; h < p.hq; ++h) {
    float* sh = s + h * p.stride;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 m = _mm256_set1_ps(top[h]);
    for (int64_t j = 0; j < padded; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(sh + j));
    const float peak = hmax(m);
#else
    float peak = top[h];
    for (int64_t j = 0; j < stop; ++j) peak = std::max(peak, sh[j]);
#endif
    if (peak > top[h]) {
      const float c = std::exp(top[h] - peak);
      float* ah = acc + h * p.dv;
      sum[h] *= c;
#pragma omp simd
      for (int64_t x = 0; x < p.dv; ++x) ah[x] *= c;
      top[h] = peak;
    }
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 t = _mm256_set1_ps(top[h]);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < padded; j += 8) {
      const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), t));
      _mm256_storeu_ps(sh + j, w);
      total = _mm256_add_ps(total, w);
    }
    sum[h] += hsum(total);
#else
    float total = 0.f;
    for (int64_t j = 0; j < padded; ++j) {
      sh[j] = std::exp(sh[j] - top[h]);
      total += sh[j];
    }
    sum[h] += total;
#endif
  }
}

// acc_h += sum over the block's tokens of w_hj * v_j, 8 tokens at a time for all heads.
// Prefetches the keys read next meanwhile (nk: `next` tokens of the next block, or null).
inline void values(const Step& p, const float* vb, int64_t stop, const float* s,
                   const float* nk, int64_t next, float* acc) {
  const int64_t chunks = (stop + kChunk - 1) / kChunk;
  for (int64_t j0 = 0; j0 < stop; j0 += kChunk) {
    const int64_t count = std::min(kChunk, stop - j0);
    // The next keys spread over this block's chunks (a short block asks for more each).
    const int64_t c = j0 / kChunk, per = (next + chunks - 1) / chunks;
    prefetch(nk, next, p.kt, c * per, (c + 1) * per);
    for (int64_t h = 0; h < p.hq; ++h) {
      const float* w = s + h * p.stride + j0;
      const float* vh = vb + j0 * p.vt + (h / p.group) * p.dv;
      float* ah = acc + h * p.dv;
#if defined(__AVX2__) && defined(__FMA__)
#if defined(__AVX512F__)
      if (p.vwide) {
        // 128 floats (8 registers) at a time; the rest of the head in one smaller step.
        for (int64_t x = 0; x < p.dv; x += 128) {
          with_registers(std::min<int64_t>(8, (p.dv - x) / 16), [&](auto nv) {
            add_values16<decltype(nv)::value>(ah + x, w, vh + x, p.vt, count);
          });
        }
        continue;
      }
#endif
      if (p.vvector) {
        // 64 floats (8 registers) at a time; the rest of the head in one smaller step.
        for (int64_t x = 0; x < p.dv; x += 64) {
          with_registers(std::min<int64_t>(8, (p.dv - x) / 8), [&](auto nv) {
            add_values<decltype(nv)::value>(ah + x, w, vh + x, p.vt, count);
          });
        }
        continue;
      }
#endif
      for (int64_t j = 0; j < count; ++j) {
        const float wj = w[j];
        const float* vj = vh + j * p.vt;
#pragma omp simd
        for (int64_t x = 0; x < p.dv; ++x) ah[x] += wj * vj[x];
      }
    }
  }
}

#if defined(__AVX512F__)
// Rows read together when they start on the same full blocks: 3 rows' scores of 8 tokens
// are 24 accumulators, within AVX-512's 32 registers with the queries and a key.
constexpr int kTile = 3;

// scores() for R rows on the same block (a shared prompt prefix): each key is loaded once
// for all R queries. Full blocks only (stop == block size, a multiple of 8).
template <int R>
inline void scores_tile(const Step& p, const float* const* q, const float* kb, int64_t stop,
                        float* const* s) {
  const __m256 sc = _mm256_set1_ps(p.scale);
  for (int64_t j0 = 0; j0 < stop; j0 += kChunk) {
    const float* kj = kb + j0 * p.kt;
    for (int64_t h = 0; h < p.hq; ++h) {
      const int64_t off = (h / p.group) * p.d;
      __m512 a[R][kChunk];
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < kChunk; ++t) a[r][t] = _mm512_setzero_ps();
      for (int64_t x = off; x < off + p.d; x += 16) {
        __m512 qv[R];
        for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_ps(q[r] + h * p.d + x - off);
        for (int t = 0; t < kChunk; ++t) {
          const __m512 k = _mm512_loadu_ps(kj + t * p.kt + x);
          for (int r = 0; r < R; ++r) a[r][t] = _mm512_fmadd_ps(qv[r], k, a[r][t]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 sums = hsum8(fold(a[r][0]), fold(a[r][1]), fold(a[r][2]), fold(a[r][3]),
                                  fold(a[r][4]), fold(a[r][5]), fold(a[r][6]), fold(a[r][7]));
        _mm256_storeu_ps(s[r] + h * p.stride + j0, _mm256_mul_ps(sc, sums));
      }
    }
  }
}

// values() for R rows on the same block: each value loaded once for all R. NV registers
// per head and row (a compile-time count, so the accumulators stay in registers: with a
// runtime count they lived on the stack, a store and a load per token). Each row's sums
// are add_values16's, in its order (8-token chunks, token pairs in two accumulators
// added at the chunk's end), so a row's bits do not depend on whether it was read in a
// tile: the batch-invariant steps read prompts' tokens in tiles too.
template <int R, int NV>
inline void values_head(const float* const* w, const float* vh, int64_t vt, int64_t stop,
                        float* const* acc) {
  static_assert(NV <= 4, "add_values16's paired order is for heads of up to 4 registers");
  __m512 a[R][NV], b[R][NV];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + 16 * i);
  for (int64_t j0 = 0; j0 < stop; j0 += kChunk) {
    const int64_t end = std::min(j0 + kChunk, stop);
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) b[r][i] = _mm512_setzero_ps();
    int64_t j = j0;
    for (; j + 1 < end; j += 2) {
      const float* v0 = vh + j * vt;
      const float* v1 = v0 + vt;
      for (int i = 0; i < NV; ++i) {
        const __m512 x0 = _mm512_loadu_ps(v0 + 16 * i), x1 = _mm512_loadu_ps(v1 + 16 * i);
        for (int r = 0; r < R; ++r) {
          a[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j]), x0, a[r][i]);
          b[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j + 1]), x1, b[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_add_ps(a[r][i], b[r][i]);
    for (; j < end; ++j) {
      const float* vj = vh + j * vt;
      for (int i = 0; i < NV; ++i) {
        const __m512 x = _mm512_loadu_ps(vj + 16 * i);
        for (int r = 0; r < R; ++r)
          a[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[r][j]), x, a[r][i]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + 16 * i, a[r][i]);
}

// Heads of 16 to 64 dims (a multiple of 16).
template <int R>
inline void values_tile(const Step& p, const float* vb, int64_t stop, float* const* s,
                        float* const* acc) {
  for (int64_t h = 0; h < p.hq; ++h) {
    const float* w[R];
    float* a[R];
    for (int r = 0; r < R; ++r) {
      w[r] = s[r] + h * p.stride;
      a[r] = acc[r] + h * p.d;
    }
    const float* vh = vb + (h / p.group) * p.d;
    switch (p.d / 16) {  // tiles take heads of 16 to 64 dims
      case 4: values_head<R, 4>(w, vh, p.vt, stop, a); break;
      case 3: values_head<R, 3>(w, vh, p.vt, stop, a); break;
      case 2: values_head<R, 2>(w, vh, p.vt, stop, a); break;
      default: values_head<R, 1>(w, vh, p.vt, stop, a); break;
    }
  }
}
#endif

}  // namespace paged

// Per layer, what some architectures add to plain attention (all off by default):
//   window  > 0: row r attends to its last `window` tokens only (a sliding window, the
//                query's own token included, as transformers counts it)
//   softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
//   sinks   [q_heads] float32: one more logit per head in the softmax's denominator,
//                with no value (gpt-oss attention sinks)
//   tiles  whether rows that start on the same blocks may be read together (AVX-512):
//          a row's bits are the same either way (values_head sums in add_values16's
//          order); false reads every row alone, to measure what the tiles save.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                     torch::Tensor table, torch::Tensor lens, double scale,
                                     int64_t window, double softcap,
                                     std::optional<torch::Tensor> sinks, bool tiles) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32,
              "paged_decode_attention: float32 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4 && table.dim() == 2,
              "paged_decode_attention: shapes");
  TORCH_CHECK(q.is_contiguous(), "paged_decode_attention: q must be contiguous");
  const int64_t rows = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t nblocks = k.size(0), bs = k.size(1), hkv = k.size(2), dv = v.size(3);
  TORCH_CHECK(v.size(0) == nblocks && v.size(1) == bs && v.size(2) == hkv && k.size(3) == d &&
                  hq % hkv == 0,
              "paged_decode_attention: pool shape");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1 && k.stride(2) == d && v.stride(2) == dv,
              "paged_decode_attention: each token's heads must be contiguous");
  torch::Tensor sink;
  if (sinks.has_value()) {
    sink = sinks->to(torch::kFloat32).contiguous();
    TORCH_CHECK(sink.numel() == hq, "paged_decode_attention: one sink per query head");
  }
  const float* sp = sinks.has_value() ? sink.data_ptr<float>() : nullptr;
  const float cap = static_cast<float>(softcap);
  auto tab = table.to(torch::kInt32).contiguous();
  auto lens64 = lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(tab.size(0) >= rows && lens64.numel() == rows,
              "paged_decode_attention: one table row and one length per row");
  const int64_t width = tab.size(1);
  const int32_t* tp = tab.data_ptr<int32_t>();
  const int64_t* len = lens64.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(len[r] >= 0 && len[r] <= width * bs, "paged_decode_attention: length");
    for (int64_t b = 0; b < (len[r] + bs - 1) / bs; ++b) {
      const int32_t blk = tp[r * width + b];
      TORCH_CHECK(blk >= 0 && blk < nblocks, "paged_decode_attention: block out of range");
    }
  }
  // The first token row r reads: its window's start (0 without a window).
  auto window_start = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, len[r] - window) : 0;
  };
  auto out = torch::zeros({rows, hq, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kb0 = k.stride(0), vb0 = v.stride(0);
  const int64_t stride = (bs + paged::kChunk - 1) / paged::kChunk * paged::kChunk;
  const paged::Step p{hq,
                      hq / hkv,
                      d,
                      k.stride(1),
                      v.stride(1),
                      stride,
                      static_cast<float>(scale),
                      paged::kVector && d % 8 == 0,
                      paged::kWide && d % 16 == 0,
                      dv,
                      paged::kVector && dv % 8 == 0,
                      paged::kWide && dv % 16 == 0};
  // One item per row, all heads together: a block holds every head of its tokens side by
  // side, so its keys (then values) are read once, front to back in 8-token chunks. One
  // head at a time over the whole block strided through it, which measured 2-3x slower.
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) total += len[r] - window_start(r);
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(rows, 4 * at::get_num_threads()));
  std::vector<int64_t> bounds(parts + 1, rows);
  bounds[0] = 0;
  int64_t seen = 0, part = 1;
  for (int64_t r = 0; r < rows && part < parts; ++r) {
    seen += len[r] - window_start(r);
    while (part < parts && seen * parts >= total * part) bounds[part++] = r + 1;
  }
  // Up to three consecutive rows starting on the same full blocks (a shared prompt
  // prefix) read those blocks together, each key and value loaded once for all of them
  // (AVX-512, heads of 16 to 64 dims): there the kernel is bound by instructions, not
  // memory.
  tiles = tiles && p.wide && d <= 64 && dv == d && bs % paged::kChunk == 0 && window <= 0 &&
          cap <= 0.f;
  constexpr int64_t kStates = 3;
  at::parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    std::vector<float> acc(kStates * hq * std::max(d, dv)), top(kStates * hq), sum(kStates * hq),
        s(kStates * hq * stride);
    const int64_t end = bounds[last];
    int64_t prev = -1;  // the last row this thread read
    // Blocks from the i0-th of row r, into state k of the buffers above.
    auto run = [&](int64_t r, int64_t i0, int64_t k) {
      const int64_t n = len[r];
      // The next row this thread reads: its first keys are prefetched during our last block.
      int64_t after = r + 1;
      while (after < end && len[after] == 0) ++after;
      const int32_t* blocks = tp + r * width;
      const float* qr = qp + r * hq * d;
      float *ak = acc.data() + k * hq * dv, *tk = top.data() + k * hq, *sk = sum.data() + k * hq;
      float* sc = s.data() + k * hq * stride;
      // Whether `row` also read our i-th block at the same place (a shared prompt prefix):
      // then it is still in cache, and prefetching it again measured 10-15 % slower.
      auto shared = [&](int64_t row, int64_t i) {
        return row >= 0 && len[row] > i * bs && tp[row * width + i] == blocks[i];
      };
      // From the row's first token in its window (or block i0), a block at a time; the
      // first block read may start inside it.
      for (int64_t pos = std::max(i0 * bs, window_start(r)); pos < n;) {
        const int64_t i = pos / bs, skip = pos % bs;
        const int64_t stop = std::min<int64_t>(bs - skip, n - pos);
        const float* kb = kp + blocks[i] * kb0 + skip * p.kt;
        const float* vb = vp + blocks[i] * vb0 + skip * p.vt;
        // Blocks lie anywhere in the pool, so the hardware cannot guess the next one: this
        // block's values are asked for while its keys are read, and the next keys (this
        // row's next block, else the next row's first) while the values are read, so
        // memory keeps streaming across block boundaries.
        const float* nk = nullptr;
        int64_t next = 0;
        if ((i + 1) * bs < n) {
          if (!shared(prev, i + 1)) nk = kp + blocks[i + 1] * kb0;
          next = std::min(bs, n - (i + 1) * bs);
        } else if (after < end && tp[after * width] != blocks[0]) {
          nk = kp + tp[after * width] * kb0;
          next = std::min(bs, len[after]);
        }
        paged::scores(p, qr, kb, stop, shared(prev, i) ? nullptr : vb, sc);
        if (cap > 0.f) {
          for (int64_t h = 0; h < hq; ++h) {
            float* sh = sc + h * p.stride;
            for (int64_t j = 0; j < stop; ++j) sh[j] = cap * std::tanh(sh[j] / cap);
          }
        }
        paged::weights(p, stop, sc, ak, tk, sk);
        paged::values(p, vb, stop, sc, nk, next, ak);
        pos = (i + 1) * bs;
      }
      prev = r;
    };
    auto reset = [&](int64_t k) {
      std::fill(acc.begin() + k * hq * dv, acc.begin() + (k + 1) * hq * dv, 0.f);
      std::fill(top.begin() + k * hq, top.begin() + (k + 1) * hq, -INFINITY);
      std::fill(sum.begin() + k * hq, sum.begin() + (k + 1) * hq, 0.f);
    };
    auto finish = [&](int64_t r, int64_t k) {
      for (int64_t h = 0; h < hq; ++h) {
        float inv = 1.f / sum[k * hq + h];
        if (sp != nullptr) {
          // The sink's weight joins the denominator, both relative to the larger peak.
          const float t = top[k * hq + h], m = std::max(t, sp[h]);
          const float c = std::exp(t - m);
          inv = c / (sum[k * hq + h] * c + std::exp(sp[h] - m));
        }
        const float* ah = acc.data() + (k * hq + h) * dv;
        float* oh = op + (r * hq + h) * dv;
        for (int64_t x = 0; x < dv; ++x) oh[x] = ah[x] * inv;
      }
    };
    // Full blocks at the start of rows r and o that are the same blocks.
    auto common = [&](int64_t r, int64_t o) {
      const int64_t full = std::min(len[r], len[o]) / bs;
      int64_t c = 0;
      while (c < full && tp[o * width + c] == tp[r * width + c]) ++c;
      return c;
    };
#if defined(__AVX512F__)
    // Rows r .. r+R-1 over their first `shared` blocks together, then each on its own.
    auto tile = [&](auto rows, int64_t r, int64_t shared) {
      constexpr int R = decltype(rows)::value;
      const float* q[R];
      float* sc[R];
      float* ac[R];
      for (int k = 0; k < R; ++k) {
        reset(k);
        q[k] = qp + (r + k) * hq * d;
        sc[k] = s.data() + k * hq * stride;
        ac[k] = acc.data() + k * hq * d;
      }
      for (int64_t i = 0; i < shared; ++i) {
        const int32_t blk = tp[r * width + i];
        paged::scores_tile<R>(p, q, kp + blk * kb0, bs, sc);
        for (int k = 0; k < R; ++k)
          paged::weights(p, bs, sc[k], ac[k], top.data() + k * hq, sum.data() + k * hq);
        paged::values_tile<R>(p, vp + blk * vb0, bs, sc, ac);
      }
      for (int k = 0; k < R; ++k) {
        run(r + k, shared, k);
        finish(r + k, k);
      }
    };
#endif
    for (int64_t r = bounds[first]; r < end; ++r) {
      if (len[r] == 0) continue;
#if defined(__AVX512F__)
      const int64_t two = tiles && r + 1 < end ? common(r, r + 1) : 0;
      const int64_t three = two > 0 && r + 2 < end ? std::min(two, common(r, r + 2)) : 0;
      if (three > 0) {
        tile(std::integral_constant<int, paged::kTile>{}, r, three);
        r += paged::kTile - 1;
        continue;
      }
      if (two > 0) {
        tile(std::integral_constant<int, 2>{}, r, two);
        r += 1;
        continue;
      }
#endif
      reset(0);
      run(r, 0, 0);
      finish(r, 0);
    }
  });
  return out;
}
