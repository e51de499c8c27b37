// Helpers shared by the CPU translation units (ATen types, index loads, chunking).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <type_traits>

#include "replay_math.h"

namespace replay_cpu {

inline int score_func_code(const std::string& name) {
  if (name == "softmax") return replay_math::kSoftmax;
  if (name == "sigmoid") return replay_math::kSigmoid;
  if (name == "sqrtsoftplus") return replay_math::kSqrtSoftplus;
  TORCH_CHECK(false, "replay_ops native: unknown score_func='", name,
              "'; expected softmax, sigmoid or sqrtsoftplus");
  return -1;
}

template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Calls f(index_t{}) with the C++ type of an int16/int32/int64 index tensor.
template <typename F>
inline void dispatch_index(const at::Tensor& idx, const char* arg, F&& f) {
  switch (idx.scalar_type()) {
    case at::kShort: f(int16_t{}); break;
    case at::kInt: f(int32_t{}); break;
    case at::kLong: f(int64_t{}); break;
    default:
      TORCH_CHECK(false, "replay_ops native: ", arg, " must be int16, int32 or int64, got ",
                  idx.scalar_type());
  }
}

// Work is split into a fixed number of chunks that depends only on the sizes (never on the
// thread count), so every output is the same however many threads run.
inline int64_t num_chunks(int64_t items, int64_t grain) {
  if (items <= 0) return 0;
  int64_t c = (items + grain - 1) / grain;
  return c < 1 ? 1 : c;
}

// ------------------------------------------------------------------ row reductions
// exp(x) for x <= 0 (a logit minus its row maximum), in a form the compiler vectorises:
// Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes expf coefficients),
// within about 1 ulp of expf. Arguments below -87 are clamped (exp(-87) = 1.6e-38, which
// adds nothing to a softmax sum that is at least 1).
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float j = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const int32_t i = static_cast<int32_t>(j);
  float r = x - j * 0.693359375f;
  r = r + j * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (i + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// exp of a non-positive argument: the vectorisable form in fp32, the library exp in fp64.
inline float row_exp(float x) { return exp_nonpos(x); }
inline double row_exp(double x) { return replay_math::ro_exp(x); }

// max_j x_j and sum_j exp(x_j - max) of one row of E >= 1 logits, with kRowLanes
// interleaved partials combined in a fixed order (deterministic, vectorisable). fp32 math
// for fp16/bf16/fp32 rows; fp64 rows use the exact library exp.
constexpr int kRowLanes = 8;

template <typename scalar_t>
inline void row_softmax_stats(const scalar_t* x, int64_t E, acc_type_t<scalar_t>& m_out,
                              acc_type_t<scalar_t>& s_out) {
  using acc_t = acc_type_t<scalar_t>;
  if constexpr (std::is_same_v<acc_t, double>) {
    acc_t m = static_cast<acc_t>(x[0]), s = 0;
    for (int64_t j = 1; j < E; ++j) m = replay_math::ro_max(m, static_cast<acc_t>(x[j]));
    for (int64_t j = 0; j < E; ++j) s += replay_math::ro_exp(static_cast<acc_t>(x[j]) - m);
    m_out = m;
    s_out = s;
  } else {
    float pm[kRowLanes];
    const float x0 = static_cast<float>(x[0]);
    for (int l = 0; l < kRowLanes; ++l) pm[l] = x0;
    int64_t j = 0;
    for (; j + kRowLanes <= E; j += kRowLanes)
      for (int l = 0; l < kRowLanes; ++l) {
        const float v = static_cast<float>(x[j + l]);
        pm[l] = v > pm[l] ? v : pm[l];
      }
    for (; j < E; ++j) {
      const float v = static_cast<float>(x[j]);
      pm[0] = v > pm[0] ? v : pm[0];
    }
    float m = pm[0];
    for (int l = 1; l < kRowLanes; ++l) m = pm[l] > m ? pm[l] : m;
    // exp into a block buffer first: that loop vectorises, a fused exp-and-sum does not.
    constexpr int kBlock = 64;
    float buf[kBlock];
    float ps[kRowLanes] = {};
    for (int64_t b = 0; b < E; b += kBlock) {
      const int n = E - b < kBlock ? static_cast<int>(E - b) : kBlock;
      for (int i = 0; i < n; ++i) buf[i] = exp_nonpos(static_cast<float>(x[b + i]) - m);
      for (int i = n; i < kBlock; ++i) buf[i] = 0.0f;
      for (int i = 0; i < kBlock; i += kRowLanes)
        for (int l = 0; l < kRowLanes; ++l) ps[l] += buf[i + l];
    }
    for (int w = kRowLanes / 2; w > 0; w /= 2)
      for (int l = 0; l < w; ++l) ps[l] += ps[l + w];
    m_out = m;
    s_out = ps[0];
  }
}

}  // namespace replay_cpu
