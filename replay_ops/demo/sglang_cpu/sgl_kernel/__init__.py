"""A stand-in for SGLang's kernel package, for SGLang's CPU engine on a machine without one.

This folder is put on PYTHONPATH only for the SGLang processes that
`replay_ops.demo.sglang_engine` launches on a CPU; replay_ops never imports it. Every
`sgl_kernel` wheel on the package index is a CUDA build, whose import fails without a CUDA
driver (`libcuda.so.1: cannot open shared object file`), and SGLang's CPU engine imports
its CPU ops from `sgl_kernel` at module load.

It holds the one op the CPU engine calls here (without Intel AMX),
`assign_req_to_token_pool_cpu` (sglang/srt/mem_cache/allocation.py), in plain torch. A few
CPU ops that SGLang 0.5.23 imports at module load without a fallback but that these runs
never call (`UNCALLED`: KV-cache moves and speculative decoding) are names that raise
NotImplementedError when called, never a silent wrong answer. Every other name is missing,
so `from sgl_kernel import X` raises ImportError and SGLang's own fallbacks run.
"""
import torch

__version__ = "0.0.0+replay_ops_cpu_stand_in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i: `req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]
    = the next end_offset[i] - start_offset[i] entries of out_cache_loc` (the requests'
    slots, one after the other), as SGLang's Triton kernel `assign_req_to_token_pool`."""
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for r, s, e in zip(rows, starts, ends):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += max(n, 0)


def _uncalled(name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name}: not in the CPU stand-in of replay_ops/demo/sglang_cpu (SGLang "
            f"imports it at load; the demo's and tests' requests never call it)")

    op.__name__ = name
    return op


# imported at module load by SGLang 0.5.23 on a CPU (sglang/kernels/ops/...), never called
UNCALLED = (
    "copy_all_layer_kv_cache_cpu",  # kvcache/cache_move.py: KV moves between slots
    # speculative/*.py: speculative decoding (EAGLE), not enabled here
    "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
    "assign_draft_cache_locs_contiguous_cpu", "assign_extend_cache_locs_cpu",
)
for _name in UNCALLED:
    globals()[_name] = _uncalled(_name)
del _name
