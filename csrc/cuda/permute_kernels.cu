// CUDA kernels of permute, unpermute, the permuted probs and their backward ops.
//
// One warp per output row, 8 rows per 256-thread CTA, grid-stride over rows. Rows move in
// 16-byte vectors when the row size and every base pointer allow it, else element-wise.
// Sums over the K slots of a token run in fp32 (fp64 for fp64) in column order k = 0..K-1
// with separate multiply and add (no FMA contraction), like the eager reference. Each output
// element has one writer and the dot products of grad_w use a fixed shuffle tree, so no
// float atomics are used and the results are bitwise deterministic.
#include "cuda_common.cuh"

namespace replay_cuda {
namespace {

using namespace detail;
namespace rm = replay_math;

constexpr int kThreads = 256;
constexpr int kRowsPerCta = kThreads / 32;

template <typename scalar_t, int VEC>
struct alignas(sizeof(scalar_t) * VEC) Pack {
  scalar_t v[VEC];
};

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// One warp per row, grid-stride: this warp's first row, the stride, and its lane.
struct WarpRows {
  int64_t first, step;
  int lane;
};
__device__ __forceinline__ WarpRows warp_rows() {
  return {static_cast<int64_t>(blockIdx.x) * kRowsPerCta + (threadIdx.x >> 5),
          static_cast<int64_t>(gridDim.x) * kRowsPerCta, static_cast<int>(threadIdx.x & 31)};
}

// ----------------------------------------------------------------------------- permute
template <typename U>
__global__ void __launch_bounds__(kThreads) _permute_fwd_kernel(
    // inputs
    const U* hidden, int64_t T, int64_t units, const int32_t* sorted_slots, int64_t n_slots,
    int32_t K, int64_t num_rows,
    // outputs
    U* out) {
  const WarpRows wr = warp_rows();
  const int lane = wr.lane;
  for (int64_t r = wr.first; r < num_rows; r += wr.step) {
    const int32_t slot = r < n_slots ? sorted_slots[r] : -1;
    const int64_t t = slot >= 0 ? rm::slot_token32(slot, K) : -1;
    U* o = out + r * units;
    if (t >= 0 && t < T) {
      const U* src = hidden + t * units;
#pragma unroll 4
      for (int64_t i = lane; i < units; i += 32) o[i] = src[i];
    } else {
      const U zero{};
      for (int64_t i = lane; i < units; i += 32) o[i] = zero;
    }
  }
}

// ------------------------------------------------------------------ weighted gather-sum
template <typename scalar_t, int VEC, bool HAS_W>
__global__ void __launch_bounds__(kThreads) _gather_sum_kernel(
    // inputs
    const scalar_t* x, int64_t R, int64_t H, const int32_t* row_id_map, int64_t T, int64_t K,
    const acc_t<scalar_t>* w,
    // outputs
    scalar_t* out) {
  using A = acc_t<scalar_t>;
  using P = Pack<scalar_t, VEC>;
  const WarpRows wr = warp_rows();
  const int lane = wr.lane;
  for (int64_t t = wr.first; t < T; t += wr.step) {
    for (int64_t c = static_cast<int64_t>(lane) * VEC; c < H; c += 32 * VEC) {
      A acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = A(0);
      for (int64_t k = 0; k < K; ++k) {
        const int32_t r = row_id_map[t * K + k];
        if (r < 0 || r >= R) continue;
        const P p = *reinterpret_cast<const P*>(x + static_cast<int64_t>(r) * H + c);
        const A wk = HAS_W ? w[t * K + k] : A(1);
#pragma unroll
        for (int v = 0; v < VEC; ++v) {
          const A xv = to_acc(p.v[v]);
          acc[v] = add_rn(acc[v], HAS_W ? mul_rn(wk, xv) : xv);
        }
      }
      P o;
#pragma unroll
      for (int v = 0; v < VEC; ++v) o.v[v] = from_acc<scalar_t>(acc[v]);
      *reinterpret_cast<P*>(out + t * H + c) = o;
    }
  }
}

// ------------------------------------------------------------------- unpermute backward
template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) _unpermute_bwd_x_kernel(
    // inputs
    const scalar_t* grad_out, int64_t T, int64_t H, const int32_t* sorted_slots,
    int64_t n_slots, int32_t K, const acc_t<scalar_t>* w, int64_t R,
    // outputs
    scalar_t* grad_x) {
  using A = acc_t<scalar_t>;
  using P = Pack<scalar_t, VEC>;
  const WarpRows wr = warp_rows();
  const int lane = wr.lane;
  for (int64_t r = wr.first; r < R; r += wr.step) {
    const int32_t slot = r < n_slots ? sorted_slots[r] : -1;
    const int64_t t = slot >= 0 ? rm::slot_token32(slot, K) : -1;
    const bool has = t >= 0 && t < T;
    const A ws = has ? w[slot] : A(0);
    for (int64_t c = static_cast<int64_t>(lane) * VEC; c < H; c += 32 * VEC) {
      P o;
      if (has) {
        const P g = *reinterpret_cast<const P*>(grad_out + t * H + c);
#pragma unroll
        for (int v = 0; v < VEC; ++v) o.v[v] = from_acc<scalar_t>(mul_rn(ws, to_acc(g.v[v])));
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) o.v[v] = from_acc<scalar_t>(A(0));
      }
      *reinterpret_cast<P*>(grad_x + r * H + c) = o;
    }
  }
}

template <typename scalar_t, int VEC>
__global__ void __launch_bounds__(kThreads) _unpermute_bwd_w_kernel(
    // inputs
    const scalar_t* grad_out, const scalar_t* x, int64_t R, int64_t H,
    const int32_t* row_id_map, int64_t T, int64_t K,
    // outputs
    acc_t<scalar_t>* grad_w) {
  using A = acc_t<scalar_t>;
  using P = Pack<scalar_t, VEC>;
  const WarpRows wr = warp_rows();
  const int lane = wr.lane;
  for (int64_t t = wr.first; t < T; t += wr.step) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = row_id_map[t * K + k];
      A d = A(0);
      if (r >= 0 && r < R) {
        // VEC partial sums per lane, then a fixed tree over VEC and over the warp: each
        // partial sums only H / (32 VEC) products (16 at H=4096 in bf16).
        A part[VEC];
#pragma unroll
        for (int v = 0; v < VEC; ++v) part[v] = A(0);
#pragma unroll 1
        for (int64_t c = static_cast<int64_t>(lane) * VEC; c < H; c += 32 * VEC) {
          const P g = *reinterpret_cast<const P*>(grad_out + t * H + c);
          const P xv = *reinterpret_cast<const P*>(x + static_cast<int64_t>(r) * H + c);
#pragma unroll
          for (int v = 0; v < VEC; ++v)
            part[v] = add_rn(part[v], mul_rn(to_acc(g.v[v]), to_acc(xv.v[v])));
        }
#pragma unroll
        for (int w = VEC / 2; w > 0; w /= 2)
#pragma unroll
          for (int v = 0; v < w; ++v) part[v] = add_rn(part[v], part[v + w]);
        d = warp_sum(part[0]);
      }
      if (lane == 0) grad_w[t * K + k] = d;
    }
  }
}

template <typename scalar_t>
constexpr int vec_of() {
  return 16 / static_cast<int>(sizeof(scalar_t));
}

// ----------------------------------------------------------------------------- probs
// One thread per permuted row: the probability of its slot's token and expert.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) _permute_probs_fwd_kernel(
    // inputs
    const scalar_t* probs, int64_t spt, int64_t spe, int64_t T, int64_t E,
    const int32_t* sorted_slots, int64_t n_slots, const int32_t* idx, int32_t K,
    int64_t num_rows,
    // outputs
    scalar_t* out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < num_rows;
       r += step) {
    const int32_t slot = r < n_slots ? sorted_slots[r] : -1;
    const int64_t t = slot >= 0 ? rm::slot_token32(slot, K) : -1;
    const int64_t e = t >= 0 && t < T ? idx[slot] : -1;
    out[r] = rm::takes_row(e, E) ? probs[t * spt + e * spe] : from_acc<scalar_t>(acc_t<scalar_t>(0));
  }
}

// One warp per token row: lane j computes columns j, j + 32, ... of the dense row, each the
// sum over the slots routed there in slot order (one write per element, no zero-fill).
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads) _permute_probs_bwd_kernel(
    // inputs
    const scalar_t* grad, int64_t R, const int32_t* row_id_map, const int32_t* idx, int64_t T,
    int64_t K, int64_t E,
    // outputs
    scalar_t* out) {
  using A = acc_t<scalar_t>;
  const WarpRows wr = warp_rows();
  for (int64_t t = wr.first; t < T; t += wr.step) {
    const int32_t* ir = idx + t * K;
    const int32_t* rr = row_id_map + t * K;
    for (int64_t j = wr.lane; j < E; j += 32) {
      A sum = A(0);
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = rr[k];
        if (ir[k] == j && r >= 0 && r < R) sum += to_acc(grad[r]);
      }
      out[t * E + j] = from_acc<scalar_t>(sum);
    }
  }
}

}  // namespace

cudaError_t probe_kernel_image() {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, _permute_fwd_kernel<uint4>);
}

cudaError_t permute_fwd(const void* hidden, int64_t elem_size, int64_t T, int64_t H,
                        const int32_t* sorted_slots, int64_t n_slots, int64_t K,
                        int64_t num_rows, void* out, cudaStream_t stream) {
  if (T < 0 || H < 0 || K < 1 || num_rows < 0) return cudaErrorInvalidValue;
  if (num_rows == 0 || H == 0) return cudaSuccess;
  const unsigned grid = grid_1d(ceil_div(num_rows, kRowsPerCta));
  const int64_t bytes = H * elem_size;
  const int32_t k32 = static_cast<int32_t>(K);
  if (bytes % 16 == 0 && aligned16(hidden) && aligned16(out)) {
    _permute_fwd_kernel<uint4><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint4*>(hidden), T, bytes / 16, sorted_slots, n_slots, k32, num_rows,
        static_cast<uint4*>(out));
  } else if (elem_size == 8) {
    _permute_fwd_kernel<uint64_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint64_t*>(hidden), T, H, sorted_slots, n_slots, k32, num_rows,
        static_cast<uint64_t*>(out));
  } else if (elem_size == 4) {
    _permute_fwd_kernel<uint32_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint32_t*>(hidden), T, H, sorted_slots, n_slots, k32, num_rows,
        static_cast<uint32_t*>(out));
  } else if (elem_size == 2) {
    _permute_fwd_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const uint16_t*>(hidden), T, H, sorted_slots, n_slots, k32, num_rows,
        static_cast<uint16_t*>(out));
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t gather_sum(const void* x, DType dtype, int64_t R, int64_t H,
                       const int32_t* row_id_map, int64_t T, int64_t K, const void* w_acc,
                       void* out, cudaStream_t stream) {
  if (R < 0 || H < 0 || T < 0 || K < 1) return cudaErrorInvalidValue;
  if (T == 0 || H == 0) return cudaSuccess;
  const unsigned grid = grid_1d(ceil_div(T, kRowsPerCta));
  RO_CUDA_DISPATCH_FLOAT(dtype, {
    constexpr int V = vec_of<scalar_t>();
    const scalar_t* xs = static_cast<const scalar_t*>(x);
    scalar_t* os = static_cast<scalar_t*>(out);
    const auto* ws = static_cast<const acc_t<scalar_t>*>(w_acc);
    const bool vec = (H % V) == 0 && aligned16(x) && aligned16(out);
    if (vec && ws)
      _gather_sum_kernel<scalar_t, V, true><<<grid, kThreads, 0, stream>>>(xs, R, H, row_id_map, T, K, ws, os);
    else if (vec)
      _gather_sum_kernel<scalar_t, V, false><<<grid, kThreads, 0, stream>>>(xs, R, H, row_id_map, T, K, ws, os);
    else if (ws)
      _gather_sum_kernel<scalar_t, 1, true><<<grid, kThreads, 0, stream>>>(xs, R, H, row_id_map, T, K, ws, os);
    else
      _gather_sum_kernel<scalar_t, 1, false><<<grid, kThreads, 0, stream>>>(xs, R, H, row_id_map, T, K, ws, os);
    return cudaGetLastError();
  });
  return cudaSuccess;
}

cudaError_t unpermute_bwd(const void* grad_out, const void* x, DType dtype, int64_t R, int64_t H,
                          const int32_t* row_id_map, const int32_t* sorted_slots,
                          int64_t n_slots, int64_t T, int64_t K, const void* w_acc,
                          void* grad_x, void* grad_w_acc, cudaStream_t stream) {
  if (R < 0 || H < 0 || T < 0 || K < 1) return cudaErrorInvalidValue;
  const int32_t k32 = static_cast<int32_t>(K);
  RO_CUDA_DISPATCH_FLOAT(dtype, {
    using A = acc_t<scalar_t>;
    constexpr int V = vec_of<scalar_t>();
    const scalar_t* go = static_cast<const scalar_t*>(grad_out);
    const scalar_t* xs = static_cast<const scalar_t*>(x);
    const A* ws = static_cast<const A*>(w_acc);
    scalar_t* gx = static_cast<scalar_t*>(grad_x);
    A* gw = static_cast<A*>(grad_w_acc);
    const bool vec = (H % V) == 0 && aligned16(grad_out) && aligned16(x) && aligned16(grad_x);
    if (R > 0 && H > 0) {
      const unsigned grid = grid_1d(ceil_div(R, kRowsPerCta));
      if (vec)
        _unpermute_bwd_x_kernel<scalar_t, V><<<grid, kThreads, 0, stream>>>(go, T, H, sorted_slots, n_slots, k32, ws, R, gx);
      else
        _unpermute_bwd_x_kernel<scalar_t, 1><<<grid, kThreads, 0, stream>>>(go, T, H, sorted_slots, n_slots, k32, ws, R, gx);
    }
    if (T > 0) {
      const unsigned grid = grid_1d(ceil_div(T, kRowsPerCta));
      if (vec)
        _unpermute_bwd_w_kernel<scalar_t, V><<<grid, kThreads, 0, stream>>>(go, xs, R, H, row_id_map, T, K, gw);
      else
        _unpermute_bwd_w_kernel<scalar_t, 1><<<grid, kThreads, 0, stream>>>(go, xs, R, H, row_id_map, T, K, gw);
    }
    return cudaGetLastError();
  });
  return cudaSuccess;
}

cudaError_t permute_probs_fwd(const void* probs, DType dtype, int64_t stride_pt,
                              int64_t stride_pe, int64_t T, int64_t E,
                              const int32_t* sorted_slots, int64_t n_slots,
                              const int32_t* indices32, int64_t K, int64_t num_rows, void* out,
                              cudaStream_t stream) {
  if (T < 0 || E < 0 || K < 1 || num_rows < 0) return cudaErrorInvalidValue;
  if (num_rows == 0) return cudaSuccess;
  const unsigned grid = grid_1d(ceil_div(num_rows, kThreads));
  RO_CUDA_DISPATCH_FLOAT(dtype, {
    _permute_probs_fwd_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(probs), stride_pt, stride_pe, T, E, sorted_slots, n_slots,
        indices32, static_cast<int32_t>(K), num_rows, static_cast<scalar_t*>(out));
    return cudaGetLastError();
  });
  return cudaSuccess;
}

cudaError_t permute_probs_bwd(const void* grad, DType dtype, int64_t R,
                              const int32_t* row_id_map, const int32_t* indices32, int64_t T,
                              int64_t K, int64_t E, void* out, cudaStream_t stream) {
  if (R < 0 || T < 0 || K < 1 || E < 0) return cudaErrorInvalidValue;
  if (T == 0 || E == 0) return cudaSuccess;
  const unsigned grid = grid_1d(ceil_div(T, kRowsPerCta));
  RO_CUDA_DISPATCH_FLOAT(dtype, {
    _permute_probs_bwd_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(grad), R, row_id_map, indices32, T, K, E,
        static_cast<scalar_t*>(out));
    return cudaGetLastError();
  });
  return cudaSuccess;
}

}  // namespace replay_cuda
