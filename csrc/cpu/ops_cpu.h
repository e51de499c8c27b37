// Declarations of the CPU implementations of the internal replay_native::* ops.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace replay_cpu {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gate_fwd(
    const at::Tensor& logits, const at::Tensor& expert_indices, int64_t score_func,
    bool normalize, double scaling_factor, int64_t align);

at::Tensor gate_bwd(const at::Tensor& grad_weights, const at::Tensor& logits,
                    const at::Tensor& expert_indices, int64_t score_func, bool normalize,
                    double scaling_factor);

at::Tensor permute_fwd(const at::Tensor& hidden, const at::Tensor& sorted_slots,
                       const at::Tensor& row_id_map, int64_t num_rows);

at::Tensor permute_bwd(const at::Tensor& grad_out, const at::Tensor& row_id_map);

at::Tensor unpermute_fwd(const at::Tensor& expert_out, const at::Tensor& row_id_map,
                         const at::Tensor& weights);

std::tuple<at::Tensor, at::Tensor> unpermute_bwd(const at::Tensor& grad_out,
                                                 const at::Tensor& expert_out,
                                                 const at::Tensor& row_id_map,
                                                 const at::Tensor& sorted_slots,
                                                 const at::Tensor& weights);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
           at::Tensor>
gate_dense_fwd(const at::Tensor& logits, const at::Tensor& expert_indices,
               const c10::optional<at::Tensor>& replay_mask,
               const c10::optional<at::Tensor>& fallback, int64_t score_func, bool normalize,
               double scaling_factor, int64_t padding, int64_t ep_size, int64_t spread_offset,
               bool underflow_guard, int64_t align, bool with_plan);

at::Tensor gate_dense_bwd(const at::Tensor& grad_probs, const at::Tensor& logits,
                          const at::Tensor& expert_indices, int64_t score_func, bool normalize,
                          double scaling_factor);

at::Tensor permute_probs_fwd(const at::Tensor& probs, const at::Tensor& sorted_slots,
                             const at::Tensor& expert_indices, int64_t num_rows);

at::Tensor permute_probs_bwd(const at::Tensor& grad, const at::Tensor& row_id_map,
                             const at::Tensor& expert_indices, int64_t num_experts);

}  // namespace replay_cpu
