// Two of transformers' elementwise blocks as one pass each on CPU (float32): the RMSNorm of
// Llama and its copies, and the rotary embedding's application to queries and keys.
// Eagerly each is 5-7 ops with a tensor and a dispatch apiece, on small tensors in a decode
// step (loading/fused.py says where they replace transformers' own).
//
// Same arithmetic as transformers': the rotary's products and sum are separate roundings
// (the extension is built with -ffp-contract=off), so its results are the same bits; the
// RMSNorm's mean of squares adds in another order than ATen's reduction (a last-bit
// difference at most), then x * rsqrt(mean + eps) * weight as transformers rounds it.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

// y = weight * (x * rsqrt(mean(x^2) + eps)) over the last dimension of x (any leading
// shape; rows of x with a unit last stride).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "rms_norm: float32");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "rms_norm: weight of the last dimension's size");
  auto xs = x.contiguous();
  auto w = weight.contiguous();
  auto out = torch::empty_like(xs);
  const int64_t rows = xs.numel() / d;
  const float* xp = xs.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * d;
      float* yr = op + r * d;
      int64_t i = 0;
      float ss = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 acc = _mm256_setzero_ps();
      for (; i + 8 <= d; i += 8) {
        const __m256 v = _mm256_loadu_ps(xr + i);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
      }
      ss = vec::hsum(acc);
#endif
      for (; i < d; ++i) ss += xr[i] * xr[i];
      const float var = ss * (1.f / static_cast<float>(d));  // ATen's mean: sum * (1 / n)
      const float scale = 1.f / std::sqrt(var + e);
      i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 s = _mm256_set1_ps(scale);
      for (; i + 8 <= d; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xr + i), s);
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_loadu_ps(wp + i), v));
      }
#endif
      for (; i < d; ++i) yr[i] = wp[i] * (xr[i] * scale);
    }
  });
  return out.view(x.sizes());
}

namespace rotary {

// out = x * cos + rotate_half(x) * sin for one head's `d` values.
inline void head(const float* x, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + half + i);
    const __m256 neg = _mm256_xor_ps(hi, _mm256_set1_ps(-0.f));  // -hi, exactly
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                            _mm256_mul_ps(neg, _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(out + half + i,
                     _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                   _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i))));
  }
#endif
  for (; i < half; ++i) {
    out[i] = x[i] * c[i] + (-x[half + i]) * s[i];
    out[half + i] = x[half + i] * c[half + i] + x[i] * s[half + i];
  }
}

// x [B, H, T, D] (unit last stride), cos and sin [B or 1, T, D]: a new tensor laid out as
// ATen lays out x * cos (following x's strides: tokens outer when x's heads are a view of
// one projection's columns).
inline torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin) {
  const int64_t b = x.size(0), h = x.size(1), t = x.size(2), d = x.size(3);
  TORCH_CHECK(x.stride(3) == 1 && d % 2 == 0, "rotary: heads of unit stride, even size");
  const bool tokens_outer = x.stride(2) > x.stride(1);
  auto out = tokens_outer ? torch::empty({b, t, h, d}, x.options()).transpose(1, 2)
                          : torch::empty({b, h, t, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const int64_t cs0 = cos.size(0) == 1 ? 0 : cos.stride(0), cs1 = cos.stride(1);
  at::parallel_for(0, b * t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t bt = begin; bt < end; ++bt) {
      const int64_t bi = bt / t, ti = bt % t;
      const float* c = cp + bi * cs0 + ti * cs1;
      const float* s = sp + bi * cs0 + ti * cs1;
      for (int64_t hi = 0; hi < h; ++hi) {
        head(xp + bi * xs0 + hi * xs1 + ti * xs2, c, s, d, op + bi * os0 + hi * os1 + ti * os2);
      }
    }
  });
  return out;
}

}  // namespace rotary

// transformers' apply_rotary_pos_emb(q, k, cos, sin) with unsqueeze_dim 1.
std::vector<torch::Tensor> rotary_embed(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                                        torch::Tensor sin) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "rotary: float32");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && cos.sizes() == sin.sizes(),
              "rotary: q, k [B, H, T, D], cos and sin [B, T, D]");
  TORCH_CHECK(cos.size(1) == q.size(2) && cos.size(2) == q.size(3) && k.size(2) == q.size(2) &&
                  k.size(3) == q.size(3) && (cos.size(0) == 1 || cos.size(0) == q.size(0)),
              "rotary: shapes");
  auto c = cos.stride(2) == 1 ? cos : cos.contiguous();
  auto s = sin.stride(2) == 1 && sin.strides() == c.strides() ? sin : sin.contiguous();
  if (s.strides() != c.strides()) c = c.contiguous();
  return {rotary::apply(q, c, s), rotary::apply(k, c, s)};
}
