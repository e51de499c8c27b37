// Schemas of the internal replay::native_* ops and their CPU implementations.
//
// The public ops (replay::gate, permute, unpermute and their backward ops) are defined by
// replay_ops/ops.py; the native backend (replay_ops/_native_backend.py) calls these
// internal ops. The CUDA implementations register in register_cuda.cpp when built.
#include <Python.h>
#include <torch/library.h>

#include "../cpu/ops_cpu.h"
#include "../cpu/row_kernels.h"

TORCH_LIBRARY_FRAGMENT(replay, m) {
  m.def("native_gate_fwd(Tensor logits, Tensor expert_indices, str score_func, bool normalize, "
        "float scaling_factor, int align) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("native_gate_bwd(Tensor grad_weights, Tensor logits, Tensor expert_indices, "
        "str score_func, bool normalize, float scaling_factor) -> Tensor");
  m.def("native_permute_fwd(Tensor hidden, Tensor sorted_slots, Tensor row_id_map, "
        "int num_rows) -> Tensor");
  m.def("native_permute_bwd(Tensor grad_out, Tensor row_id_map) -> Tensor");
  m.def("native_unpermute_fwd(Tensor expert_out, Tensor row_id_map, Tensor weights) -> Tensor");
  m.def("native_unpermute_bwd(Tensor grad_out, Tensor expert_out, Tensor row_id_map, "
        "Tensor sorted_slots, Tensor weights) -> (Tensor, Tensor)");
  // The x86 vector ISA of the CPU row kernels: "" queries, a name sets (see row_kernels.h).
  m.def("native_cpu_isa(str name) -> str", &replay_cpu::native_cpu_isa);
}

TORCH_LIBRARY_IMPL(replay, CPU, m) {
  m.impl("native_gate_fwd", &replay_cpu::gate_fwd);
  m.impl("native_gate_bwd", &replay_cpu::gate_bwd);
  m.impl("native_permute_fwd", &replay_cpu::permute_fwd);
  m.impl("native_permute_bwd", &replay_cpu::permute_bwd);
  m.impl("native_unpermute_fwd", &replay_cpu::unpermute_fwd);
  m.impl("native_unpermute_bwd", &replay_cpu::unpermute_bwd);
}

// `import replay_ops._C` loads this library (and so runs the registrations above).
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "replay_ops native kernels (torch.ops.replay.native_*)",
      -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* mod = PyModule_Create(&module_def);
  if (mod == nullptr) return nullptr;
#ifdef REPLAY_OPS_WITH_CUDA
  const long with_cuda = 1;
#else
  const long with_cuda = 0;
#endif
  // WITH_CUDA: whether the CUDA kernels were compiled into this library.
  if (PyModule_AddIntConstant(mod, "WITH_CUDA", with_cuda) != 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
