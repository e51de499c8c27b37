// Row kernels of the CPU gate, one copy per x86 vector ISA; see row_kernels.h.
#include "row_kernels.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "replay_math.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define RO_X86_ISA_VARIANTS 1
// GCC 12 flags the deliberately undefined lanes inside its own AVX-512 intrinsic headers
// (_mm512_undefined_*) as maybe-uninitialized; nothing here reads an undefined lane.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define RO_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define RO_X86_ISA_VARIANTS 0
#define RO_ALWAYS_INLINE inline
#endif

namespace replay_cpu {
namespace {

// A logit as fp32. bf16 widens by a shift of its bits (exact, and vectorises everywhere).
template <typename scalar_t>
RO_ALWAYS_INLINE float load_f32(const scalar_t* p, int64_t j) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[j]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return f;
  } else {
    return static_cast<float>(p[j]);
  }
}

// exp(x) for x <= 0 (a logit minus its row maximum), in a form the compiler vectorises:
// Cody-Waite reduction by ln 2 and a degree-6 polynomial (Cephes expf coefficients),
// within about 1 ulp of expf. Arguments below -87 are clamped (exp(-87) = 1.6e-38, which
// adds nothing to a softmax sum that is at least 1); the backward's base row takes exp as 0
// there (exp_or_zero), so a -inf logit gets a gradient of exactly 0, as on the other
// backends, instead of -(1.6e-38 / s) A. Only add, mul, compare, convert and
// shift: each is exact per lane, so every vector width gives the same bits.
RO_ALWAYS_INLINE float exp_nonpos(float x) {
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

// The canonical order, which every ISA copy follows exactly: element j of a row belongs to
// lane j % kLanes. Lane partials start at -inf (max) and +0 (sum) and take their elements in
// ascending j; then lanes combine in a fixed tree (w = 8, 4, 2, 1: lane l takes lane l+w).
// NOTE: 16 lanes with independent chains keep the max and sum latency short enough that a
// row costs its exp throughput, not the length of one long dependency chain.
constexpr int kLanes = 16;

RO_ALWAYS_INLINE float max_step(float v, float acc) { return v > acc ? v : acc; }

RO_ALWAYS_INLINE float tree_max(float* pm) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) pm[l] = max_step(pm[l + w], pm[l]);
  return pm[0];
}

RO_ALWAYS_INLINE float tree_sum(float* ps) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) ps[l] = ps[l] + ps[l + w];
  return ps[0];
}

// Tail elements j >= j0 (j0 a multiple of kLanes) of the max and the sum, in scalar code.
template <typename scalar_t>
RO_ALWAYS_INLINE void max_tail(const scalar_t* x, int64_t j0, int64_t E, float* pm) {
  for (int64_t j = j0; j < E; ++j) pm[j - j0] = max_step(load_f32(x, j), pm[j - j0]);
}
template <typename scalar_t>
RO_ALWAYS_INLINE void sum_tail(const scalar_t* x, int64_t j0, int64_t E, float m, float* ps) {
  for (int64_t j = j0; j < E; ++j) ps[j - j0] = ps[j - j0] + exp_nonpos(load_f32(x, j) - m);
}
// exp_nonpos(d), or 0 where d < -87 (or NaN) - the backward's base row.
RO_ALWAYS_INLINE float exp_or_zero(float d) { return d >= -87.0f ? exp_nonpos(d) : 0.0f; }

template <typename scalar_t>
RO_ALWAYS_INLINE void full_base_tail(const scalar_t* x, int64_t j0, int64_t E, float m, float s,
                                     float A, float* row) {
  for (int64_t j = j0; j < E; ++j)
    row[j] = replay_math::softmax_full_base(exp_or_zero(load_f32(x, j) - m), s, A);
}

// ------------------------------------------------------------------ baseline (any CPU)
template <typename scalar_t>
void stats_baseline(const scalar_t* x, int64_t E, float& m_out, float& s_out) {
  const int64_t E0 = E / kLanes * kLanes;
  float pm[kLanes], ps[kLanes];
  for (int l = 0; l < kLanes; ++l) pm[l] = -INFINITY, ps[l] = 0.0f;
  for (int64_t j = 0; j < E0; j += kLanes)
    for (int l = 0; l < kLanes; ++l) pm[l] = max_step(load_f32(x, j + l), pm[l]);
  max_tail(x, E0, E, pm);
  const float m = tree_max(pm);
  for (int64_t j = 0; j < E0; j += kLanes)
    for (int l = 0; l < kLanes; ++l) ps[l] = ps[l] + exp_nonpos(load_f32(x, j + l) - m);
  sum_tail(x, E0, E, m, ps);
  m_out = m;
  s_out = tree_sum(ps);
}

template <typename scalar_t>
void full_base_baseline(const scalar_t* x, int64_t E, float m, float s, float A, float* row) {
  full_base_tail(x, 0, E, m, s, A, row);
}

#if RO_X86_ISA_VARIANTS
// ------------------------------------------------------------------ AVX-512 (16 lanes)
#define RO_AVX512 __attribute__((target("avx512f")))

template <typename scalar_t>
RO_AVX512 inline __m512 load16_avx512(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// exp_nonpos, lane by lane, with the same operations in the same order, for a vector type
// V (integer vector VI) whose intrinsics have prefix PFX and width BITS. One definition for
// both widths: the bitwise equality of the ISA copies rests on this exact sequence.
#define RO_DEFINE_VEC_EXP(NAME, ATTR, V, VI, PFX, BITS)                                    \
  ATTR inline V NAME(V x) {                                                                \
    x = PFX##_max_ps(PFX##_set1_ps(-87.0f), x); /* (-87 > x) ? -87 : x */                  \
    V j = PFX##_mul_ps(x, PFX##_set1_ps(1.44269504088896341f));                            \
    j = PFX##_sub_ps(PFX##_add_ps(j, PFX##_set1_ps(12582912.0f)),                          \
                     PFX##_set1_ps(12582912.0f));                                          \
    const VI i = PFX##_cvttps_epi32(j);                                                    \
    V r = PFX##_sub_ps(x, PFX##_mul_ps(j, PFX##_set1_ps(0.693359375f)));                   \
    r = PFX##_add_ps(r, PFX##_mul_ps(j, PFX##_set1_ps(2.12194440e-4f)));                   \
    V p = PFX##_set1_ps(1.9875691500e-4f);                                                 \
    p = PFX##_add_ps(PFX##_mul_ps(p, r), PFX##_set1_ps(1.3981999507e-3f));                 \
    p = PFX##_add_ps(PFX##_mul_ps(p, r), PFX##_set1_ps(8.3334519073e-3f));                 \
    p = PFX##_add_ps(PFX##_mul_ps(p, r), PFX##_set1_ps(4.1665795894e-2f));                 \
    p = PFX##_add_ps(PFX##_mul_ps(p, r), PFX##_set1_ps(1.6666665459e-1f));                 \
    p = PFX##_add_ps(PFX##_mul_ps(p, r), PFX##_set1_ps(5.0000001201e-1f));                 \
    p = PFX##_add_ps(PFX##_add_ps(PFX##_mul_ps(PFX##_mul_ps(p, r), r), r),                 \
                     PFX##_set1_ps(1.0f));                                                 \
    const VI bits = PFX##_slli_epi32(PFX##_add_epi32(i, PFX##_set1_epi32(127)), 23);       \
    return PFX##_mul_ps(p, PFX##_castsi##BITS##_ps(bits));                                 \
  }

RO_DEFINE_VEC_EXP(exp16_avx512, RO_AVX512, __m512, __m512i, _mm512, 512)

template <typename scalar_t>
RO_AVX512 void stats_avx512(const scalar_t* x, int64_t E, float& m_out, float& s_out) {
  const int64_t E0 = E / kLanes * kLanes;
  alignas(64) float pm[kLanes], ps[kLanes];
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < E0; j += kLanes) vm = _mm512_max_ps(load16_avx512(x + j), vm);
  _mm512_store_ps(pm, vm);
  max_tail(x, E0, E, pm);
  const float m = tree_max(pm);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 vs = _mm512_setzero_ps();
  for (int64_t j = 0; j < E0; j += kLanes)
    vs = _mm512_add_ps(vs, exp16_avx512(_mm512_sub_ps(load16_avx512(x + j), mv)));
  _mm512_store_ps(ps, vs);
  sum_tail(x, E0, E, m, ps);
  m_out = m;
  s_out = tree_sum(ps);
}

template <typename scalar_t>
RO_AVX512 void full_base_avx512(const scalar_t* x, int64_t E, float m, float s, float A,
                                float* row) {
  const int64_t E0 = E / kLanes * kLanes;
  const __m512 mv = _mm512_set1_ps(m), sv = _mm512_set1_ps(s), av = _mm512_set1_ps(A);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN));
  const __m512 lo = _mm512_set1_ps(-87.0f);
  for (int64_t j = 0; j < E0; j += kLanes) {
    const __m512 d = _mm512_sub_ps(load16_avx512(x + j), mv);
    // exp_or_zero: 0 where d < -87 (or NaN)
    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, lo, _CMP_GE_OQ), exp16_avx512(d));
    const __m512 q = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(_mm512_div_ps(e, sv)), _mm512_castps_si512(sign)));  // -(e / s)
    _mm512_storeu_ps(row + j, _mm512_mul_ps(q, av));
  }
  full_base_tail(x, E0, E, m, s, A, row);
}

// ------------------------------------------------------------------ AVX2 (2 x 8 lanes)
#define RO_AVX2 __attribute__((target("avx2,f16c")))

template <typename scalar_t>
RO_AVX2 inline __m256 load8_avx2(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

RO_DEFINE_VEC_EXP(exp8_avx2, RO_AVX2, __m256, __m256i, _mm256, 256)
#undef RO_DEFINE_VEC_EXP

template <typename scalar_t>
RO_AVX2 void stats_avx2(const scalar_t* x, int64_t E, float& m_out, float& s_out) {
  const int64_t E0 = E / kLanes * kLanes;
  alignas(32) float pm[kLanes], ps[kLanes];
  __m256 lo = _mm256_set1_ps(-INFINITY), hi = lo;  // lanes 0-7 and 8-15
  for (int64_t j = 0; j < E0; j += kLanes) {
    lo = _mm256_max_ps(load8_avx2(x + j), lo);
    hi = _mm256_max_ps(load8_avx2(x + j + 8), hi);
  }
  _mm256_store_ps(pm, lo);
  _mm256_store_ps(pm + 8, hi);
  max_tail(x, E0, E, pm);
  const float m = tree_max(pm);
  const __m256 mv = _mm256_set1_ps(m);
  lo = _mm256_setzero_ps();
  hi = lo;
  for (int64_t j = 0; j < E0; j += kLanes) {
    lo = _mm256_add_ps(lo, exp8_avx2(_mm256_sub_ps(load8_avx2(x + j), mv)));
    hi = _mm256_add_ps(hi, exp8_avx2(_mm256_sub_ps(load8_avx2(x + j + 8), mv)));
  }
  _mm256_store_ps(ps, lo);
  _mm256_store_ps(ps + 8, hi);
  sum_tail(x, E0, E, m, ps);
  m_out = m;
  s_out = tree_sum(ps);
}

template <typename scalar_t>
RO_AVX2 void full_base_avx2(const scalar_t* x, int64_t E, float m, float s, float A,
                            float* row) {
  const int64_t E0 = E / 8 * 8;
  const __m256 mv = _mm256_set1_ps(m), sv = _mm256_set1_ps(s), av = _mm256_set1_ps(A);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 lo = _mm256_set1_ps(-87.0f);
  for (int64_t j = 0; j < E0; j += 8) {
    const __m256 d = _mm256_sub_ps(load8_avx2(x + j), mv);
    // exp_or_zero: 0 where d < -87 (or NaN)
    const __m256 e = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), exp8_avx2(d));
    const __m256 q = _mm256_xor_ps(_mm256_div_ps(e, sv), sign);  // -(e / s)
    _mm256_storeu_ps(row + j, _mm256_mul_ps(q, av));
  }
  full_base_tail(x, E0, E, m, s, A, row);
}
#endif  // RO_X86_ISA_VARIANTS

// fp64 rows: the exact library exp, one sequential sum.
void stats_f64(const double* x, int64_t E, double& m_out, double& s_out) {
  double m = x[0], s = 0.0;
  for (int64_t j = 1; j < E; ++j) m = replay_math::ro_max(m, x[j]);
  for (int64_t j = 0; j < E; ++j) s += replay_math::ro_exp(x[j] - m);
  m_out = m;
  s_out = s;
}

void full_base_f64(const double* x, int64_t E, double m, double s, double A, double* row) {
  for (int64_t j = 0; j < E; ++j)
    row[j] = replay_math::softmax_full_base(replay_math::ro_exp(x[j] - m), s, A);
}

bool isa_supported(CpuIsa isa) {
#if RO_X86_ISA_VARIANTS
  __builtin_cpu_init();
  if (isa == CpuIsa::kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == CpuIsa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
  return isa == CpuIsa::kBaseline;
}

CpuIsa parse_isa(const std::string& name, const char* where) {
  if (name == "baseline") return CpuIsa::kBaseline;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  TORCH_CHECK_VALUE(false, "replay_ops native: ", where, "='", name,
                    "' is not a CPU ISA; expected baseline, avx2 or avx512");
  return CpuIsa::kBaseline;
}

void check_supported(CpuIsa isa, const char* where) {
  TORCH_CHECK_VALUE(isa_supported(isa), "replay_ops native: ", where, "='", cpu_isa_name(isa),
                    "' is not supported by this CPU (or by this build)");
}

CpuIsa best_isa() {
  for (CpuIsa isa : {CpuIsa::kAvx512, CpuIsa::kAvx2})
    if (isa_supported(isa)) return isa;
  return CpuIsa::kBaseline;
}

std::atomic<int>& isa_slot() {
  static std::atomic<int> slot{-1};
  return slot;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512: return "avx512";
    case CpuIsa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

CpuIsa active_cpu_isa() {
  int v = isa_slot().load(std::memory_order_relaxed);
  if (v >= 0) return static_cast<CpuIsa>(v);
  CpuIsa isa = best_isa();
  if (const char* env = std::getenv("REPLAY_OPS_CPU_ISA"); env != nullptr && *env != '\0') {
    // A cap, not a demand: the same setting serves machines with fewer vector units.
    const CpuIsa cap = parse_isa(env, "REPLAY_OPS_CPU_ISA");
    if (static_cast<int>(cap) < static_cast<int>(isa)) isa = cap;
  }
  int expected = -1;
  isa_slot().compare_exchange_strong(expected, static_cast<int>(isa));
  return static_cast<CpuIsa>(isa_slot().load());
}

std::string cpu_isa(c10::string_view name_view) {
  const CpuIsa prev = active_cpu_isa();
  const std::string name(name_view);
  if (name.empty()) return cpu_isa_name(prev);
  const CpuIsa isa = parse_isa(name, "isa");
  check_supported(isa, "isa");
  isa_slot().store(static_cast<int>(isa));
  return cpu_isa_name(prev);
}

template <typename scalar_t>
RowKernels<scalar_t> row_kernels() {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return {&stats_f64, &full_base_f64};
  } else {
#if RO_X86_ISA_VARIANTS
    switch (active_cpu_isa()) {
      case CpuIsa::kAvx512: return {&stats_avx512<scalar_t>, &full_base_avx512<scalar_t>};
      case CpuIsa::kAvx2: return {&stats_avx2<scalar_t>, &full_base_avx2<scalar_t>};
      default: break;
    }
#endif
    return {&stats_baseline<scalar_t>, &full_base_baseline<scalar_t>};
  }
}

template RowKernels<float> row_kernels<float>();
template RowKernels<double> row_kernels<double>();
template RowKernels<c10::Half> row_kernels<c10::Half>();
template RowKernels<c10::BFloat16> row_kernels<c10::BFloat16>();

}  // namespace replay_cpu
