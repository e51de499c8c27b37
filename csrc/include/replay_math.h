// Math shared by the C++ CPU kernels and the CUDA kernels of replay_ops.
//
// Every function here is `RO_HD inline`: `__host__ __device__` under nvcc, plain inline for
// the host compiler. The CPU extension includes this header, so the CPU build and its test
// suite exercise exactly the arithmetic the CUDA kernels run.
//
// Compute type `acc_t` is float for fp16/bf16/fp32 inputs and double for fp64 inputs.
//
// Gate weights for one token row with K slots, z_k = logits[t, idx_k], valid_k = idx_k >= 0:
//   softmax, normalize=False : w_k = exp(z_k - m) / s,  m = max_j x_j, s = sum_j exp(x_j - m)
//                              over all E experts (pre-softmax, then gather)
//   softmax, normalize=True  : same with m and s taken over the valid selected logits only
//   sigmoid / sqrtsoftplus   : w_k = f(z_k), divided by (sum_valid f + 1e-20) when
//                              normalize and more than one slot is valid
//   then w_k *= scaling_factor, and w_k = 0 for empty slots.
//
// Score functions are numbered by the one table of replay_ops/scores.py (generated into
// replay_score_funcs.h). Every function here branches on each id explicitly; an id it does
// not know gives NaN (the bindings refuse unknown ids before any kernel runs).
#pragma once

#include <math.h>
#include <stdint.h>

#include "replay_score_funcs.h"

#if defined(__CUDACC__)
#define RO_HD __host__ __device__
// Always inlined in device code: a call there spills the registers live across it.
#define RO_HDI __host__ __device__ __forceinline__
#else
#define RO_HD
#define RO_HDI inline
#endif

// RO_DEVICE_MATH selects the device arithmetic below (reciprocal estimates refined with
// FMA steps instead of IEEE division and square root). It is on in device code, and on the
// host when RO_EMULATE_DEVICE_MATH is defined: then device_math_emulation.h supplies host
// versions of the intrinsics, and tests/test_device_math.py runs the device sequences on
// the CPU against the fp64 reference (extreme logits included).
#if defined(__CUDA_ARCH__) || defined(RO_EMULATE_DEVICE_MATH)
#define RO_DEVICE_MATH 1
#else
#define RO_DEVICE_MATH 0
#endif
#if defined(RO_EMULATE_DEVICE_MATH) && !defined(__CUDA_ARCH__)
#include "device_math_emulation.h"
#endif

namespace replay_math {

// Threshold above which softplus(x) is x, as in torch.nn.functional.softplus.
constexpr double kSoftplusThreshold = 20.0;
constexpr double kNormEps = 1e-20;

RO_HD inline float ro_exp(float x) { return expf(x); }
RO_HD inline double ro_exp(double x) { return exp(x); }
// sqrt(x) for x >= 0. NOTE: like the division (see ro_div), the GPU's IEEE square root has
// a slow-path call that spills registers; device code refines the hardware reciprocal
// square-root estimate with FMA steps instead (within one ulp of sqrt). The host is exact.
RO_HD inline float ro_sqrt(float x) {
#if RO_DEVICE_MATH
  const float r = rsqrtf(x);
  const float s = x * r;
  const float v = __fmaf_rn(0.5f * r, __fmaf_rn(-s, s, x), s);
  return x > 0.0f && x < INFINITY ? v : (x > 0.0f ? x : 0.0f);
#else
  return sqrtf(x);
#endif
}
RO_HD inline double ro_sqrt(double x) {
#if RO_DEVICE_MATH
  double r = rsqrt(x);
  r = r * __fma_rn(-0.5 * x * r, r, 1.5);
  const double s = x * r;
  const double v = __fma_rn(0.5 * r, __fma_rn(-s, s, x), s);
  return x > 0.0 && x < INFINITY ? v : (x > 0.0 ? x : 0.0);
#else
  return sqrt(x);
#endif
}

// a / b. NOTE: on the GPU an IEEE division carries a slow-path subroutine call, and the
// registers live across that call are spilled to local memory (ptxas reports spill stores
// in every kernel that divides). Device code therefore divides with a reciprocal estimate
// and Newton/FMA refinement, which is call-free and within one ulp of a / b. The estimate
// is taken of b's mantissa alone (b = m * 2^k, |m| in [0.5, 1)), so it never overflows or
// underflows whatever b's exponent (fp64 denominators far outside the float range
// included); zero, infinite and NaN denominators give IEEE's answers. The host divides
// exactly.
#if RO_DEVICE_MATH
template <typename T>
RO_HD inline bool ro_div_special(T a, T b, T& out) {
  if (b != b) {
    out = b;  // NaN
  } else if (b == T(0)) {
    out = a * copysign(T(INFINITY), b);  // +-inf, or NaN for 0/0
  } else if (b == T(INFINITY) || b == -T(INFINITY)) {
    out = a * copysign(T(0), b);  // +-0, or NaN for inf/inf
  } else {
    return false;
  }
  return true;
}
#endif
RO_HD inline float ro_div(float a, float b) {
#if RO_DEVICE_MATH
  float out;
  if (ro_div_special(a, b, out)) return out;
  int k;
  const float m = frexpf(b, &k);
  const float r = ldexpf(__fdividef(1.0f, m), -k);
  const float q = a * r;
  return __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
#else
  return a / b;
#endif
}
RO_HD inline double ro_div(double a, double b) {
#if RO_DEVICE_MATH
  double out;
  if (ro_div_special(a, b, out)) return out;
  int k;
  const double m = frexp(b, &k);
  double r = static_cast<double>(__fdividef(1.0f, static_cast<float>(m)));
  r = __fma_rn(r, __fma_rn(-m, r, 1.0), r);
  r = __fma_rn(r, __fma_rn(-m, r, 1.0), r);
  r = ldexp(r, -k);
  const double q = a * r;
  return __fma_rn(r, __fma_rn(-b, q, a), q);
#else
  return a / b;
#endif
}

// log1p(x) for x >= 0. NOTE: the device log1p spills registers in the gate kernels (the
// ptxas spill check caught it); device code uses Kahan's form log(u) * x / (u - 1) with
// u = 1 + x, accurate to a few ulp and call-free. The host uses log1p.
RO_HD inline float ro_log1p(float x) {
#if RO_DEVICE_MATH
  const float u = 1.0f + x;
  return u == 1.0f ? x : logf(u) * ro_div(x, u - 1.0f);
#else
  return log1pf(x);
#endif
}
RO_HD inline double ro_log1p(double x) {
#if RO_DEVICE_MATH
  const double u = 1.0 + x;
  return u == 1.0 ? x : log(u) * ro_div(x, u - 1.0);
#else
  return log1p(x);
#endif
}

template <typename acc_t>
RO_HD inline acc_t ro_max(acc_t a, acc_t b) {
  return a > b ? a : b;
}

// 1 / (1 + exp(-x)), computed so that the denominator stays in [1, 2]: exp(-|x|) <= 1
// never overflows, so the reciprocal of ro_div never sees an infinite denominator (which
// gives NaN on the device) and sigmoid(x) underflows to 0 for very negative x, as it should.
template <typename acc_t>
RO_HD inline acc_t sigmoid(acc_t x) {
  const acc_t e = ro_exp(x < acc_t(0) ? x : -x);
  const acc_t r = ro_div(acc_t(1), acc_t(1) + e);
  return x < acc_t(0) ? e * r : r;
}

template <typename acc_t>
RO_HD inline acc_t sqrt_softplus(acc_t x) {
  acc_t sp = x > acc_t(kSoftplusThreshold) ? x : ro_log1p(ro_exp(x));
  return ro_sqrt(sp);
}

template <typename acc_t>
RO_HD inline acc_t unknown_score() {
  return acc_t(NAN);
}

// Score of one gathered logit for the element-wise score functions.
template <typename acc_t>
RO_HD inline acc_t score(int score_func, acc_t x) {
  switch (score_func) {
    case kSigmoid: return sigmoid(x);
    case kSqrtsoftplus: return sqrt_softplus(x);
    default: return unknown_score<acc_t>();  // kSoftmax is row-wise, never element-wise
  }
}

// d score / dx, given the score value sc = score(x).
template <typename acc_t>
RO_HD inline acc_t score_grad(int score_func, acc_t x, acc_t sc) {
  switch (score_func) {
    case kSigmoid: return sc * (acc_t(1) - sc);
    case kSqrtsoftplus: {
      // d sqrt(softplus(x)) / dx = sigmoid(x) / (2 sqrt(softplus(x))); softplus is linear
      // above its threshold, so its slope is 1 there.
      const acc_t slope = x > acc_t(kSoftplusThreshold) ? acc_t(1) : sigmoid(x);
      return sc > acc_t(0) ? ro_div(slope, acc_t(2) * sc) : acc_t(0);
    }
    default: return unknown_score<acc_t>();
  }
}

// True when the weights of a row are normalised by their sum (element-wise score funcs).
RO_HD inline bool divides_by_sum(bool normalize, int nvalid) { return normalize && nvalid > 1; }

// Gate weight of one slot, given the row statistics.
//   softmax:      stat_m = max, stat_s = sum of exp(. - max) (over E or over the selection)
//   element-wise: stat_s = sum of scores over valid slots, stat_m unused
template <typename acc_t>
RO_HD inline acc_t gate_weight(int score_func, bool normalize, acc_t z, acc_t stat_m,
                               acc_t stat_s, int nvalid, acc_t scale) {
  acc_t w;
  switch (score_func) {
    case kSoftmax:
      w = ro_div(ro_exp(z - stat_m), stat_s == acc_t(0) ? acc_t(1) : stat_s);
      break;
    case kSigmoid:
    case kSqrtsoftplus:
      w = score(score_func, z);
      if (divides_by_sum(normalize, nvalid)) w = ro_div(w, stat_s + acc_t(kNormEps));
      break;
    default: return unknown_score<acc_t>();
  }
  return w * scale;
}

// Row statistics for `gate_weight` are accumulated with these two steps:
//   softmax: m = max over the range (finite; 0 when the range is empty), then
//            s = sum exp(x - m)
//   element-wise: s = sum score(z) over valid slots
template <typename acc_t>
RO_HD inline acc_t max_or_zero(acc_t m, bool any) {
  // 0 also for a max of -inf (every valid selected logit -inf), as the oracle's
  // where(m == -inf, 0, m): -inf - -inf would make the row NaN. A +inf or NaN max stays,
  // and makes the row NaN, as torch.softmax does.
  return any && m != acc_t(-INFINITY) ? m : acc_t(0);
}

// Softmax statistics over the valid selected logits of one row: m = max over valid z[k]
// (0 when none is valid), s = sum over valid exp(z[k] - m).
template <typename acc_t, typename flag_t>
RO_HD inline void selected_softmax_stats(const acc_t* z, const flag_t* valid, int64_t K,
                                         acc_t& m, acc_t& s) {
  bool any = false;
  m = acc_t(0);
  for (int64_t k = 0; k < K; ++k) {
    if (!valid[k]) continue;
    m = any ? ro_max(m, z[k]) : z[k];
    any = true;
  }
  m = max_or_zero(m, any);
  s = acc_t(0);
  for (int64_t k = 0; k < K; ++k)
    if (valid[k]) s += ro_exp(z[k] - m);
}

// ---------------------------------------------------------------------------- backward
// Per-slot gradient dz_k of the loss with respect to the gathered logit z_k, for the
// selected-range formulations (everything except softmax with normalize=False):
//   softmax, normalize=True: q_k = exp(z_k - m)/s, dz_k = q_k (g_k - G), G = sum_k g_k q_k
//   element-wise:            dz_k = dsc_k * (normalize && nvalid>1 ? g_k/S - (D/S)/S : g_k),
//                            S = sum sc + 1e-20, D = sum g_k sc_k  ((D/S)/S, not D/(S*S):
//                            S*S underflows to 0 for S below ~1e-19)
// g_k = grad_weights[t, k] * scaling_factor for valid slots and 0 for empty ones.
template <typename acc_t>
RO_HD inline acc_t softmax_sel_dz(acc_t q, acc_t g, acc_t G) {
  return q * (g - G);
}

template <typename acc_t>
RO_HD inline acc_t elementwise_dz(int score_func, bool normalize, int nvalid, acc_t z, acc_t g,
                                  acc_t S_plus_eps, acc_t D) {
  acc_t sc = score(score_func, z);
  acc_t gn = divides_by_sum(normalize, nvalid)
                 ? ro_div(g, S_plus_eps) - ro_div(ro_div(D, S_plus_eps), S_plus_eps)
                 : g;
  return gn * score_grad(score_func, z, sc);
}

// softmax with normalize=False: p_j = exp(x_j - m)/s over all E. With a_k = g_k p_{idx_k}
// and A = sum_k a_k, grad_j = -p_j A + sum_{k: idx_k = j} a_k. `e` is exp(x_j - m).
template <typename acc_t>
RO_HD inline acc_t softmax_full_base(acc_t e, acc_t s, acc_t A) {
  return -ro_div(e, s) * A;
}

// ---------------------------------------------------------------------------- plan
// Rows of the plan's sorted_slots, T*K + E*(align-1): the most rows a plan can use. It must
// stay below 2^31 (the int32 plan tensors); csrc/bindings/native_checks.h checks that.
RO_HD inline int64_t plan_capacity(int64_t T, int64_t K, int64_t E, int64_t align) {
  return T * K + E * (align - 1);
}

// Rows used by an expert with `count` valid slots, padded to a multiple of `align`.
RO_HD inline int64_t padded_count(int64_t count, int64_t align) {
  return (count + align - 1) / align * align;
}

// 32-bit form for device code: plan sizes are below 2^31 (the bindings check), and a 64-bit
// division is a subroutine call on the GPU.
RO_HD inline int32_t padded_count32(int32_t count, int32_t align) {
  return (count + align - 1) / align * align;
}

// Token of a flat slot s = t*K + k.
RO_HD inline int64_t slot_token(int64_t slot, int64_t K) { return slot / K; }
RO_HD inline int32_t slot_token32(int32_t slot, int32_t K) { return slot / K; }

// An index value takes a row only if it names an expert; -1 (and, with validate=False,
// any out-of-range value) is an empty slot.
RO_HD inline bool takes_row(int64_t e, int64_t E) { return e >= 0 && e < E; }

// ---------------------------------------------------------------------------- dense mode
// Row flags (replay_ops/plan.py ROW_*), written per token row by the dense gate.
constexpr uint8_t kRowEmptySlot = 1;   // a slot holds -1
constexpr uint8_t kRowOutOfRange = 2;  // a slot holds an id outside [-1, E)
constexpr uint8_t kRowRepeat = 4;      // an expert id in [0, E) appears twice
constexpr uint8_t kRowMasked = 8;      // replay_mask False (the recorded ids are not read)
// Padding modes (replay_ops/plan.py PADDING_MODES): how a flagged row is routed.
constexpr int kPadEmpty = 0;     // its ids in [0, E) (nothing for a masked row)
constexpr int kPadSpread = 1;    // spread_expert
constexpr int kPadFallback = 2;  // the row of the fallback indices
constexpr int kPadSelect = 3;    // the model's own selection (replay_select.h select_row),
                                 // resolved by the caller before dense_slot_expert
// Multiplier of the per-cycle rotation of the spread padding (2^32 / golden ratio).
constexpr uint32_t kSpreadHash = 2654435769u;

// The flags of recorded row `ip` (K slots, stride sk). O(K^2) compares, no memory but the row.
template <typename index_t>
RO_HDI uint8_t row_flags(const index_t* ip, int64_t sk, int64_t K, int64_t E, bool masked) {
  if (masked) return kRowMasked;
  uint8_t f = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int64_t e = static_cast<int64_t>(ip[k * sk]);
    if (e == -1) {
      f |= kRowEmptySlot;
    } else if (!takes_row(e, E)) {
      f |= kRowOutOfRange;
    } else {
      for (int64_t j = 0; j < k; ++j)
        if (static_cast<int64_t>(ip[j * sk]) == e) f |= kRowRepeat;
    }
  }
  return f;
}

// Expert of slot k of padding row t under kPadSpread (replay_ops.reference.spread_expert):
// value i = offset + t*K + k + W(c) (mod E), c = (t*K) / E, W(c) = ((c * kSpreadHash) mod 2^32)
// * E / 2^32; expert (i mod ep) * (E / ep) + i / ep. `U` is the unsigned type of the
// arithmetic: uint32_t in device code (E <= kMaxExperts, T*K < 2^31: no 64-bit division,
// which is a subroutine call there), uint64_t on the host. offset_mod is offset mod E.
template <typename U>
RO_HDI int64_t spread_expert(int64_t t, int64_t k, int64_t K, int64_t E, int64_t ep,
                                   int64_t offset_mod) {
  const U uE = static_cast<U>(E);
  const U s = static_cast<U>(t) * static_cast<U>(K);
  const uint32_t h = static_cast<uint32_t>(s / uE) * kSpreadHash;
  const U w = static_cast<U>((static_cast<uint64_t>(h) * static_cast<uint64_t>(E)) >> 32);
  const U i = (s % uE + static_cast<U>(offset_mod) + static_cast<U>(k) + w) % uE;
  const U uep = static_cast<U>(ep);
  return static_cast<int64_t>((i % uep) * (uE / uep) + i / uep);
}

// The expert slot k of a row routes to in the dense gate (-1: empty): the recorded id when
// the row has no flag; else by the padding mode. A masked row takes its fallback row when
// there is one (fb != nullptr). Fallback and recorded ids outside [0, E) are empty. A
// flagged row under kPadSelect (not masked with a fallback row) is the model's own
// selection: the kernels route it with select_row and do not call this.
template <typename U, typename index_t, typename fb_t>
RO_HDI int64_t dense_slot_expert(const index_t* ip, int64_t sk, const fb_t* fb,
                                       int64_t fsk, uint8_t flags, int padding, int64_t t,
                                       int64_t k, int64_t K, int64_t E, int64_t ep,
                                       int64_t offset_mod) {
  int64_t e;
  if ((flags & kRowMasked) && fb != nullptr) {
    e = static_cast<int64_t>(fb[k * fsk]);
  } else if (flags == 0) {
    return static_cast<int64_t>(ip[k * sk]);
  } else if (padding == kPadSpread) {
    return spread_expert<U>(t, k, K, E, ep, offset_mod);
  } else if (padding == kPadFallback) {
    e = static_cast<int64_t>(fb[k * fsk]);
  } else if (flags & kRowMasked) {
    return -1;
  } else {
    e = static_cast<int64_t>(ip[k * sk]);
  }
  return takes_row(e, E) ? e : -1;
}

}  // namespace replay_math
