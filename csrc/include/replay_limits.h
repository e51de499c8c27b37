// Limits of the CUDA gate kernels, shared by the kernels and the Python side (the extension
// exports them as replay_ops._C.MAX_EXPERTS and MAX_TOPK; the backend registry hands larger
// problems to another backend). Framework-free: no CUDA or PyTorch header is needed.
#pragma once

#include <stdint.h>

namespace replay_cuda {

// Experts per gate call: the per-warp shared-memory histograms hold E counters each.
constexpr int64_t kMaxExperts = 1024;
// Slots per token in the gate backward: one lane of a warp per slot.
constexpr int64_t kMaxTopK = 32;

}  // namespace replay_cuda
