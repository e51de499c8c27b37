// Checks (and the gate's output allocation) shared by the CPU and CUDA implementations of
// the internal replay_native::* ops.
//
// The public ops (replay_ops/ops.py) check every input before a backend runs; these checks
// guard the internal ops against direct calls: every tensor on the expected device with the
// expected dtype (a host pointer must never reach a CUDA kernel), a known score function id,
// and a plan that fits its int32 tensors (the one C++ copy of the plan's capacity rule; the
// Python one is replay_ops.plan.plan_capacity).
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "native_ops.h"
#include "replay_math.h"
#include "replay_score_funcs.h"
#include "replay_select.h"

namespace replay_native {

inline int64_t checked_plan_capacity(int64_t T, int64_t K, int64_t E, int64_t align) {
  TORCH_CHECK_VALUE(align >= 1, "replay_ops native gate: align must be >= 1, got ", align);
  // T*K or E*(align-1) can wrap int64 for a huge align: checked products
  int64_t tk = 0, pad = 0, n = 0;
  const bool exact = !__builtin_mul_overflow(T, K, &tk) &&
                     !__builtin_mul_overflow(E, align - 1, &pad) && !__builtin_add_overflow(tk, pad, &n);
  TORCH_CHECK_VALUE(exact && n < (int64_t(1) << 31), "replay_ops native gate: the plan needs "
                    "T*K + E*(align-1) = ", exact ? std::to_string(n) : std::string("over 2^63"),
                    " rows (T=", T, ", K=", K, ", E=", E, ", align=", align, "), which does not "
                    "fit its int32 tensors");
  return n;
}

inline int checked_score_func(int64_t id) {
  TORCH_CHECK_VALUE(replay_math::score_func_name(static_cast<int>(id)) != nullptr &&
                        id >= 0 && id < replay_math::kNumScoreFuncs,
                    "replay_ops native: unknown score function id ", id, " (the ids come from "
                    "replay_ops/scores.py)");
  return static_cast<int>(id);
}

// `t` is on `device`.
inline void check_device(const at::Tensor& t, const char* op, const char* arg,
                         const c10::Device& device) {
  TORCH_CHECK_VALUE(t.device() == device, "replay_ops native ", op, ": ", arg, " is on ",
                    t.device(), " but the op runs on ", device);
}

// `t` is an int32 tensor on `device` (a plan tensor).
inline void check_plan_tensor(const at::Tensor& t, const char* op, const char* arg,
                              const c10::Device& device) {
  check_device(t, op, arg, device);
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, "replay_ops native ", op, ": ", arg,
                    " must be int32, got ", t.scalar_type());
}

// `t` is a float16/bfloat16/float32/float64 tensor on `device`.
inline void check_float_tensor(const at::Tensor& t, const char* op, const char* arg,
                               const c10::Device& device) {
  check_device(t, op, arg, device);
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kFloat || s == at::kDouble || s == at::kHalf || s == at::kBFloat16,
                    "replay_ops native ", op, ": ", arg, " must be float16, bfloat16, float32 "
                    "or float64, got ", s);
}

// `t` is an int16/int32/int64 tensor on `device` (recorded expert indices).
inline void check_index_tensor(const at::Tensor& t, const char* op, const char* arg,
                               const c10::Device& device) {
  check_device(t, op, arg, device);
  const auto s = t.scalar_type();
  TORCH_CHECK_VALUE(s == at::kShort || s == at::kInt || s == at::kLong, "replay_ops native ",
                    op, ": ", arg, " must be int16, int32 or int64, got ", s);
}

// ------------------------------------------------------------------ per-op input checks
// The shapes, dtypes and devices each internal op takes; `device` is where the
// implementation runs (the CPU, or the CUDA device of the first tensor).

inline void check_gate_fwd(const at::Tensor& logits, const at::Tensor& expert_indices,
                           const c10::Device& device) {
  TORCH_CHECK_VALUE(logits.dim() == 2, "replay_ops native gate: logits must be 2-D [T, E], "
                    "got ", logits.sizes());
  TORCH_CHECK_VALUE(expert_indices.dim() == 2 && expert_indices.size(0) == logits.size(0),
                    "replay_ops native gate: expert_indices must be [T, K] with T=",
                    logits.size(0), ", got ", expert_indices.sizes());
  check_float_tensor(logits, "gate", "logits", device);
  check_index_tensor(expert_indices, "gate", "expert_indices", device);
}

inline void check_gate_bwd(const at::Tensor& grad_weights, const at::Tensor& logits,
                           const at::Tensor& expert_indices, const c10::Device& device) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && expert_indices.dim() == 2 &&
                        expert_indices.size(0) == logits.size(0) &&
                        grad_weights.sizes() == expert_indices.sizes(),
                    "replay_ops native gate_backward: expected logits [T, E] and grad_weights, "
                    "expert_indices [T, K]; got ", logits.sizes(), ", ", grad_weights.sizes(),
                    ", ", expert_indices.sizes());
  check_float_tensor(logits, "gate_backward", "logits", device);
  check_float_tensor(grad_weights, "gate_backward", "grad_weights", device);
  check_plan_tensor(expert_indices, "gate_backward", "expert_indices", device);
}

inline void check_permute_fwd(const at::Tensor& hidden, const at::Tensor& sorted_slots,
                              const at::Tensor& row_id_map, int64_t num_rows,
                              const c10::Device& device) {
  TORCH_CHECK_VALUE(hidden.dim() == 2 && row_id_map.dim() == 2 && sorted_slots.dim() == 1 &&
                        num_rows >= 0,
                    "replay_ops native permute: expected hidden [T, H], sorted_slots [N], "
                    "row_id_map [T, K] and num_rows >= 0; got ", hidden.sizes(), ", ",
                    sorted_slots.sizes(), ", ", row_id_map.sizes(), ", num_rows=", num_rows);
  check_float_tensor(hidden, "permute", "hidden", device);
  check_plan_tensor(sorted_slots, "permute", "sorted_slots", device);
  check_plan_tensor(row_id_map, "permute", "row_id_map", device);
}

// permute_bwd (weights == nullptr) and unpermute_fwd: a gather-sum of x's rows per token.
inline void check_gather_sum(const at::Tensor& x, const at::Tensor& row_id_map,
                             const at::Tensor* weights, const char* op,
                             const c10::Device& device) {
  TORCH_CHECK_VALUE(x.dim() == 2 && row_id_map.dim() == 2, "replay_ops native ", op,
                    ": expected rows [R, H] and row_id_map [T, K]; got ", x.sizes(), " and ",
                    row_id_map.sizes());
  TORCH_CHECK_VALUE(weights == nullptr || weights->sizes() == row_id_map.sizes(),
                    "replay_ops native ", op, ": weights must be [T, K] like row_id_map ",
                    row_id_map.sizes(), ", got ", weights ? weights->sizes() : row_id_map.sizes());
  check_float_tensor(x, op, "rows", device);
  check_plan_tensor(row_id_map, op, "row_id_map", device);
  if (weights) check_float_tensor(*weights, op, "weights", device);
}

inline void check_unpermute_bwd(const at::Tensor& grad_out, const at::Tensor& expert_out,
                                const at::Tensor& row_id_map, const at::Tensor& sorted_slots,
                                const at::Tensor& weights, const c10::Device& device) {
  TORCH_CHECK_VALUE(grad_out.dim() == 2 && expert_out.dim() == 2 && row_id_map.dim() == 2 &&
                        sorted_slots.dim() == 1 && weights.sizes() == row_id_map.sizes() &&
                        grad_out.size(0) == row_id_map.size(0) &&
                        grad_out.size(1) == expert_out.size(1),
                    "replay_ops native unpermute_backward: expected grad_out [T, H], expert_out "
                    "[R, H], row_id_map and weights [T, K], sorted_slots [N]; got ",
                    grad_out.sizes(), ", ", expert_out.sizes(), ", ", row_id_map.sizes(), ", ",
                    weights.sizes(), ", ", sorted_slots.sizes());
  check_float_tensor(grad_out, "unpermute_backward", "grad_out", device);
  check_float_tensor(expert_out, "unpermute_backward", "expert_out", device);
  check_plan_tensor(row_id_map, "unpermute_backward", "row_id_map", device);
  check_plan_tensor(sorted_slots, "unpermute_backward", "sorted_slots", device);
  check_float_tensor(weights, "unpermute_backward", "weights", device);
}

inline void check_gate_dense_fwd(const at::Tensor& logits, const at::Tensor& expert_indices,
                                 const c10::optional<at::Tensor>& replay_mask,
                                 const c10::optional<at::Tensor>& fallback, int64_t padding,
                                 int64_t ep_size, int64_t spread_offset,
                                 const c10::Device& device) {
  check_gate_fwd(logits, expert_indices, device);
  const int64_t T = logits.size(0), E = logits.size(1), K = expert_indices.size(1);
  TORCH_CHECK_VALUE(padding >= replay_math::kPadEmpty && padding <= replay_math::kPadSelect,
                    "replay_ops native gate_dense: unknown padding mode ", padding);
  TORCH_CHECK_VALUE(ep_size >= 1 && E % ep_size == 0 && spread_offset >= 0,
                    "replay_ops native gate_dense: ep_size=", ep_size, " must divide E=", E,
                    " and spread_offset=", spread_offset, " must be >= 0");
  TORCH_CHECK_VALUE(K <= E, "replay_ops native gate_dense: K=", K, " slots exceed E=", E);
  if (replay_mask) {
    check_device(*replay_mask, "gate_dense", "replay_mask", device);
    TORCH_CHECK_VALUE(replay_mask->scalar_type() == at::kBool && replay_mask->dim() == 1 &&
                          replay_mask->size(0) == T,
                      "replay_ops native gate_dense: replay_mask must be bool [T]");
  }
  TORCH_CHECK_VALUE(fallback || padding != replay_math::kPadFallback,
                    "replay_ops native gate_dense: padding 'fallback' needs fallback indices");
  if (fallback) {
    check_index_tensor(*fallback, "gate_dense", "fallback", device);
    TORCH_CHECK_VALUE(fallback->sizes() == expert_indices.sizes(),
                      "replay_ops native gate_dense: fallback must be [T, K] like "
                      "expert_indices, got ", fallback->sizes());
  }
}

inline void check_gate_dense_bwd(const at::Tensor& grad_probs, const at::Tensor& logits,
                                 const at::Tensor& expert_indices, const c10::Device& device) {
  TORCH_CHECK_VALUE(logits.dim() == 2 && expert_indices.dim() == 2 &&
                        expert_indices.size(0) == logits.size(0) &&
                        grad_probs.sizes() == logits.sizes(),
                    "replay_ops native gate_dense_backward: expected logits and grad_probs "
                    "[T, E], expert_indices [T, K]; got ", logits.sizes(), ", ",
                    grad_probs.sizes(), ", ", expert_indices.sizes());
  check_float_tensor(logits, "gate_dense_backward", "logits", device);
  check_device(grad_probs, "gate_dense_backward", "grad_probs", device);
  TORCH_CHECK_VALUE(grad_probs.scalar_type() == logits.scalar_type(),
                    "replay_ops native gate_dense_backward: grad_probs must have the logits "
                    "dtype ", logits.scalar_type(), ", got ", grad_probs.scalar_type());
  check_plan_tensor(expert_indices, "gate_dense_backward", "expert_indices", device);
}

inline void check_permute_probs_fwd(const at::Tensor& probs, const at::Tensor& sorted_slots,
                                    const at::Tensor& expert_indices, int64_t num_rows,
                                    const c10::Device& device) {
  TORCH_CHECK_VALUE(probs.dim() == 2 && sorted_slots.dim() == 1 && expert_indices.dim() == 2 &&
                        expert_indices.size(0) == probs.size(0) && num_rows >= 0,
                    "replay_ops native permute_probs: expected probs [T, E], sorted_slots [N], "
                    "expert_indices [T, K], num_rows >= 0; got ", probs.sizes(), ", ",
                    sorted_slots.sizes(), ", ", expert_indices.sizes(), ", ", num_rows);
  check_float_tensor(probs, "permute_probs", "probs", device);
  check_plan_tensor(sorted_slots, "permute_probs", "sorted_slots", device);
  check_plan_tensor(expert_indices, "permute_probs", "expert_indices", device);
}

inline void check_permute_probs_bwd(const at::Tensor& grad, const at::Tensor& row_id_map,
                                    const at::Tensor& expert_indices, int64_t num_experts,
                                    const c10::Device& device) {
  TORCH_CHECK_VALUE(grad.dim() == 1 && row_id_map.dim() == 2 &&
                        expert_indices.sizes() == row_id_map.sizes() && num_experts >= 0,
                    "replay_ops native permute_probs_backward: expected grad [R], row_id_map "
                    "and expert_indices [T, K], num_experts >= 0; got ", grad.sizes(), ", ",
                    row_id_map.sizes(), ", ", expert_indices.sizes(), ", ", num_experts);
  check_float_tensor(grad, "permute_probs_backward", "grad", device);
  check_plan_tensor(row_id_map, "permute_probs_backward", "row_id_map", device);
  check_plan_tensor(expert_indices, "permute_probs_backward", "expert_indices", device);
}

// ------------------------------------------------------------------ the selection
// The model's own selection of a gate call (replay_select.h) and the rows it routes: the
// replay mask (contiguous), the padding mode, the selection's parameters and its bias in
// the compute type (contiguous), or undefined tensors.
struct GateSelection {
  at::Tensor mask, bias;
  int padding;
  replay_math::SelectionParams params;
};

// The selection arguments of gate_fwd / gate_dense_fwd, checked against the call's sizes
// (the Python ops check them first, with the same rules: replay_ops/_validate.py
// check_selection). `group_topn` is resolved (group_score_topn, or K / group_topk).
inline GateSelection checked_gate_selection(
    const char* op, const at::Tensor& logits, int64_t K, int sf,
    const c10::optional<at::Tensor>& replay_mask, int64_t padding,
    const c10::optional<at::Tensor>& expert_bias, int64_t source, bool round_scores,
    int64_t num_groups, int64_t group_topk, int64_t group_topn, bool dense,
    const c10::Device& device) {
  const int64_t T = logits.size(0), E = logits.size(1);
  namespace rm = replay_math;
  GateSelection s;
  TORCH_CHECK_VALUE(dense || padding == rm::kPadEmpty || padding == rm::kPadSelect,
                    "replay_ops native ", op, ": padding must be empty (", rm::kPadEmpty,
                    ") or select (", rm::kPadSelect, "), got ", padding);
  s.padding = static_cast<int>(padding);
  TORCH_CHECK_VALUE(source == rm::kSelectScores || (source == rm::kSelectLogits &&
                                                    sf == rm::kSoftmax),
                    "replay_ops native ", op, ": selection_source=", source,
                    " must be 0 (scores) or, with softmax, 1 (logits)");
  const bool grouped = num_groups > 0 || group_topk > 0;
  if (grouped) {
    TORCH_CHECK_VALUE(num_groups > 0 && group_topk > 0 && group_topk <= num_groups &&
                          E % num_groups == 0 && group_topn >= 1 &&
                          group_topn <= E / num_groups && K <= group_topk * (E / num_groups),
                      "replay_ops native ", op, ": group-limited selection needs num_groups "
                      "> 0 dividing E=", E, ", 0 < group_topk <= num_groups, 1 <= group_topn "
                      "<= E / num_groups and K <= group_topk * E / num_groups; got num_groups=",
                      num_groups, ", group_topk=", group_topk, ", group_topn=", group_topn,
                      ", K=", K);
  }
  s.params = rm::SelectionParams{static_cast<int>(source), round_scores,
                                 grouped ? num_groups : 0, grouped ? group_topk : 0,
                                 grouped ? group_topn : 0};
  if (replay_mask) {
    check_device(*replay_mask, op, "replay_mask", device);
    TORCH_CHECK_VALUE(replay_mask->scalar_type() == at::kBool && replay_mask->dim() == 1 &&
                          replay_mask->size(0) == T,
                      "replay_ops native ", op, ": replay_mask must be bool [T]");
    s.mask = replay_mask->contiguous();
  }
  if (expert_bias) {
    check_float_tensor(*expert_bias, op, "expert_bias", device);
    TORCH_CHECK_VALUE(expert_bias->dim() == 1 && expert_bias->size(0) == E,
                      "replay_ops native ", op, ": expert_bias must be [E] with E=", E,
                      ", got ", expert_bias->sizes());
    const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    s.bias = expert_bias->to(acc).contiguous();
  }
  return s;
}

// The gradient of set_logprob [T] in the compute type (contiguous), or an undefined tensor.
inline at::Tensor checked_set_logprob_grad(const c10::optional<at::Tensor>& g,
                                           const at::Tensor& logits, const c10::Device& device) {
  if (!g) return at::Tensor();
  check_float_tensor(*g, "gate_backward", "grad_set_logprob", device);
  TORCH_CHECK_VALUE(g->dim() == 1 && g->size(0) == logits.size(0),
                    "replay_ops native gate_backward: grad_set_logprob must be [T] with T=",
                    logits.size(0), ", got ", g->sizes());
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return g->to(acc).contiguous();
}

// ------------------------------------------------------------------ gate outputs
// agreement (bool) and set_logprob (compute type): [T] when asked for, else [0].
inline void agreement_tensors(const at::Tensor& logits, bool asked, at::Tensor& agreement,
                              at::Tensor& set_logprob) {
  const int64_t n = asked ? logits.size(0) : 0;
  const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  agreement = at::empty({n}, logits.options().dtype(at::kBool));
  set_logprob = at::empty({n}, logits.options().dtype(acc));
}

// The eight outputs of gate_fwd, allocated on the logits' device: weights [T, K] in the
// logits dtype (with weights_acc in the compute type: float32 for half and bfloat16 logits),
// then int32 indices [T, K], counts [E], offsets [E + 1], row_id_map [T, K] and
// sorted_slots [plan capacity] (checked to fit int32), agreement and set_logprob.
struct GateOutputs {
  at::Tensor weights, idx32, counts, offsets, row_id_map, sorted_slots, agreement, set_logprob;

  GateOutputs(const at::Tensor& logits, int64_t K, int64_t align, bool asked,
              bool weights_acc = false) {
    const int64_t T = logits.size(0), E = logits.size(1);
    const auto i32 = logits.options().dtype(at::kInt);
    const auto acc = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    weights = at::empty({T, K}, weights_acc ? logits.options().dtype(acc) : logits.options());
    idx32 = at::empty({T, K}, i32);
    counts = at::empty({E}, i32);
    offsets = at::empty({E + 1}, i32);
    row_id_map = at::empty({T, K}, i32);
    sorted_slots = at::empty({checked_plan_capacity(T, K, E, align)}, i32);
    agreement_tensors(logits, asked, agreement, set_logprob);
  }

  GateFwdResult tuple() const {
    return {weights, idx32, counts, offsets, row_id_map, sorted_slots, agreement, set_logprob};
  }
};

// The ten outputs of gate_dense_fwd: probs [T, E] (logits dtype), routing_map [T, E] bool,
// row_flags [T] uint8, int32 indices [T, K], then the plan (sizes 0 without with_plan),
// agreement and set_logprob.
struct DenseGateOutputs {
  at::Tensor probs, routing_map, row_flags, idx32, counts, offsets, row_id_map, sorted_slots,
      agreement, set_logprob;

  DenseGateOutputs(const at::Tensor& logits, int64_t K, int64_t align, bool with_plan,
                   bool asked) {
    const int64_t T = logits.size(0), E = logits.size(1);
    const auto i32 = logits.options().dtype(at::kInt);
    probs = at::empty({T, E}, logits.options());
    routing_map = at::empty({T, E}, logits.options().dtype(at::kBool));
    row_flags = at::empty({T}, logits.options().dtype(at::kByte));
    idx32 = at::empty({T, K}, i32);
    const int64_t n = checked_plan_capacity(T, K, E, align);
    counts = at::empty({with_plan ? E : 0}, i32);
    offsets = at::empty({with_plan ? E + 1 : 0}, i32);
    row_id_map = at::empty({with_plan ? T : 0, K}, i32);
    sorted_slots = at::empty({with_plan ? n : 0}, i32);
    agreement_tensors(logits, asked, agreement, set_logprob);
  }

  GateDenseFwdResult tuple() const {
    return {probs, routing_map, row_flags, idx32, counts, offsets, row_id_map, sorted_slots,
            agreement, set_logprob};
  }
};

}  // namespace replay_native
