"""The `native` backend: the C++ CPU kernels and, when compiled in, the CUDA kernels of
`replay_ops._C` (sources in csrc/, see docs/native.md).

The extension registers its kernels as internal ops in the namespace `replay_native`
(`torch.ops.replay_native.gate_fwd`, ...), apart from the public `torch.ops.replay`. This
module adapts them to the backend contract. Importing it raises ImportError when the
extension was not built (ModuleNotFoundError: the registry moves on quietly), or was built
for another torch or lacks a shared library (replay_ops._extension.NativeLoadError, whose
message names both torch versions or the library: the registry warns once with it).

Limits of the CUDA gate kernels (shared-memory histograms; one lane per slot in the
backward; the selection's per-thread ranked lists) are read from the extension:
`_C.MAX_EXPERTS` and `_C.MAX_TOPK`.
"""
from __future__ import annotations

import torch

from .._extension import load as _load_extension

_C = _load_extension()  # registers torch.ops.replay_native.*
from .. import scores
from ..plan import PADDING_MODES
from .protocol import FUSED_OPS, YES, Support

NAME = "native"
WITH_CUDA = bool(_C.WITH_CUDA)
MAX_EXPERTS = int(_C.MAX_EXPERTS)
MAX_TOPK = int(_C.MAX_TOPK)
_ops = torch.ops.replay_native


def cpu_isa() -> str:
    """The x86 vector ISA of the CPU row kernels ("baseline", "avx2" or "avx512"): the best
    the CPU supports, or the cap set by REPLAY_OPS_CPU_ISA. Every ISA gives the same bits."""
    return _ops.cpu_isa("")


def available(device_type: str) -> Support:
    if device_type == "cpu":
        return YES
    if device_type == "cuda":
        if not WITH_CUDA:
            return Support(False, "replay_ops._C was built without the CUDA kernels")
        if not torch.cuda.is_available():
            return Support(False, "no CUDA device is present")
        problems = cuda_image_problems()
        if problems:
            return Support(False, "; ".join(problems), loud=True)
        return YES
    return Support(False, f"no native kernels for {device_type} tensors")


_image_problems: list[str] | None = None


def probe_kernel_image(device: int) -> str:
    """"" when the extension has a kernel image device `device` can run, else the CUDA
    error a launch would give (no launch happens)."""
    return _ops.cuda_kernel_image(device)


def cuda_image_problems() -> list[str]:
    """Every visible CUDA device the build cannot run on, with the reason (probed once per
    process: e.g. sm_75 and Blackwell GPUs with an arch list that has no PTX)."""
    global _image_problems
    if _image_problems is None:
        problems = []
        for d in range(torch.cuda.device_count()):
            err = probe_kernel_image(d)
            if err:
                major, minor = torch.cuda.get_device_capability(d)
                problems.append(
                    f"replay_ops._C has no kernel image for cuda:{d} "
                    f"({torch.cuda.get_device_name(d)}, sm_{major}{minor}): {err}; rebuild "
                    f"with TORCH_CUDA_ARCH_LIST naming {major}.{minor} or ending in +PTX")
        _image_problems = problems
    return _image_problems


def supports(op, device_type, shape, dtype) -> Support:
    takes_features = {"cpu": CPU_FEATURES, "cuda": CUDA_FEATURES}.get(device_type, False)
    if shape.features and not takes_features:
        return Support(False, f"the native {device_type.upper()} gate kernels do not implement "
                              f"{' and '.join(sorted(shape.features))} (the model's own "
                              f"selection of flagged rows, the agreement outputs: "
                              f"replay_ops/backends/protocol.py)")
    if op in FUSED_OPS and not FUSED_CPU:
        return Support(False, "this build of the native library has no fused gate + permute "
                              "kernels (rebuild it)")
    if device_type != "cuda":
        return YES
    if op in FUSED_OPS:
        return Support(False, "the native CUDA kernels have no fused gate + permute yet (the "
                              "op runs the gate and the permute kernels in turn)")
    if shape.features and shape.K > MAX_TOPK:
        return Support(False, f"K={shape.K} slots is above the CUDA gate selection's limit "
                              f"kMaxSelectList={MAX_TOPK} (its per-thread ranked lists)")
    if shape.features and shape.select_list > MAX_TOPK:
        return Support(False, f"the selection's group lists (group_topk or the group score's "
                              f"n, the largest {shape.select_list}) are above the CUDA gate "
                              f"selection's limit kMaxSelectList={MAX_TOPK} (its per-thread "
                              f"ranked lists)")
    if op in ("gate_fwd", "gate_bwd", "gate_dense_fwd", "gate_dense_bwd") and \
            shape.E > MAX_EXPERTS:
        return Support(False, f"E={shape.E} experts is above the CUDA gate kernels' limit "
                              f"kMaxExperts={MAX_EXPERTS}")
    if op in ("gate_bwd", "gate_dense_bwd") and shape.K > MAX_TOPK:
        return Support(False, f"K={shape.K} slots is above the CUDA gate backward's limit "
                              f"kMaxTopK={MAX_TOPK}")
    return YES


def describe() -> dict:
    info: dict = {"limits": {"cuda_max_experts": MAX_EXPERTS, "cuda_max_top_k": MAX_TOPK}}
    try:
        info["cpu_isa"] = cpu_isa()
    except ValueError as e:  # a bad REPLAY_OPS_CPU_ISA: report it, the ops raise it
        info["cpu_isa"] = f"error: {e}"
    return info


# Whether the CPU and the CUDA kernels take the gate features (OpShape.features): the
# model's own selection of flagged rows and the agreement outputs (csrc/include/
# replay_select.h). On CUDA, K, group_topk and group_topn are at most MAX_TOPK
# (kMaxSelectList): supports() hands a call with larger ones on (OpShape.select_list); the
# op, called with this backend by name, refuses them with the values named.
CPU_FEATURES = True
CUDA_FEATURES = True
# Whether the library has the CPU fused gate + permute ops (protocol.FUSED_OPS).
FUSED_CPU = hasattr(_ops, "gate_permute_fwd")
# replay_ops.Selection.source, numbered as the native ops take it (replay_select.h).
SELECTION_SOURCES = {"scores": 0, "logits": 1}


def _selection_args(opts, top_k: int) -> tuple:
    """The native ops' selection arguments: source id, round_scores, num_groups, group_topk,
    the resolved group_topn."""
    sel = opts.selection
    return (SELECTION_SOURCES[sel.source], bool(sel.round_scores), int(sel.num_groups),
            int(sel.group_topk), int(sel.group_topn(top_k)) if sel.grouped else 0)


def gate_fwd(logits, expert_indices, replay_mask, opts):
    return tuple(_ops.gate_fwd(
        logits, expert_indices, replay_mask, opts.selection.expert_bias,
        scores.get(opts.score_func).id, bool(opts.normalize), float(opts.scaling_factor),
        int(opts.align), PADDING_MODES[opts.padding],
        *_selection_args(opts, expert_indices.shape[1]), bool(opts.return_agreement),
        _weights_acc(logits, opts)))


def _weights_acc(logits, opts) -> bool:
    """The native ops' weights_acc: the weights in the compute type (opts.weights_dtype,
    checked by the op to be the logits' dtype or their compute dtype)."""
    return opts.weights_dtype is not None and opts.weights_dtype != logits.dtype


def gate_bwd(grad_weights, logits, idx, opts, grad_set_logprob=None):
    return _ops.gate_bwd(grad_weights, logits, idx, grad_set_logprob,
                         scores.get(opts.score_func).id, bool(opts.normalize),
                         float(opts.scaling_factor))


def gate_permute_fwd(logits, expert_indices, replay_mask, opts, hidden, num_rows):
    return tuple(_ops.gate_permute_fwd(
        logits, expert_indices, replay_mask, opts.selection.expert_bias,
        scores.get(opts.score_func).id, bool(opts.normalize), float(opts.scaling_factor),
        int(opts.align), PADDING_MODES[opts.padding],
        *_selection_args(opts, expert_indices.shape[1]), bool(opts.return_agreement),
        _weights_acc(logits, opts), hidden, int(num_rows)))


def gate_permute_bwd(grad_weights, grad_rows, logits, idx, row_id_map, opts,
                     grad_set_logprob=None):
    return tuple(_ops.gate_permute_bwd(grad_weights, grad_rows, logits, idx, row_id_map,
                                       grad_set_logprob, scores.get(opts.score_func).id,
                                       bool(opts.normalize), float(opts.scaling_factor)))


def permute_fwd(hidden, sorted_slots, row_id_map, num_rows):
    return _ops.permute_fwd(hidden, sorted_slots, row_id_map, int(num_rows))


def permute_bwd(grad_out, row_id_map):
    return _ops.permute_bwd(grad_out, row_id_map)


def unpermute_fwd(expert_out, row_id_map, weights):
    return _ops.unpermute_fwd(expert_out, row_id_map, weights)


def unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights):
    return tuple(_ops.unpermute_bwd(grad_out, expert_out, row_id_map, sorted_slots, weights))



def gate_dense_fwd(logits, expert_indices, replay_mask, fallback, opts):
    return tuple(_ops.gate_dense_fwd(
        logits, expert_indices, replay_mask, fallback, opts.selection.expert_bias,
        scores.get(opts.score_func).id, bool(opts.normalize), float(opts.scaling_factor),
        PADDING_MODES[opts.padding], int(opts.ep_size), int(opts.spread_offset),
        bool(opts.underflow_guard), int(opts.align), bool(opts.with_plan),
        *_selection_args(opts, expert_indices.shape[1]), bool(opts.return_agreement)))


def gate_dense_bwd(grad_probs, logits, idx, opts, grad_set_logprob=None):
    return _ops.gate_dense_bwd(grad_probs, logits, idx, grad_set_logprob,
                               scores.get(opts.score_func).id, bool(opts.normalize),
                               float(opts.scaling_factor))


def permute_probs_fwd(probs, sorted_slots, expert_indices, num_rows):
    return _ops.permute_probs_fwd(probs, sorted_slots, expert_indices, int(num_rows))


def permute_probs_bwd(grad, row_id_map, expert_indices, num_experts):
    return _ops.permute_probs_bwd(grad, row_id_map, expert_indices, int(num_experts))
