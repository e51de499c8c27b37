// The internal replay_native::* ops, each written once, for both devices.
//
// REPLAY_NATIVE_OPS(X) calls X(name, signature) for every op: register_cpu.cpp defines the
// schemas from it (`#name signature`), and the CPU and CUDA registrations register their
// kernels from it. The C++ signature of each kernel is in native_ops.inc, included inside
// the namespace that defines the kernels (replay_cpu; the CUDA bindings' unnamed
// namespace): a kernel defined with another signature is a second overload beside the
// declared one, and the build stops where every op's name must be one function (the CUDA
// registration's `&name`; REPLAY_NATIVE_CHECK_ONE at the end of each CPU kernel file, whose
// registration in register_cpu.cpp sees the declarations alone).
//
// The native backend (replay_ops/backends/native.py) calls these ops; the public ops
// (replay::gate, permute, unpermute, ...) are defined by replay_ops/ops.py. Score functions
// are passed by their id in the table of replay_ops/scores.py.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <type_traits>

namespace replay_native {

// The outputs of the ops that return several tensors, as native_ops.inc declares them.
// gate_fwd: weights, int32 indices, counts, offsets, row_id_map, sorted_slots, agreement,
// set_logprob (GateOutputs).
using GateFwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                 at::Tensor, at::Tensor, at::Tensor>;
// gate_dense_fwd: probs, routing_map, row_flags, int32 indices, then the plan, agreement,
// set_logprob (DenseGateOutputs).
using GateDenseFwdResult =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
               at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// unpermute_bwd: the gradients of expert_out and of the weights.
using UnpermuteBwdResult = std::tuple<at::Tensor, at::Tensor>;

}  // namespace replay_native

#define REPLAY_NATIVE_OPS(X)                                                                   \
  X(gate_fwd,                                                                                  \
    "(Tensor logits, Tensor expert_indices, Tensor? replay_mask, Tensor? expert_bias, "       \
    "int score_func, bool normalize, float scaling_factor, int align, int padding, "          \
    "int selection_source, bool round_scores, int num_groups, int group_topk, "               \
    "int group_topn, bool agreement, bool weights_acc=False) -> "                             \
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")                       \
  X(gate_bwd,                                                                                  \
    "(Tensor grad_weights, Tensor logits, Tensor expert_indices, Tensor? grad_set_logprob, "  \
    "int score_func, bool normalize, float scaling_factor) -> Tensor")                        \
  X(permute_fwd,                                                                               \
    "(Tensor hidden, Tensor sorted_slots, Tensor row_id_map, int num_rows) -> Tensor")        \
  X(permute_bwd, "(Tensor grad_out, Tensor row_id_map) -> Tensor")                            \
  X(unpermute_fwd, "(Tensor expert_out, Tensor row_id_map, Tensor weights) -> Tensor")        \
  X(unpermute_bwd,                                                                             \
    "(Tensor grad_out, Tensor expert_out, Tensor row_id_map, Tensor sorted_slots, "           \
    "Tensor weights) -> (Tensor, Tensor)")                                                    \
  X(gate_dense_fwd,                                                                            \
    "(Tensor logits, Tensor expert_indices, Tensor? replay_mask, Tensor? fallback, "          \
    "Tensor? expert_bias, int score_func, bool normalize, float scaling_factor, "             \
    "int padding, int ep_size, int spread_offset, bool underflow_guard, int align, "          \
    "bool with_plan, int selection_source, bool round_scores, int num_groups, "               \
    "int group_topk, int group_topn, bool agreement) -> "                                     \
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")       \
  X(gate_dense_bwd,                                                                            \
    "(Tensor grad_probs, Tensor logits, Tensor expert_indices, Tensor? grad_set_logprob, "    \
    "int score_func, bool normalize, float scaling_factor) -> Tensor")                        \
  X(permute_probs_fwd,                                                                         \
    "(Tensor probs, Tensor sorted_slots, Tensor expert_indices, int num_rows) -> Tensor")     \
  X(permute_probs_bwd,                                                                         \
    "(Tensor grad, Tensor row_id_map, Tensor expert_indices, int num_experts) -> Tensor")

// In a TORCH_LIBRARY block `m`: every op's schema.
#define REPLAY_NATIVE_DEF_ONE(name, signature) m.def(#name signature);
// In a TORCH_LIBRARY_IMPL block `m`: every op's kernel, the function `name` in scope.
#define REPLAY_NATIVE_IMPL_ONE(name, signature) m.impl(#name, &name);
// After the kernels' definitions, in their namespace: every op's name is one function, the
// one native_ops.inc declares (decltype cannot take the address of an overloaded name).
#define REPLAY_NATIVE_CHECK_ONE(name, signature)                                               \
  static_assert(std::is_function<std::remove_pointer_t<decltype(&name)>>::value, #name);
