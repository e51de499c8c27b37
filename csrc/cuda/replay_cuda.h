// Framework-free launchers of the replay_ops CUDA kernels.
//
// Raw device pointers, sizes and a cudaStream_t: no PyTorch header is needed, so nvcc can
// compile these files on their own (.ci/check_cuda.sh) and any framework can call them.
// The PyTorch bindings live in csrc/bindings/register_cuda.cpp.
//
// Every launcher only enqueues work on `stream` (no host synchronisation, no allocation, no
// device atomics on floats), so all of them can be captured in a CUDA graph. Results are
// bitwise deterministic: every output element has exactly one writer, and reductions run in
// a fixed order.
#pragma once

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "replay_limits.h"
#include "replay_select.h"

namespace replay_cuda {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3 };
enum class IType : int { kInt16 = 0, kInt32 = 1, kInt64 = 2 };

// Problems with T*K up to this many slots take the single-launch path.
constexpr int64_t kSmallSlots = 8192;

struct GateFwdArgs {
  // inputs
  const void* logits;      // [T, E], row stride `stride_lt` elements, unit column stride
  DType logits_dtype;
  int64_t stride_lt;
  const void* indices;     // [T, K], strides (stride_it, stride_ik) elements
  IType index_dtype;
  int64_t stride_it, stride_ik;
  int64_t T, E, K, align;
  int score_func;          // replay_math::ScoreFunc (ids of replay_ops/scores.py)
  bool normalize;
  double scaling_factor;
  // outputs (contiguous)
  void* weights;           // [T, K], logits dtype (the compute type with weights_acc)
  int32_t* indices32;      // [T, K]
  int32_t* tokens_per_expert;  // [E]
  int32_t* expert_offsets;     // [E + 1]
  int32_t* row_id_map;         // [T, K]
  int32_t* sorted_slots;       // [replay_math::plan_capacity(T, K, E, align)]
  // Upper bound on the CTAs of the cooperative path (0: as many as fit on the device), e.g.
  // to leave SMs to a concurrent communication kernel. The result does not depend on it.
  int64_t max_ctas = 0;
  // The weights in the compute type, unrounded (replay_ops' weights_dtype), not the logits
  // dtype.
  bool weights_acc = false;
  // Dense mode (probs != nullptr; gate_dense): `weights` is then a [T, K] scratch buffer in
  // the compute type, and the kernels also write the row flags, route flagged rows by the
  // padding mode, and write the dense rows (each CTA zero-fills its own rows, then each
  // row's thread writes its routed experts: no memset launch, no global scatter).
  void* probs = nullptr;           // [T, E], logits dtype
  uint8_t* routing_map = nullptr;  // [T, E] bool
  uint8_t* row_flags = nullptr;    // [T] (replay_math kRow* bits)
  const bool* replay_mask = nullptr;  // [T] or nullptr
  const int64_t* fallback = nullptr;  // [T, K] contiguous, or nullptr
  int padding = 0;                 // replay_math kPad*
  int64_t ep_size = 1;
  int64_t spread_offset = 0;       // already reduced mod E
  bool underflow_guard = false;
  bool with_plan = true;           // false: the dense rows only (plan outputs untouched);
                                   // only gate_dense sets it, and then T = 0 launches nothing
  // The model's own selection of flagged rows (replay_select.h, one thread per row, the
  // rule of the CPU kernels): gate (probs == nullptr) selects the rows whose replay_mask
  // is False and, with padding kPadSelect, the rows with flags; gate_dense selects, with
  // padding kPadSelect, the rows with flags (a masked row with a fallback takes the
  // fallback). Needs K, group_topk and group_topn <= kMaxSelectList (per-thread lists).
  replay_math::SelectionParams selection{replay_math::kSelectScores, false, 0, 0, 0};
  const void* expert_bias = nullptr;  // [E] in the compute type, or nullptr
  // The agreement outputs (agreement != nullptr): bool [T] and set_logprob [T] in the
  // compute type (replay_select.h).
  uint8_t* agreement = nullptr;
  void* set_logprob = nullptr;
};

// The longest ranked list one thread of the selection keeps: K, group_topk and group_topn
// of a call that selects or asks for the agreement are at most this.
constexpr int64_t kMaxSelectList = kMaxTopK;

// True when a gate call selects rows in the kernel or writes the agreement outputs.
inline bool gate_selects(const GateFwdArgs& a) {
  return a.agreement != nullptr || a.padding == replay_math::kPadSelect ||
         (a.probs == nullptr && a.replay_mask != nullptr);
}

// How gate_fwd runs its three steps (weights + per-chunk histograms, a scan over the chunks,
// the scatter). Every path gives the same bits.
enum class GatePath : int {
  kAuto = 0,         // kSingleCta when T*K <= kSmallSlots, else kCooperative where the device
                     // supports cooperative launches, else kThreeLaunches
  kSingleCta = 1,    // one launch of one CTA (T*K <= kSmallSlots only)
  kCooperative = 2,  // one cooperative launch: a persistent grid with grid-wide barriers
  kThreeLaunches = 3,
};

// Bytes of device workspace gate_fwd needs on `path`: 0 where the single CTA runs, else the
// per-chunk histograms (ceil(T/256) * E int32).
// `dense`: the call writes dense rows (GateFwdArgs::probs), which moves large outputs off
// the single CTA.
size_t gate_fwd_workspace_bytes(int64_t T, int64_t E, int64_t K,
                                GatePath path = GatePath::kAuto, bool dense = false);

// Gate weights plus dispatch plan, on `path` (see GatePath).
cudaError_t gate_fwd(const GateFwdArgs& args, void* workspace, cudaStream_t stream,
                     GatePath path = GatePath::kAuto);

// Dense [T, E] logits gradient (logits dtype) in one launch; grad_weights is [T, K] in the
// compute type (fp32, or fp64 for fp64 logits), indices32 the int32 indices gate_fwd used.
// With grad_set_logprob_acc ([T], compute type) the gradient of set_logprob is added to the
// row (replay_select.h: the set is the row's distinct used experts); nullptr: none.
cudaError_t gate_bwd(const void* grad_weights_acc, const void* logits, DType logits_dtype,
                     const int32_t* indices32, int64_t T, int64_t E, int64_t K,
                     int score_func, bool normalize, double scaling_factor, void* grad_logits,
                     cudaStream_t stream, const void* grad_set_logprob_acc = nullptr);

// Dense-mode gate backward: as gate_bwd, with the slot gradients read from the dense
// [T, E] probs gradient (logits dtype, strides in elements) at the routed experts.
cudaError_t gate_dense_bwd(const void* grad_probs, int64_t stride_gt, int64_t stride_ge,
                           const void* logits, DType logits_dtype, const int32_t* indices32,
                           int64_t T, int64_t E, int64_t K, int score_func, bool normalize,
                           double scaling_factor, void* grad_logits, cudaStream_t stream,
                           const void* grad_set_logprob_acc = nullptr);

// out[r] = probs[t, e] of the slot s = sorted_slots[r] (t = s / K, e = indices32[s]), 0 for
// padding and tail rows. probs has strides (stride_pt, stride_pe) elements.
cudaError_t permute_probs_fwd(const void* probs, DType dtype, int64_t stride_pt,
                              int64_t stride_pe, int64_t T, int64_t E,
                              const int32_t* sorted_slots, int64_t n_slots,
                              const int32_t* indices32, int64_t K, int64_t num_rows, void* out,
                              cudaStream_t stream);

// Dense [T, E]: out[t, e] = sum over the slots k of row t routed to e (row in [0, R)) of
// grad[row_id_map[t, k]], in slot order in the compute type; 0 elsewhere. One warp per row.
cudaError_t permute_probs_bwd(const void* grad, DType dtype, int64_t R,
                              const int32_t* row_id_map, const int32_t* indices32, int64_t T,
                              int64_t K, int64_t E, void* out, cudaStream_t stream);

// out[r] = hidden[sorted_slots[r] / K] for r < num_rows, zero rows for padding and tail.
cudaError_t permute_fwd(const void* hidden, int64_t elem_size, int64_t T, int64_t H,
                        const int32_t* sorted_slots, int64_t n_slots, int64_t K,
                        int64_t num_rows, void* out, cudaStream_t stream);

// out[t] = sum_k w[t, k] * x[row_id_map[t, k]] over rows in [0, R), fp32 (fp64) in column
// order; w == nullptr gives the plain gather-sum (permute backward). w is in the compute type.
cudaError_t gather_sum(const void* x, DType dtype, int64_t R, int64_t H,
                       const int32_t* row_id_map, int64_t T, int64_t K, const void* w_acc,
                       void* out, cudaStream_t stream);

// grad_x[r] = w[s] * grad_out[s / K] for the slot s of row r (zero rows without a slot), and
// grad_w[t, k] = <grad_out[t], x[row_id_map[t, k]]> (compute type).
cudaError_t unpermute_bwd(const void* grad_out, const void* x, DType dtype, int64_t R, int64_t H,
                          const int32_t* row_id_map, const int32_t* sorted_slots,
                          int64_t n_slots, int64_t T, int64_t K, const void* w_acc,
                          void* grad_x, void* grad_w_acc, cudaStream_t stream);

// Whether this build holds a kernel image the current device can run (cudaSuccess), or
// the error a launch would give (cudaErrorNoKernelImageForDevice on an architecture the
// build did not target and could not JIT from PTX). Host-side, no launch.
cudaError_t probe_kernel_image();

}  // namespace replay_cuda
