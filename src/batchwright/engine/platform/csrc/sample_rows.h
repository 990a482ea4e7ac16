// One sampling step on the CPU, every row in one call: the semantics of sample_step.py's
// graph (its docstring and sampler.py's say them), computed a row at a time while the
// row's scores sit in L1, instead of some 25 passes over [rows, vocab] eagerly.
//
// Per row: the raw log-softmax (read at the chosen and top-k ids), the top-k of the raw
// logits, z = logits * inv_t + offset (tokens the row's bitmask forbids at -1e30), then
// greedy rows take the first maximum of z; sampled rows keep the nucleus exactly as the
// graph does (its edge found among the 64 most likely tokens, else through bins of
// 1/16 nat below the 64th, the whole distribution for top_p = inf) and draw by inverse
// CDF in vocabulary order with the row's uniform, ring[r, cursor[r] % ring width]. Then
// the state updates of the graph's _finish: penalties at the chosen token, counts,
// cursor. float32; rows are independent, so a row's result never depends on the batch.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace sampling {

// sample_step.py's constants: candidates, bins, bins per nat, the forbidden score.
constexpr int64_t kCandidates = 64;
constexpr int64_t kBins = 512;
constexpr float kPerNat = 16.f;
constexpr float kForbidden = -1e30f;

struct Entry {
  float v;
  int32_t i;
};

// a before b: a higher value, or the same value at a lower index (the first maximum).
inline bool better(const Entry& a, const Entry& b) {
  return a.v > b.v || (a.v == b.v && a.i < b.i);
}

// The k best of x[0, n) into out[0, k), best first. A heap keeps the worst kept entry on
// top; once it is full, 8 scores at a time are compared with it and most groups pass
// without a look at their lanes.
inline void top_k(const float* x, int64_t n, int64_t k, Entry* out) {
  k = std::min(k, n);
  if (k <= 0) return;
  int64_t i = 0;
  for (; i < k; ++i) {
    out[i] = {x[i], static_cast<int32_t>(i)};
    std::push_heap(out, out + i + 1, better);
  }
  auto offer = [&](int64_t j) {
    if (x[j] > out[0].v) {
      std::pop_heap(out, out + k, better);
      out[k - 1] = {x[j], static_cast<int32_t>(j)};
      std::push_heap(out, out + k, better);
    }
  };
#if defined(__AVX2__) && defined(__FMA__)
  for (; i < n && i % 8 != 0; ++i) offer(i);
  for (; i + 8 <= n; i += 8) {
    int m = _mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(out[0].v), _CMP_GT_OQ));
    while (m != 0) {
      offer(i + __builtin_ctz(m));
      m &= m - 1;
    }
  }
#endif
  for (; i < n; ++i) offer(i);
  std::sort_heap(out, out + k, better);
}

// max of x[0, n)
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
  m = vec::hmax(mv);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// sum of exp(x - top) over x[0, n), written to e when e is given.
inline float exp_sum(const float* x, int64_t n, float top, float* e) {
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 t = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 w = vec::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), t));
    if (e != nullptr) _mm256_storeu_ps(e + i, w);
    acc = _mm256_add_ps(acc, w);
  }
  total = vec::hsum(acc);
#endif
  for (; i < n; ++i) {
    const float w = std::exp(x[i] - top);
    if (e != nullptr) e[i] = w;
    total += w;
  }
  return total;
}

// z = x * inv_t + off, forbidden tokens at kForbidden; returns max z.
inline float scores(const float* x, const float* off, float inv_t, const int32_t* allow,
                    int64_t n, float* z) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 t = _mm256_set1_ps(inv_t);
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(z + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), t,
                                            _mm256_loadu_ps(off + i)));
  }
#endif
  for (; i < n; ++i) z[i] = std::fma(x[i], inv_t, off[i]);
  if (allow != nullptr) {
    for (int64_t j = 0; j < n; ++j) {
      if (((static_cast<uint32_t>(allow[j >> 5]) >> (j & 31)) & 1u) == 0) z[j] = kForbidden;
    }
  }
  return max_of(z, n);
}

// Which tokens the nucleus keeps, as a test on z: z >= floor (a narrow nucleus, edge 0),
// 16 (floor - z) <= edge (a wide one: the token's bin at or above the edge), or all.
struct Kept {
  float floor = 0.f;
  float edge = 0.f;
  bool all = true;
};

// The nucleus of one row: e = exp(z - max), total their sum. `depth` and `bins` are
// scratch (n ints, 4 x kBins floats).
inline Kept nucleus(const float* z, const float* e, float total, float top_p, int64_t n,
                    Entry* cand, int32_t* depth, float* bins) {
  Kept kept;
  if (!(top_p < INFINITY)) return kept;  // the whole distribution
  kept.all = false;
  const float inv = 1.f / total;
  const int64_t c = std::min(kCandidates, n);
  top_k(z, n, c, cand);
  // The first candidate whose cumulative mass reaches top_p (the last when none does).
  float mass = 0.f;
  int64_t last = c - 1;
  for (int64_t j = 0; j < c; ++j) {
    mass += e[cand[j].i] * inv;
    if (mass >= top_p) {
      last = j;
      break;
    }
  }
  const float floor = cand[last].v;
  kept.floor = floor;
  if (mass >= top_p) return kept;  // narrow: edge 0, z >= floor
  // Wide: mass per bin of 1/16 nat below the floor; the edge is the first bin whose
  // mass from the top reaches top_p (the catch-all last bin when none does). Four
  // copies of the bins take neighbouring tokens, which often share a bin, so the adds
  // do not wait on each other.
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 f = _mm256_set1_ps(floor), per = _mm256_set1_ps(kPerNat);
  const __m256 lo = _mm256_setzero_ps(), hi = _mm256_set1_ps(kBins - 1);
  for (; j + 8 <= n; j += 8) {
    __m256 d = _mm256_mul_ps(_mm256_sub_ps(f, _mm256_loadu_ps(z + j)), per);
    d = _mm256_min_ps(_mm256_max_ps(_mm256_ceil_ps(d), lo), hi);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(depth + j), _mm256_cvtps_epi32(d));
  }
#endif
  for (; j < n; ++j) {
    const float d = std::ceil((floor - z[j]) * kPerNat);
    depth[j] = static_cast<int32_t>(std::min<float>(std::max(d, 0.f), kBins - 1));
  }
  std::fill(bins, bins + 4 * kBins, 0.f);
  for (j = 0; j < n; ++j) bins[(j & 3) * kBins + depth[j]] += e[j];
  float run = 0.f;
  int64_t edge = kBins - 1;
  for (int64_t b = 0; b < kBins - 1; ++b) {
    run += ((bins[b] + bins[kBins + b]) + (bins[2 * kBins + b] + bins[3 * kBins + b])) * inv;
    if (run >= top_p) {
      edge = b;
      break;
    }
  }
  if (edge == kBins - 1) kept.all = true;
  kept.edge = static_cast<float>(edge);
  return kept;
}

// The inverse CDF over the kept tokens in vocabulary order: the first whose running mass
// passes u times the kept mass. e becomes the kept tokens' weights (0 for the others);
// `groups` (n / 8 + 1 floats) their sums by 8, added in the same order for the total and
// the walk, so the goal falls inside the group the walk stops at (or rounding in the group
// leaves it at the group's last token).
inline int64_t draw(const float* z, float* e, const Kept& kept, float u, int64_t n,
                    float* groups) {
  const int64_t g = (n + 7) / 8;
  int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 f = _mm256_set1_ps(kept.floor), per = _mm256_set1_ps(kPerNat);
  const __m256 edge = _mm256_set1_ps(kept.edge);
  for (; j + 8 <= n; j += 8) {
    __m256 w = _mm256_loadu_ps(e + j);
    if (!kept.all) {
      const __m256 d = _mm256_mul_ps(_mm256_sub_ps(f, _mm256_loadu_ps(z + j)), per);
      w = _mm256_and_ps(w, _mm256_cmp_ps(d, edge, _CMP_LE_OQ));
      _mm256_storeu_ps(e + j, w);
    }
    groups[j / 8] = vec::hsum(w);
  }
#endif
  for (int64_t b = j / 8; b < g; ++b) {
    float s = 0.f;
    for (int64_t i = b * 8; i < std::min(n, b * 8 + 8); ++i) {
      if (!kept.all && !((kept.floor - z[i]) * kPerNat <= kept.edge)) e[i] = 0.f;
      s += e[i];
    }
    groups[b] = s;
  }
  // Running sums in double: float32's rounding over thousands of tokens is as large as a
  // flat distribution's token masses, and would move the draw by a token.
  double total = 0.0;
  for (int64_t b = 0; b < g; ++b) total += groups[b];
  const double goal = u * total;
  double run = 0.0;
  for (int64_t b = 0; b < g; ++b) {
    if (run + groups[b] > goal) {
      // The goal is in this group: the first token past it, else its last with weight.
      int64_t pick = -1;
      double inner = run;
      for (int64_t i = b * 8; i < std::min(n, b * 8 + 8); ++i) {
        if (e[i] <= 0.f) continue;
        inner += e[i];
        pick = i;
        if (inner > goal) return i;
      }
      if (pick >= 0) return pick;
    }
    run += groups[b];
  }
  for (int64_t i = n - 1; i >= 0; --i) {  // rounding left the goal past the last group
    if (e[i] > 0.f) return i;
  }
  return -1;
}

}  // namespace sampling

// The step over logits [B, V] with the per-row state of sampler.py (rows 0..B-1 of each
// tensor are the logits' rows; offset and counts are updated in place, so are cursor's).
// Returns the packed [B, 2 + 2 k_top] float32 result: the token and the top-k ids of the
// raw logits, then the raw logprobs of those 1 + k_top ids.
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor offset, torch::Tensor counts,
                          torch::Tensor inv_t, torch::Tensor greedy, torch::Tensor top_p,
                          torch::Tensor presence, torch::Tensor frequency, torch::Tensor ring,
                          torch::Tensor cursor, c10::optional<torch::Tensor> allow,
                          int64_t k_top) {
  using sampling::Entry;
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32,
              "logits: [rows, vocab] float32");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  for (const auto* t : {&offset, &counts}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) >= rows && t->size(1) == n && t->stride(1) == 1 &&
                    t->scalar_type() == torch::kFloat32,
                "offset, counts: [rows, vocab] float32 rows");
  }
  TORCH_CHECK(ring.dim() == 2 && ring.stride(1) == 1, "ring: [rows, width]");
  TORCH_CHECK(cursor.scalar_type() == torch::kInt64, "cursor: int64");
  const auto it = inv_t.contiguous(), gr = greedy.contiguous(), tp = top_p.contiguous();
  const auto pr = presence.contiguous(), fr = frequency.contiguous();
  TORCH_CHECK(gr.scalar_type() == torch::kBool, "greedy: bool");
  torch::Tensor mask;
  if (allow.has_value()) {
    mask = allow->contiguous();
    TORCH_CHECK(mask.scalar_type() == torch::kInt32 && mask.size(0) >= rows &&
                    mask.size(1) * 32 >= n,
                "allow: [rows, vocab / 32] int32");
  }
  const int64_t k = std::min(k_top, n);
  auto out = torch::zeros({rows, 2 + 2 * k_top}, logits.options());
  const float* x = logits.data_ptr<float>();
  float* off = offset.data_ptr<float>();
  float* cnt = counts.data_ptr<float>();
  const int64_t off_stride = offset.stride(0), cnt_stride = counts.stride(0);
  const float* ring_p = ring.data_ptr<float>();
  const int64_t ring_stride = ring.stride(0), ring_width = ring.size(1);
  int64_t* cur = cursor.data_ptr<int64_t>();
  const int64_t cur_stride = cursor.stride(0);
  const float* itp = it.data_ptr<float>();
  const bool* grp = gr.data_ptr<bool>();
  const float* tpp = tp.data_ptr<float>();
  const float* prp = pr.data_ptr<float>();
  const float* frp = fr.data_ptr<float>();
  const int32_t* maskp = mask.defined() ? mask.data_ptr<int32_t>() : nullptr;
  const int64_t words = mask.defined() ? mask.size(1) : 0;
  float* o = out.data_ptr<float>();
  const int64_t width = 2 + 2 * k_top;

  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> z(n), e(n), bins(4 * sampling::kBins), groups(n / 8 + 1);
    std::vector<int32_t> depth(n);
    std::vector<Entry> cand(sampling::kCandidates), top(std::max<int64_t>(k, 1));
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * n;
      float* orow = o + r * width;
      // The raw distribution: its log-normaliser and top-k.
      const float rmax = sampling::max_of(xr, n);
      const float lse = rmax + std::log(sampling::exp_sum(xr, n, rmax, nullptr));
      sampling::top_k(xr, n, k, top.data());
      // The adjusted scores; greedy rows take their first maximum.
      const float zmax = sampling::scores(xr, off + r * off_stride, itp[r],
                                          maskp ? maskp + r * words : nullptr, n, z.data());
      int64_t token = 0;
      if (grp[r]) {
        while (token < n - 1 && z[token] != zmax) ++token;
      } else {
        const float total = sampling::exp_sum(z.data(), n, zmax, e.data());
        const sampling::Kept kept =
            sampling::nucleus(z.data(), e.data(), total, tpp[r], n, cand.data(), depth.data(),
                              bins.data());
        const float u = ring_p[r * ring_stride + cur[r * cur_stride] % ring_width];
        token = sampling::draw(z.data(), e.data(), kept, u, n, groups.data());
        if (token < 0) {  // nothing kept has mass (cannot happen with a finite row)
          token = 0;
          while (token < n - 1 && z[token] != zmax) ++token;
        }
      }
      orow[0] = static_cast<float>(token);
      orow[1 + k_top] = xr[token] - lse;
      for (int64_t j = 0; j < k; ++j) {
        orow[1 + j] = static_cast<float>(top[j].i);
        orow[2 + k_top + j] = top[j].v - lse;
      }
      // Penalties count the generated token: frequency each time, presence the first.
      float* seen = cnt + r * cnt_stride + token;
      off[r * off_stride + token] += frp[r] + prp[r] * (*seen == 0.f ? 1.f : 0.f);
      *seen += 1.f;
      cur[r * cur_stride] += 1;
    }
  });
  return out;
}
