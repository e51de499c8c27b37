// Helpers shared by the CPU translation units (ATen types, index loads, chunking).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>

#include "replay_math.h"

namespace replay_cpu {

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

}  // namespace replay_cpu
