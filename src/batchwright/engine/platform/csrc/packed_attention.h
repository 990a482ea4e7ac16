// Attention of packed inputs over their own tokens, no KV cache: the embedding engine's
// CPU path (engine/embed/attention.py). Every input of a forward in one call, both ways
// (an encoder) or causally (a decoder embedding model); float32.
//
// SDPA's CPU flash kernel runs QK^T and PV as GEMM calls on blocks of 32-256 queries; at
// a head dim of 32 to 64 those products are too thin for the GEMM to reach its speed
// (on an Intel core, under half of a linear layer's GFLOP/s at the embedding bench's
// head dim of 32; on an AMD EPYC about 60 %). Here a block
// of 8 queries keeps its scores for the whole input (the inputs are at most a few
// thousand tokens: 8 rows of scores fit in L1/L2), so there is no running rescale: QK^T
// in registers over the head dim, one max and one exp pass per row, then PV with the
// 8 rows' outputs in registers over the keys. Keys are transposed once per input and
// head so the score loop reads whole vectors. On an AMD EPYC core (AVX-512), against SDPA
// on runs of equal lengths: 1.1x at 128-512 keys both ways, 1.3-1.9x causal (docs/
// embeddings.md has the end-to-end figures).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace packed {

#if defined(__AVX512F__)
// Queries per block: R rows x 2 vectors of keys (or of the head dim) = 2 R accumulators,
// with room left for the loads (32 registers here, 16 with AVX2).
constexpr int R = 8;
constexpr int W = 16;
using VF = __m512;
inline VF load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, VF a) { _mm512_storeu_ps(p, a); }
inline VF splat(float x) { return _mm512_set1_ps(x); }
inline VF zero() { return _mm512_setzero_ps(); }
inline VF fma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
inline VF add(VF a, VF b) { return _mm512_add_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm512_sub_ps(a, b); }
inline VF mul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline float hmax(VF a) { return _mm512_reduce_max_ps(a); }
inline float hsum(VF a) { return _mm512_reduce_add_ps(a); }
// 2^x on 16 lanes for x <= 0 (scores in log2 units less their row's maximum): n =
// round(x), 2^(x - n) by a degree-6 polynomial on [-1/2, 1/2] (about 1 ulp), 2^n applied
// by vscalefps; 0 below -126 (-inf, a masked key, included).
inline VF exp2(VF x) {
  const VF lo = _mm512_set1_ps(-126.f);
  const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const VF n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const VF r = _mm512_sub_ps(x, n);
  VF y = _mm512_set1_ps(1.535336188319500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.339887440266574e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(9.618437357674640e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.550332471162809e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(2.402264791363012e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(6.931472028550421e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(keep, y, n);
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int R = 6;
constexpr int W = 8;
using VF = __m256;
inline VF load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, VF a) { _mm256_storeu_ps(p, a); }
inline VF splat(float x) { return _mm256_set1_ps(x); }
inline VF zero() { return _mm256_setzero_ps(); }
inline VF fma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
inline VF add(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF sub(VF a, VF b) { return _mm256_sub_ps(a, b); }
inline VF mul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline float hmax(VF a) { return vec::hmax(a); }
inline float hsum(VF a) { return vec::hsum(a); }
inline VF exp2(VF x) { return vec::exp8(_mm256_mul_ps(x, _mm256_set1_ps(0.6931471805599453f))); }
#else
// Plain loops: one lane (builds without AVX2; the same steps, the compiler's code).
constexpr int R = 4;
constexpr int W = 1;
using VF = float;
inline VF load(const float* p) { return *p; }
inline void store(float* p, VF a) { *p = a; }
inline VF splat(float x) { return x; }
inline VF zero() { return 0.f; }
inline VF fma(VF a, VF b, VF c) { return a * b + c; }
inline VF vmax(VF a, VF b) { return std::max(a, b); }
inline VF add(VF a, VF b) { return a + b; }
inline VF sub(VF a, VF b) { return a - b; }
inline VF mul(VF a, VF b) { return a * b; }
inline float hmax(VF a) { return a; }
inline float hsum(VF a) { return a; }
inline VF exp2(VF x) { return std::exp2(x); }
#endif

// Vectors per row in the score loop (its column chunk C) and in the value loop (a dim
// that is not a whole number of VV vectors ends in one-vector steps). Shapes of 16 x 1 to
// 4 x 4 registers measured within a few % of each other here.
constexpr int SV = 2, VV = 2;
constexpr int C = SV * W;

// s[r][c0, c0 + NV W) = sum_k qs[r][k] * kt[k][c0 + ...] for RR rows (qs already scaled).
template <int RR, int NV>
inline void scores_chunk(const float* qs, int64_t d, const float* kt, int64_t lp, float* s,
                         int64_t c0) {
  VF a[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = zero();
  for (int64_t k = 0; k < d; ++k) {
    VF kv[NV];
    for (int i = 0; i < NV; ++i) kv[i] = load(kt + k * lp + c0 + i * W);
    for (int r = 0; r < RR; ++r) {
      const VF qr = splat(qs[r * d + k]);
      for (int i = 0; i < NV; ++i) a[r][i] = fma(qr, kv[i], a[r][i]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int i = 0; i < NV; ++i) store(s + r * lp + c0 + i * W, a[r][i]);
}

// o[r][d0, d0 + NV W) = sum_{j < cols} p[r][j] * v[j][d0 + ...] for RR rows.
template <int RR, int NV>
inline void values_chunk(const float* p, int64_t lp, const float* v, int64_t d, int64_t cols,
                         float* o, int64_t d0) {
  VF a[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = zero();
  for (int64_t j = 0; j < cols; ++j) {
    VF vv[NV];
    for (int i = 0; i < NV; ++i) vv[i] = load(v + j * d + d0 + i * W);
    for (int r = 0; r < RR; ++r) {
      const VF pr = splat(p[r * lp + j]);
      for (int i = 0; i < NV; ++i) a[r][i] = fma(pr, vv[i], a[r][i]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int i = 0; i < NV; ++i) store(o + r * d + d0 + i * W, a[r][i]);
}

// Rows fetched ahead of their use, and the fetch of a row's n floats.
constexpr int64_t kAhead = 16;
inline void fetch(const float* p, int64_t n) {
  for (int64_t c = 0; c < n; c += 16) __builtin_prefetch(p + c);
}

// One input, one head: out[i] = softmax(scale q[i] . k[j], j allowed) . v for its `len`
// tokens; q/k/v/out point at the input's first token of this head, `*t` the token strides.
inline void one_head(const float* q, int64_t qt, const float* k, int64_t kt_, const float* v,
                     int64_t vt, float* out, int64_t ot, int64_t len, int64_t d, float scale,
                     bool causal, std::vector<float>& scratch) {
  // Columns padded to whole chunks, and one vector more: with a power-of-two row stride
  // (2 KiB at 512 keys) the score loop's 32 key rows would share two sets of L1. (No
  // change measured on a 32 KiB 8-way L1; it costs nothing.)
  const int64_t lp = (len + C - 1) / C * C + W;
  scratch.resize(static_cast<size_t>(d * lp + lp * d + R * lp + R * d + R * d));
  float* kt = scratch.data();   // [d][lp] keys transposed, padding columns 0
  float* vs = kt + d * lp;      // [lp][d] values, padding rows 0
  float* s = vs + lp * d;       // [R][lp] scores, then weights
  float* qs = s + R * lp;       // [R][d] scaled queries
  float* o = qs + R * d;        // [R][d] outputs before the division
  // The head's keys and values are d floats every token stride (the projections' output
  // rows, mostly out of cache by now): fetched ahead, a row's latency is not waited on.
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) fetch(k + (j + kAhead) * kt_, d);
    for (int64_t c = 0; c < d; ++c) kt[c * lp + j] = k[j * kt_ + c];
  }
  for (int64_t c = 0; c < d; ++c) std::fill(kt + c * lp + len, kt + (c + 1) * lp, 0.f);
  for (int64_t j = 0; j < len; ++j) {
    if (j + kAhead < len) fetch(v + (j + kAhead) * vt, d);
    std::copy(v + j * vt, v + j * vt + d, vs + j * d);
  }
  std::fill(vs + len * d, vs + lp * d, 0.f);
  // Scores in log2 units: the softmax's exp becomes a 2^x, with no multiply by log2(e)
  // and a one-step range reduction.
  const float scale2 = scale * 1.4426950408889634f;
  for (int64_t i0 = 0; i0 < len; i0 += R) {
    const int64_t rows = std::min<int64_t>(R, len - i0);
    for (int64_t r = i0 + R; r < std::min<int64_t>(i0 + 2 * R, len); ++r) fetch(q + r * qt, d);
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < d; ++c)
        qs[r * d + c] = r < rows ? q[(i0 + r) * qt + c] * scale2 : 0.f;
    // Columns this block reads: every key, or (causal) up to its last row.
    const int64_t cols = causal ? i0 + rows : len;
    const int64_t cp = (cols + C - 1) / C * C;
    for (int64_t c0 = 0; c0 < cp; c0 += C) scores_chunk<R, SV>(qs, d, kt, lp, s, c0);
    float inv[R];
    for (int r = 0; r < rows; ++r) {
      float* sr = s + r * lp;
      const int64_t n = causal ? i0 + r + 1 : len;  // keys row r may read
      for (int64_t j = n; j < cp; ++j) sr[j] = -INFINITY;
      VF m = splat(-INFINITY);
      for (int64_t j = 0; j < cp; j += W) m = vmax(m, load(sr + j));
      const VF top = splat(hmax(m));
      VF total = zero();
      for (int64_t j = 0; j < cp; j += W) {
        const VF e = exp2(sub(load(sr + j), top));
        store(sr + j, e);
        total = add(total, e);
      }
      inv[r] = 1.f / hsum(total);
    }
    for (int r = rows; r < R; ++r) std::fill(s + r * lp, s + r * lp + cp, 0.f);
    int64_t d0 = 0;
    for (; d0 + VV * W <= d; d0 += VV * W) values_chunk<R, VV>(s, lp, vs, d, cp, o, d0);
    for (; d0 < d; d0 += W) values_chunk<R, 1>(s, lp, vs, d, cp, o, d0);
    for (int r = 0; r < rows; ++r) {
      const VF f = splat(inv[r]);
      float* dst = out + (i0 + r) * ot;
      for (int64_t c = 0; c < d; c += W) store(dst + c, mul(load(o + r * d + c), f));
    }
  }
}

}  // namespace packed

// Attention of each input over its own tokens: inputs back to back in one row.
//
//   q        [tokens, q_heads, dim]; k, v [tokens, kv_heads, dim] (any token and head
//            strides, unit stride in dim; q_heads a multiple of kv_heads)
//   starts   [inputs] int64 first token of each input; lengths [inputs] its tokens
//
// Returns [tokens, q_heads, dim] contiguous; tokens no input covers are left 0. dim must be
// a multiple of a vector (8 floats with AVX2, 16 with AVX-512, any dim in plain builds):
// packed_attention_dims says which.
torch::Tensor packed_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor starts, torch::Tensor lengths, double scale,
                               bool causal) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32,
              "packed_attention: float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "packed_attention: 3-d q, k, v");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "packed_attention: unit stride in dim");
  const int64_t hq = q.size(1), hk = k.size(1), d = q.size(2);
  TORCH_CHECK(hq % hk == 0 && v.size(1) == hk && k.size(2) == d && v.size(2) == d,
              "packed_attention: head counts and dims");
  TORCH_CHECK(d % packed::W == 0, "packed_attention: dim a multiple of ", packed::W);
  auto st = starts.to(torch::kInt64).contiguous();
  auto ln = lengths.to(torch::kInt64).contiguous();
  const int64_t n = st.numel();
  TORCH_CHECK(ln.numel() == n, "packed_attention: one length per start");
  const int64_t* sp = st.data_ptr<int64_t>();
  const int64_t* lp = ln.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(sp[i] >= 0 && lp[i] >= 0 && sp[i] + lp[i] <= q.size(0),
                "packed_attention: input ", i, " outside the row");
  auto out = torch::zeros({q.size(0), hq, d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = hq / hk;
  const float sc = static_cast<float>(scale);
  // One task per (input, head); long inputs first would balance threads better, but the
  // packer already orders inputs by length.
  at::parallel_for(0, n * hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t i = t / hq, h = t % hq, kh = h / group;
      const int64_t s0 = sp[i];
      packed::one_head(qp + s0 * q.stride(0) + h * q.stride(1), q.stride(0),
                       kp + s0 * k.stride(0) + kh * k.stride(1), k.stride(0),
                       vp + s0 * v.stride(0) + kh * v.stride(1), v.stride(0),
                       op + (s0 * hq + h) * d, hq * d, lp[i], d, sc, causal, scratch);
    }
  });
  return out;
}

// The head dims packed_attention takes in this build: multiples of this.
int64_t packed_attention_dims() { return packed::W; }
