// Schemas of the internal replay_native::* ops and their CPU implementations.
//
// The public ops (replay::gate, permute, unpermute and their backward ops) are defined by
// replay_ops/ops.py; the native backend (replay_ops/backends/native.py) calls these internal
// ops, which live in their own namespace so that torch.ops.replay holds the public ops
// alone. Score functions are passed by their id in the table of replay_ops/scores.py. The
// CUDA implementations register in register_cuda.cpp when built.
#include <Python.h>
#include <torch/library.h>

#include "../cpu/ops_cpu.h"
#include "../cpu/row_kernels.h"
#include "replay_limits.h"

TORCH_LIBRARY(replay_native, m) {
  m.def("gate_fwd(Tensor logits, Tensor expert_indices, int score_func, bool normalize, "
        "float scaling_factor, int align) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("gate_bwd(Tensor grad_weights, Tensor logits, Tensor expert_indices, "
        "int score_func, bool normalize, float scaling_factor) -> Tensor");
  m.def("permute_fwd(Tensor hidden, Tensor sorted_slots, Tensor row_id_map, "
        "int num_rows) -> Tensor");
  m.def("permute_bwd(Tensor grad_out, Tensor row_id_map) -> Tensor");
  m.def("unpermute_fwd(Tensor expert_out, Tensor row_id_map, Tensor weights) -> Tensor");
  m.def("unpermute_bwd(Tensor grad_out, Tensor expert_out, Tensor row_id_map, "
        "Tensor sorted_slots, Tensor weights) -> (Tensor, Tensor)");
  m.def("gate_dense_fwd(Tensor logits, Tensor expert_indices, Tensor? replay_mask, "
        "Tensor? fallback, int score_func, bool normalize, float scaling_factor, int padding, "
        "int ep_size, int spread_offset, bool underflow_guard, int align, bool with_plan) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("gate_dense_bwd(Tensor grad_probs, Tensor logits, Tensor expert_indices, "
        "int score_func, bool normalize, float scaling_factor) -> Tensor");
  m.def("permute_probs_fwd(Tensor probs, Tensor sorted_slots, Tensor expert_indices, "
        "int num_rows) -> Tensor");
  m.def("permute_probs_bwd(Tensor grad, Tensor row_id_map, Tensor expert_indices, "
        "int num_experts) -> Tensor");
  // A process-wide knob for tests and benchmarks: the x86 vector ISA of the CPU row kernels
  // ("" queries, a name sets; see row_kernels.h).
  m.def("cpu_isa(str name) -> str", &replay_cpu::cpu_isa);
}

TORCH_LIBRARY_IMPL(replay_native, CPU, m) {
  m.impl("gate_fwd", &replay_cpu::gate_fwd);
  m.impl("gate_bwd", &replay_cpu::gate_bwd);
  m.impl("permute_fwd", &replay_cpu::permute_fwd);
  m.impl("permute_bwd", &replay_cpu::permute_bwd);
  m.impl("unpermute_fwd", &replay_cpu::unpermute_fwd);
  m.impl("unpermute_bwd", &replay_cpu::unpermute_bwd);
  m.impl("gate_dense_fwd", &replay_cpu::gate_dense_fwd);
  m.impl("gate_dense_bwd", &replay_cpu::gate_dense_bwd);
  m.impl("permute_probs_fwd", &replay_cpu::permute_probs_fwd);
  m.impl("permute_probs_bwd", &replay_cpu::permute_probs_bwd);
}

// `import replay_ops._C` loads this library (and so runs the registrations above).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "replay_ops native kernels (torch.ops.replay_native.*)",
      -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* mod = PyModule_Create(&module_def);
  if (mod == nullptr) return nullptr;
#ifdef REPLAY_OPS_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  // WITH_CUDA: whether the CUDA kernels were compiled into this library. MAX_EXPERTS and
  // MAX_TOPK: the limits of the CUDA gate kernels (replay_limits.h).
  if (PyModule_AddIntConstant(mod, "WITH_CUDA", with_cuda) != 0 ||
      PyModule_AddIntConstant(mod, "MAX_EXPERTS", static_cast<long>(replay_cuda::kMaxExperts)) !=
          0 ||
      PyModule_AddIntConstant(mod, "MAX_TOPK", static_cast<long>(replay_cuda::kMaxTopK)) != 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
