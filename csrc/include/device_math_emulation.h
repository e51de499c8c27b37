// Host versions of the CUDA intrinsics that replay_math.h uses in its device arithmetic,
// for RO_EMULATE_DEVICE_MATH builds (tests/test_device_math.py): the device's division,
// square-root and fused multiply-add sequences then run on the CPU, with their edge cases.
//
//   __fdividef(x, y)   x * approx(1/y); CUDA documents 0 for 2^126 < |y| < 2^128 (and the
//                      reciprocal of an infinite y is 0), NaN when x is infinite there
//   rsqrtf, rsqrt      1 / sqrt(x) (the hardware estimate is within 2 ulp; the emulation
//                      is exact, which the tests' tolerances allow for)
//   __fmaf_rn, __fma_rn   fused multiply-add, rounded once
#pragma once

#include <math.h>

inline float __fdividef(float x, float y) {
  const float ay = fabsf(y);
  if (ay > 0x1p126f) return isinf(x) ? NAN : x * 0.0f * (y < 0 ? -1.0f : 1.0f);
  return x * (1.0f / y);
}
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
