// CUDA implementations of the internal replay_native::* ops: thin wrappers that check
// shapes, dtypes and devices (every tensor on the device of the first; native_checks.h),
// allocate outputs with the caching allocator, and call the framework-free launchers of
// csrc/cuda/ on the current stream under a device guard. Nothing here synchronises with the
// host, so the ops are CUDA-graph capturable (data validation happens earlier, in Python,
// and only when validate=True).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "../cuda/replay_cuda.h"
#include "native_checks.h"
#include "native_ops.h"
#include "replay_math.h"

namespace {

// The kernels registered below, declared with the signatures of native_ops.inc.
#include "native_ops.inc"

using replay_cuda::DType;
using replay_cuda::IType;

DType dtype_of(const at::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    default:
      TORCH_CHECK(false, "replay_ops native CUDA: ", arg,
                  " must be float32, float16, bfloat16 or float64, got ", t.scalar_type());
  }
  return DType::kFloat32;
}

IType itype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kShort: return IType::kInt16;
    case at::kInt: return IType::kInt32;
    case at::kLong: return IType::kInt64;
    default:
      TORCH_CHECK(false, "replay_ops native CUDA: expert_indices must be int16, int32 or int64, "
                  "got ", t.scalar_type());
  }
  return IType::kInt32;
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The launch path of the CUDA gate (replay_cuda::GatePath); "auto" unless a test or a
// benchmark picks one with replay_native::cuda_gate_path.
std::atomic<int> g_gate_path{static_cast<int>(replay_cuda::GatePath::kAuto)};
std::atomic<int64_t> g_gate_max_ctas{0};

const char* gate_path_name(int p) {
  switch (static_cast<replay_cuda::GatePath>(p)) {
    case replay_cuda::GatePath::kSingleCta: return "single_cta";
    case replay_cuda::GatePath::kCooperative: return "cooperative";
    case replay_cuda::GatePath::kThreeLaunches: return "three_launches";
    default: return "auto";
  }
}

// replay_native::cuda_gate_path(str name) -> str: "" returns the current path; a name sets
// it and returns the previous one.
std::string cuda_gate_path(c10::string_view name_view) {
  const std::string name(name_view);
  const int prev = g_gate_path.load();
  if (name.empty()) return gate_path_name(prev);
  int p = -1;
  for (int i = 0; i < 4; ++i)
    if (name == gate_path_name(i)) p = i;
  TORCH_CHECK_VALUE(p >= 0, "replay_ops native CUDA: gate path '", name,
                    "' is unknown; expected auto, single_cta, cooperative or three_launches");
  g_gate_path.store(p);
  return gate_path_name(prev);
}

// replay_native::cuda_gate_max_ctas(int n) -> int: caps the CTAs of the cooperative gate
// (0: no cap; a negative n only queries) and returns the previous cap.
int64_t cuda_gate_max_ctas(int64_t n) {
  if (n < 0) return g_gate_max_ctas.load();
  return g_gate_max_ctas.exchange(n);
}

// replay_native::cuda_kernel_image(int device) -> str: "" when this build can run its
// kernels on CUDA device `device`, else the CUDA error a launch would give.
std::string cuda_kernel_image(int64_t device) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaError_t err = replay_cuda::probe_kernel_image();
  if (err == cudaSuccess) return "";
  (void)cudaGetLastError();  // the probe's error is reported here, not to the next launch
  return cudaGetErrorString(err);
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "replay_ops native CUDA ", op, " failed: ",
              cudaGetErrorString(err));
}

// The gate's launch path (set_gate_path), checked against the number of slots.
replay_cuda::GatePath checked_gate_path(int64_t T, int64_t K) {
  const auto path = static_cast<replay_cuda::GatePath>(g_gate_path.load());
  TORCH_CHECK_VALUE(path != replay_cuda::GatePath::kSingleCta || T * K <= replay_cuda::kSmallSlots,
                    "replay_ops native CUDA: gate path 'single_cta' takes T*K <= ",
                    replay_cuda::kSmallSlots, " slots, got T*K=", T * K);
  return path;
}

// The arguments both gate forwards share: the logits (rows of unit column stride), the
// indices, the shape and the weights' math; the caller sets the outputs.
replay_cuda::GateFwdArgs gate_fwd_args(const at::Tensor& logits, const at::Tensor& idx, int sf,
                                       bool normalize, double scaling_factor, int64_t align) {
  const int64_t E = logits.size(1);
  TORCH_CHECK_VALUE(E <= replay_cuda::kMaxExperts, "replay_ops native CUDA gate supports E <= ",
                    replay_cuda::kMaxExperts, " experts, got E=", E);
  replay_cuda::GateFwdArgs a{};
  a.logits = logits.data_ptr();
  a.logits_dtype = dtype_of(logits, "logits");
  a.stride_lt = logits.stride(0);
  a.indices = idx.data_ptr();
  a.index_dtype = itype_of(idx);
  a.stride_it = idx.stride(0);
  a.stride_ik = idx.stride(1);
  a.T = logits.size(0);
  a.E = E;
  a.K = idx.size(1);
  a.align = align;
  a.score_func = sf;
  a.normalize = normalize;
  a.scaling_factor = scaling_factor;
  a.max_ctas = g_gate_max_ctas.load();
  return a;
}

// The gate backward's limit on K (its per-thread arrays).
void check_backward_topk(const at::Tensor& idx) {
  TORCH_CHECK_VALUE(idx.size(1) <= replay_cuda::kMaxTopK, "replay_ops native CUDA "
                    "gate_backward supports K <= ", replay_cuda::kMaxTopK, ", got K=", idx.size(1));
}

// The model's own selection of flagged rows and the agreement outputs of a gate call
// (replay_select.h, in the kernel's per-row code): the checked selection, the bias, the
// mask and the agreement outputs into the launch arguments. The per-thread ranked lists
// hold kMaxSelectList entries: K, group_topk and group_topn above that are refused (the
// native backend's supports() hands such calls to another backend).
void set_selection(replay_cuda::GateFwdArgs& a, const char* op,
                   const replay_native::GateSelection& sel, at::Tensor& agreement,
                   at::Tensor& set_logprob) {
  a.padding = sel.padding;
  a.selection = sel.params;
  a.expert_bias = sel.bias.defined() ? sel.bias.data_ptr() : nullptr;
  a.replay_mask = sel.mask.defined() ? sel.mask.data_ptr<bool>() : nullptr;
  if (agreement.numel() > 0) {
    a.agreement = reinterpret_cast<uint8_t*>(agreement.data_ptr<bool>());
    a.set_logprob = set_logprob.data_ptr();
  }
  if (!replay_cuda::gate_selects(a)) return;
  constexpr int64_t cap = replay_cuda::kMaxSelectList;
  TORCH_CHECK_VALUE(a.K <= cap && a.selection.group_topk <= cap && a.selection.group_topn <= cap,
                    "replay_ops native CUDA ", op, ": the model's own selection and the "
                    "agreement outputs support K, group_topk and group_topn <= ", cap,
                    " (kMaxSelectList), got K=", a.K, ", group_topk=", a.selection.group_topk,
                    ", group_topn=", a.selection.group_topn);
}

replay_native::GateFwdResult gate_fwd(
    const at::Tensor& logits_in, const at::Tensor& idx,
    const c10::optional<at::Tensor>& replay_mask, const c10::optional<at::Tensor>& expert_bias,
    int64_t score_func, bool normalize, double scaling_factor, int64_t align, int64_t padding,
    int64_t selection_source, bool round_scores, int64_t num_groups, int64_t group_topk,
    int64_t group_topn, bool agreement, bool weights_acc) {
  replay_native::check_gate_fwd(logits_in, idx, logits_in.device());
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const replay_native::GateSelection sel = replay_native::checked_gate_selection(
      "gate", logits, idx.size(1), sf, replay_mask, padding, expert_bias, selection_source,
      round_scores, num_groups, group_topk, group_topn, false, logits.device());
  replay_cuda::GateFwdArgs a = gate_fwd_args(logits, idx, sf, normalize, scaling_factor, align);
  const int64_t T = a.T, E = a.E, K = a.K;
  replay_native::GateOutputs o(logits, K, align, agreement, weights_acc);
  a.weights_acc = o.weights.scalar_type() != logits.scalar_type();
  set_selection(a, "gate", sel, o.agreement, o.set_logprob);
  const auto path = checked_gate_path(T, K);
  const size_t ws_bytes = replay_cuda::gate_fwd_workspace_bytes(T, E, K, path);
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  a.weights = o.weights.data_ptr();
  a.indices32 = o.idx32.data_ptr<int32_t>();
  a.tokens_per_expert = o.counts.data_ptr<int32_t>();
  a.expert_offsets = o.offsets.data_ptr<int32_t>();
  a.row_id_map = o.row_id_map.data_ptr<int32_t>();
  a.sorted_slots = o.sorted_slots.data_ptr<int32_t>();
  check_launch(replay_cuda::gate_fwd(a, ws_bytes ? ws.data_ptr() : nullptr,
                                     c10::cuda::getCurrentCUDAStream(), path),
               "gate");
  return o.tuple();
}

at::Tensor gate_bwd(const at::Tensor& grad_weights, const at::Tensor& logits_in,
                    const at::Tensor& idx, const c10::optional<at::Tensor>& grad_set_logprob,
                    int64_t score_func, bool normalize, double scaling_factor) {
  replay_native::check_gate_bwd(grad_weights, logits_in, idx, logits_in.device());
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const int sf = replay_native::checked_score_func(score_func);
  check_backward_topk(idx);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor i32 = idx.contiguous();
  const at::Tensor g = grad_weights.to(acc_dtype(logits.scalar_type())).contiguous();
  const at::Tensor glp =
      replay_native::checked_set_logprob_grad(grad_set_logprob, logits, logits.device());
  at::Tensor grad = at::empty_like(logits);
  check_launch(replay_cuda::gate_bwd(g.data_ptr(), logits.data_ptr(), dtype_of(logits, "logits"),
                                     i32.data_ptr<int32_t>(), logits.size(0), logits.size(1),
                                     i32.size(1), sf, normalize, scaling_factor, grad.data_ptr(),
                                     c10::cuda::getCurrentCUDAStream(),
                                     glp.defined() ? glp.data_ptr() : nullptr),
               "gate_backward");
  return grad;
}

replay_native::GateDenseFwdResult gate_dense_fwd(
    const at::Tensor& logits_in, const at::Tensor& idx,
    const c10::optional<at::Tensor>& replay_mask, const c10::optional<at::Tensor>& fallback,
    const c10::optional<at::Tensor>& expert_bias, int64_t score_func, bool normalize,
    double scaling_factor, int64_t padding, int64_t ep_size, int64_t spread_offset,
    bool underflow_guard, int64_t align, bool with_plan, int64_t selection_source,
    bool round_scores, int64_t num_groups, int64_t group_topk, int64_t group_topn,
    bool agreement) {
  replay_native::check_gate_dense_fwd(logits_in, idx, replay_mask, fallback, padding, ep_size,
                                      spread_offset, logits_in.device());
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const int sf = replay_native::checked_score_func(score_func);
  const at::Tensor logits = logits_in.stride(1) == 1 ? logits_in : logits_in.contiguous();
  const replay_native::GateSelection sel = replay_native::checked_gate_selection(
      "gate_dense", logits, idx.size(1), sf, replay_mask, padding, expert_bias,
      selection_source, round_scores, num_groups, group_topk, group_topn, true,
      logits.device());
  replay_cuda::GateFwdArgs a = gate_fwd_args(logits, idx, sf, normalize, scaling_factor, align);
  const int64_t T = a.T, E = a.E, K = a.K;
  replay_native::DenseGateOutputs o(logits, K, align, with_plan, agreement);
  const at::Tensor fb = fallback ? fallback->to(at::kLong).contiguous() : at::Tensor();
  // the weights of the dense rows, in the compute type (scratch)
  at::Tensor w = at::empty({T, K}, logits.options().dtype(acc_dtype(logits.scalar_type())));
  // the path matters only for the plan (the dense rows alone are one launch)
  const auto path = with_plan ? checked_gate_path(T, K) : replay_cuda::GatePath::kAuto;
  const size_t ws_bytes =
      with_plan ? replay_cuda::gate_fwd_workspace_bytes(T, E, K, path, true) : 0;
  at::Tensor ws = at::empty({static_cast<int64_t>(ws_bytes)}, logits.options().dtype(at::kByte));
  a.weights = w.data_ptr();
  a.indices32 = o.idx32.data_ptr<int32_t>();
  if (with_plan) {
    a.tokens_per_expert = o.counts.data_ptr<int32_t>();
    a.expert_offsets = o.offsets.data_ptr<int32_t>();
    a.row_id_map = o.row_id_map.data_ptr<int32_t>();
    a.sorted_slots = o.sorted_slots.data_ptr<int32_t>();
  }
  a.probs = o.probs.data_ptr();
  a.routing_map = reinterpret_cast<uint8_t*>(o.routing_map.data_ptr<bool>());
  a.row_flags = o.row_flags.data_ptr<uint8_t>();
  a.fallback = fb.defined() ? fb.data_ptr<int64_t>() : nullptr;
  set_selection(a, "gate_dense", sel, o.agreement, o.set_logprob);
  a.ep_size = ep_size;
  a.spread_offset = E ? spread_offset % E : 0;
  a.underflow_guard = underflow_guard;
  a.with_plan = with_plan;
  check_launch(replay_cuda::gate_fwd(a, ws_bytes ? ws.data_ptr() : nullptr,
                                     c10::cuda::getCurrentCUDAStream(), path),
               "gate_dense");
  return o.tuple();
}

at::Tensor gate_dense_bwd(const at::Tensor& grad_probs, const at::Tensor& logits_in,
                          const at::Tensor& idx,
                          const c10::optional<at::Tensor>& grad_set_logprob,
                          int64_t score_func, bool normalize, double scaling_factor) {
  replay_native::check_gate_dense_bwd(grad_probs, logits_in, idx, logits_in.device());
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const int sf = replay_native::checked_score_func(score_func);
  check_backward_topk(idx);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor i32 = idx.contiguous();
  const at::Tensor glp =
      replay_native::checked_set_logprob_grad(grad_set_logprob, logits, logits.device());
  at::Tensor grad = at::empty_like(logits);
  // the probs gradient is read in place, any strides (an expanded gradient is not copied)
  check_launch(replay_cuda::gate_dense_bwd(grad_probs.data_ptr(), grad_probs.stride(0),
                                           grad_probs.stride(1), logits.data_ptr(),
                                           dtype_of(logits, "logits"), i32.data_ptr<int32_t>(),
                                           logits.size(0), logits.size(1), i32.size(1), sf,
                                           normalize, scaling_factor, grad.data_ptr(),
                                           c10::cuda::getCurrentCUDAStream(),
                                           glp.defined() ? glp.data_ptr() : nullptr),
               "gate_dense_backward");
  return grad;
}

at::Tensor permute_probs_fwd(const at::Tensor& probs, const at::Tensor& sorted_slots,
                             const at::Tensor& idx, int64_t num_rows) {
  replay_native::check_permute_probs_fwd(probs, sorted_slots, idx, num_rows, probs.device());
  const c10::cuda::CUDAGuard guard(probs.device());
  const at::Tensor ss = sorted_slots.contiguous();
  const at::Tensor i32 = idx.contiguous();
  at::Tensor out = at::empty({num_rows}, probs.options());
  check_launch(replay_cuda::permute_probs_fwd(probs.data_ptr(), dtype_of(probs, "probs"),
                                              probs.stride(0), probs.stride(1), probs.size(0),
                                              probs.size(1), ss.data_ptr<int32_t>(), ss.numel(),
                                              i32.data_ptr<int32_t>(), i32.size(1), num_rows,
                                              out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "permute_probs");
  return out;
}

at::Tensor permute_probs_bwd(const at::Tensor& grad_in, const at::Tensor& row_id_map,
                             const at::Tensor& idx, int64_t num_experts) {
  replay_native::check_permute_probs_bwd(grad_in, row_id_map, idx, num_experts,
                                         grad_in.device());
  const c10::cuda::CUDAGuard guard(grad_in.device());
  const at::Tensor g = grad_in.contiguous();
  const at::Tensor rid = row_id_map.contiguous();
  const at::Tensor i32 = idx.contiguous();
  at::Tensor out = at::empty({rid.size(0), num_experts}, g.options());
  check_launch(replay_cuda::permute_probs_bwd(g.data_ptr(), dtype_of(g, "grad"), g.size(0),
                                              rid.data_ptr<int32_t>(), i32.data_ptr<int32_t>(),
                                              rid.size(0), rid.size(1), num_experts,
                                              out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "permute_probs_backward");
  return out;
}

at::Tensor permute_fwd(const at::Tensor& hidden_in, const at::Tensor& sorted_slots,
                       const at::Tensor& row_id_map, int64_t num_rows) {
  replay_native::check_permute_fwd(hidden_in, sorted_slots, row_id_map, num_rows,
                                   hidden_in.device());
  const c10::cuda::CUDAGuard guard(hidden_in.device());
  const at::Tensor hidden = hidden_in.contiguous();
  const at::Tensor ss = sorted_slots.contiguous();
  at::Tensor out = at::empty({num_rows, hidden.size(1)}, hidden.options());
  check_launch(replay_cuda::permute_fwd(hidden.data_ptr(), hidden.element_size(), hidden.size(0),
                                        hidden.size(1), ss.data_ptr<int32_t>(), ss.numel(),
                                        row_id_map.size(1), num_rows, out.data_ptr(),
                                        c10::cuda::getCurrentCUDAStream()),
               "permute");
  return out;
}

at::Tensor gather(const at::Tensor& x_in, const at::Tensor& row_id_map, const at::Tensor* w,
                  const char* op) {
  replay_native::check_gather_sum(x_in, row_id_map, w, op, x_in.device());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor rid = row_id_map.contiguous();
  at::Tensor wa;
  if (w) wa = w->to(acc_dtype(x.scalar_type())).contiguous();
  at::Tensor out = at::empty({rid.size(0), x.size(1)}, x.options());
  check_launch(replay_cuda::gather_sum(x.data_ptr(), dtype_of(x, "expert_out"), x.size(0),
                                       x.size(1), rid.data_ptr<int32_t>(), rid.size(0),
                                       rid.size(1), w ? wa.data_ptr() : nullptr, out.data_ptr(),
                                       c10::cuda::getCurrentCUDAStream()),
               op);
  return out;
}

at::Tensor permute_bwd(const at::Tensor& grad_out, const at::Tensor& row_id_map) {
  return gather(grad_out, row_id_map, nullptr, "permute_backward");
}

at::Tensor unpermute_fwd(const at::Tensor& expert_out, const at::Tensor& row_id_map,
                         const at::Tensor& weights) {
  return gather(expert_out, row_id_map, &weights, "unpermute");
}

replay_native::UnpermuteBwdResult unpermute_bwd(const at::Tensor& grad_out_in,
                                                const at::Tensor& expert_out_in,
                                                const at::Tensor& row_id_map,
                                                const at::Tensor& sorted_slots,
                                                const at::Tensor& weights) {
  replay_native::check_unpermute_bwd(grad_out_in, expert_out_in, row_id_map, sorted_slots,
                                     weights, expert_out_in.device());
  const c10::cuda::CUDAGuard guard(expert_out_in.device());
  const at::Tensor x = expert_out_in.contiguous();
  const at::Tensor go = grad_out_in.to(x.scalar_type()).contiguous();
  const at::Tensor rid = row_id_map.contiguous();
  const at::Tensor ss = sorted_slots.contiguous();
  const auto adt = acc_dtype(x.scalar_type());
  const at::Tensor w = weights.to(adt).contiguous();
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor grad_w = at::empty({rid.size(0), rid.size(1)}, x.options().dtype(adt));
  check_launch(replay_cuda::unpermute_bwd(go.data_ptr(), x.data_ptr(), dtype_of(x, "expert_out"),
                                          x.size(0), x.size(1), rid.data_ptr<int32_t>(),
                                          ss.data_ptr<int32_t>(), ss.numel(), rid.size(0),
                                          rid.size(1), w.data_ptr(), grad_x.data_ptr(),
                                          grad_w.data_ptr(), c10::cuda::getCurrentCUDAStream()),
               "unpermute_backward");
  return {grad_x, grad_w.to(weights.scalar_type())};
}

}  // namespace

// Process-wide knobs for tests and benchmarks (not part of the public API).
TORCH_LIBRARY_FRAGMENT(replay_native, m) {
  m.def("cuda_gate_path(str name) -> str", &cuda_gate_path);
  m.def("cuda_gate_max_ctas(int n) -> int", &cuda_gate_max_ctas);
  m.def("cuda_kernel_image(int device) -> str", &cuda_kernel_image);
}

TORCH_LIBRARY_IMPL(replay_native, CUDA, m) { REPLAY_NATIVE_OPS(REPLAY_NATIVE_IMPL_ONE) }
