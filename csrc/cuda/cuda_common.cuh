// Device helpers shared by the .cu files: dtype conversions, warp reductions, dispatch.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "replay_cuda.h"
#include "replay_math.h"

namespace replay_cuda {
namespace detail {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using acc_t = typename AccOf<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(acc_t<T> v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Separate multiply and add (no FMA contraction), like the eager PyTorch reference.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <typename A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}
template <typename A> __device__ __forceinline__ A warp_max(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = replay_math::ro_max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
__device__ __forceinline__ int64_t ceil_div_dev(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline unsigned grid_1d(int64_t blocks) {
  // Grid-stride loops cover the rest; 65535 * 8 blocks keep every GPU busy.
  const int64_t cap = int64_t(65535) * 8;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

}  // namespace detail

#define RO_CUDA_DISPATCH_FLOAT(DT, ...)                                   \
  switch (DT) {                                                           \
    case DType::kFloat32: { using scalar_t = float; __VA_ARGS__; break; }  \
    case DType::kFloat16: { using scalar_t = __half; __VA_ARGS__; break; } \
    case DType::kBFloat16: { using scalar_t = __nv_bfloat16; __VA_ARGS__; break; } \
    case DType::kFloat64: { using scalar_t = double; __VA_ARGS__; break; } \
    default: return cudaErrorInvalidValue;                                \
  }

#define RO_CUDA_DISPATCH_INDEX(IT, ...)                                   \
  switch (IT) {                                                           \
    case IType::kInt16: { using index_t = int16_t; __VA_ARGS__; break; }  \
    case IType::kInt32: { using index_t = int32_t; __VA_ARGS__; break; }  \
    case IType::kInt64: { using index_t = int64_t; __VA_ARGS__; break; }  \
    default: return cudaErrorInvalidValue;                                \
  }

}  // namespace replay_cuda
