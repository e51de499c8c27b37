"""An environment for running Megatron-Core's MoE layer on a CPU with gloo, for the tests
and `bench/bench_megatron.py` (not needed to use the ops; nothing here is installed unless
`install_cpu_shims()` is called).

Megatron-Core itself is real and unmodified. A CPU-only machine lacks a few CUDA entry
points that Megatron calls unconditionally; `install_cpu_shims()` supplies them for the
calling process only:

* `torch.cuda.current_device()` (router weights, expert-bias buffers, collective buffers):
  returns the CPU device.
* `torch.cuda.Stream`, `torch.cuda.stream`, `torch.cuda.current_stream` (the all-to-all
  dispatcher's device-to-host side stream): inert stand-ins; everything is already on
  the host.
* `moe_utils.te_general_gemm`: referenced without TransformerEngine; set to None so the
  router's gating uses its plain torch path.
* the all-to-all dispatcher's device-to-host copy of its split sizes
  (`maybe_move_tensor_to_cpu(as_numpy=True)`) leaves CPU tensors as tensors, which
  `all_to_all_single` refuses: they become numpy arrays, as they do from a GPU.
* gloo's `all_gather_into_tensor`/`all_gather` refuse uneven sizes (Megatron's
  `gather_from_sequence_parallel_region(output_split_sizes=...)` with expert TP > 1):
  padded to the largest piece, then sliced.
* The CUDA RNG tracker's `fork()` (dropout regions of full transformer layers): a no-op
  context.

`spawn(fn, world_size, timeout)` runs `fn(rank, world_size, port, *args)` in new
processes (forked from a server that imported torch and Megatron once) over gloo on 127.0.0.1 and fails the calling test if any rank raises or the
whole group does not finish within `timeout` seconds (the processes are then killed).
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import traceback
import warnings

import torch

_INSTALLED = False


class _Event:
    def synchronize(self):
        return None

    def wait(self, *a, **k):
        return None

    def record(self, *a, **k):
        return None


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        return None

    def record_event(self, event=None):
        return _Event()

    def synchronize(self):
        return None

    def __eq__(self, other):
        return isinstance(other, _Stream)

    def __hash__(self):
        return 0


_CURRENT = _Stream()


_TORCH_CUDA_SHIMS = {
    "current_device": lambda: torch.device("cpu"),
    "Stream": _Stream,
    "current_stream": lambda *a, **k: _CURRENT,
    "stream": lambda s=None: contextlib.nullcontext(),
    "Event": lambda *a, **k: _Event(),
}
_TORCH_CUDA_ORIG = {k: getattr(torch.cuda, k) for k in _TORCH_CUDA_SHIMS}


def set_torch_cuda_shims(on: bool) -> None:
    """Turn the torch.cuda stand-ins on or off (the test modules turn them off again when
    they finish, so the rest of the suite sees torch.cuda as it is)."""
    if torch.cuda.is_available():
        return
    for k, v in (_TORCH_CUDA_SHIMS if on else _TORCH_CUDA_ORIG).items():
        setattr(torch.cuda, k, v)


def install_cpu_shims() -> None:
    """Install the CPU stand-ins described in the module docstring (idempotent)."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        _INSTALLED = True
        return
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    set_torch_cuda_shims(True)

    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None

    _patch_uneven_all_gather()

    # The all-to-all dispatcher copies its split sizes to the host as numpy arrays when they
    # are on the GPU; on the CPU they would stay tensors, which all_to_all_single refuses.
    from megatron.core.transformer.moe import token_dispatcher

    orig_move = token_dispatcher.maybe_move_tensor_to_cpu

    def move(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return orig_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = move

    from megatron.core.tensor_parallel import random as mp_random

    tracker_cls = type(mp_random.get_cuda_rng_tracker())

    @contextlib.contextmanager
    def _fork(self, name=None):
        yield

    tracker_cls.fork = _fork
    _INSTALLED = True


def _patch_uneven_all_gather() -> None:
    """gloo's all_gather_into_tensor needs equal pieces; Megatron's uneven gather (expert
    TP > 1) is done here as pad-to-max all_gather, then slice."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    orig = mappings._gather_along_first_dim

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or dist.get_backend(group) != "gloo":
            return orig(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        world = dist.get_world_size(group)
        if world == 1:
            return input_
        m = max(sizes)
        pad = input_.new_zeros((m, *input_.shape[1:]))
        pad[: input_.shape[0]] = input_
        parts = [torch.empty_like(pad) for _ in range(world)]
        dist.all_gather(parts, pad.contiguous(), group=group)
        return torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)

    mappings._gather_along_first_dim = gather


# ---------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
    )


def init_single() -> None:
    """World size 1 over gloo (Megatron's parallel state needs a default group)."""
    if not torch.distributed.is_initialized():
        init_gloo(0, 1, free_port())


def _entry(fn, rank, world_size, port, args, queue):
    try:
        torch.set_num_threads(1)
        install_cpu_shims()
        init_gloo(rank, world_size, port)
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:
            pass


# What every rank imports before it runs anything: imported once, in multiprocessing's fork
# server (one per calling process, started on the first `spawn`), and each rank is forked
# from it. A rank is still a new process that never ran a test, with Megatron untouched
# (the clients that patch Megatron, verl and the others, are imported by the ranks
# themselves); it just does not pay these imports again (about 8 s of CPU per rank on the
# 2-core machine, with megatron.core the largest). The server runs nothing but imports: no
# threads are started and no CUDA is touched before a rank is forked.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "numpy", "megatron.core",
                      "megatron.core.parallel_state", "megatron.core.models.gpt",
                      "megatron.core.transformer.moe.moe_layer", "replay_ops",
                      "replay_ops.testing.megatron_cpu"]


def spawn(fn, world_size: int, *args, timeout: float = 120.0) -> dict:
    """Run `fn(rank, world_size, *args)` on `world_size` new processes (gloo over
    127.0.0.1), forked from a server that imported FORKSERVER_PRELOAD (their environment is
    the calling process's when its first `spawn` started that server). Returns {rank:
    result}. Raises AssertionError with every failing rank's traceback, or when the group
    has not finished after `timeout` seconds (all processes are killed first)."""
    import multiprocessing as mp
    import queue as _queue
    import time

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"spawn({getattr(fn, '__name__', fn)}): ranks {sorted(set(range(world_size)) - set(results) - set(errors))} "
                    f"did not finish within {timeout:.0f} s (finished: {sorted(results)}, "
                    f"failed: {sorted(errors)})"
                    + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
            try:
                rank, status, payload = q.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [i for i, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and i not in results and i not in errors]
                if dead:
                    raise AssertionError(
                        f"spawn({getattr(fn, '__name__', fn)}): ranks {dead} exited with codes "
                        f"{[procs[i].exitcode for i in dead]} without a result")
                continue
            (results if status == "ok" else errors)[rank] = payload
            if errors:
                # a failed rank usually leaves its peers blocked in a collective
                break
    finally:
        for p in procs:
            p.join(timeout=0.5 if errors else 5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors:
        raise AssertionError(
            f"spawn({getattr(fn, '__name__', fn)}): {len(errors)} rank(s) failed"
            + "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return results


def python_info() -> str:
    return f"python {sys.version.split()[0]}, torch {torch.__version__}"


# ---------------------------------------------------------------------------- models
E_DEFAULT = 8


def destroy_subgroups() -> None:
    """Destroy every process group but the default one. Megatron's `destroy_model_parallel`
    only forgets its groups: each gloo group keeps its threads (about 50 per
    `initialize_model_parallel`), and the groups of earlier tests pile up in one process."""
    import torch.distributed.distributed_c10d as c10d

    if not torch.distributed.is_initialized():
        return
    world = c10d._get_default_group()
    for pg in list(c10d._world.pg_map):
        if pg is not world:
            torch.distributed.destroy_process_group(pg)


def mp_init(tp: int = 1, ep: int = 1, pp: int = 1, cp: int = 1, etp: int | None = None,
            vpp: int | None = None) -> None:
    """(Re)initialise Megatron's parallel state on the current gloo world, and empty
    Megatron's global RouterReplay list (each test builds its own models)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    destroy_subgroups()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    RouterReplay.clear_global_router_replay_instances()


def moe_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=16, num_attention_heads=4, num_moe_experts=E_DEFAULT,
                moe_router_topk=2, moe_ffn_hidden_size=24, ffn_hidden_size=24,
                moe_token_dispatcher_type="alltoall", moe_enable_routing_replay=True,
                use_cpu_initialization=True, add_bias_linear=False, params_dtype=torch.float32,
                moe_router_dtype="fp32", hidden_dropout=0.0, attention_dropout=0.0,
                moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none")
    base.update(kw)
    return TransformerConfig(**base)


def build_moe_layer(config, *, replay: bool, options=None, seed: int = 1234, layer_number=1):
    """Megatron's MoELayer from its local (non-TransformerEngine) spec; with `replay` the
    router slot holds the replay router."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.spec_utils import build_module
    from replay_ops.integrations import megatron as rom

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    if replay:
        spec = rom.replay_spec(spec, options)
    torch.manual_seed(seed)
    # megatron-core >= 0.17 returns the MoE spec as functools.partial(MoELayer, ...)
    layer = spec(config=config) if callable(spec) and not isinstance(spec, type) \
        and not hasattr(spec, "module") else build_module(spec, config=config)
    layer.set_layer_number(layer_number)
    return layer


def build_pair(config, options=None, seed: int = 1234):
    """(Megatron's layer, the same layer with the replay router), same weights."""
    ref = build_moe_layer(config, replay=False, seed=seed)
    ours = build_moe_layer(config, replay=True, options=options, seed=seed)
    ours.load_state_dict(ref.state_dict())
    if ref.router.expert_bias is not None:
        ours.router.expert_bias.copy_(ref.router.expert_bias)
    return ref, ours


def run_layer(layer, x, target=None, action="REPLAY_FORWARD", grad_out=None):
    """Forward + backward of an MoE layer under a replay action. Returns a dict with the
    output, the input gradient, parameter gradients and the dispatcher's metadata."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    layer.zero_grad(set_to_none=True)
    rr = layer.router.router_replay
    if rr is not None:
        rr.clear_indices()
        if target is not None:
            rr.set_target_indices(target)
        if action is None:
            rr.clear_router_replay_action()
        else:
            rr.set_router_replay_action(getattr(RouterReplayAction, action))
    xi = x.detach().clone().requires_grad_(True)
    out, _ = layer(xi)
    if grad_out is None:
        grad_out = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    out.backward(grad_out)
    d = layer.token_dispatcher
    meta = {}
    for k in ("routing_map", "reversed_local_input_permutation_mapping", "input_splits",
              "output_splits", "output_splits_tp", "num_out_tokens", "local_map"):
        v = getattr(d, k, None)
        if v is not None:
            meta[k] = torch.as_tensor(v).clone()
    return {
        "out": out.detach().clone(),
        "dx": xi.grad.clone(),
        "grads": {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None},
        "meta": meta,
        "recorded": None if rr is None or rr.recorded_topk_idx is None else rr.recorded_topk_idx.clone(),
    }


def assert_runs_match(a, b, *, rtol=1e-5, atol=1e-6, exact_meta=True, what=""):
    """fp32 outputs and gradients close; integer dispatch metadata exactly equal."""
    torch.testing.assert_close(a["out"], b["out"], rtol=rtol, atol=atol, msg=lambda m: f"{what} out: {m}")
    torch.testing.assert_close(a["dx"], b["dx"], rtol=rtol, atol=atol, msg=lambda m: f"{what} dx: {m}")
    assert set(a["grads"]) == set(b["grads"]), f"{what}: gradients of {set(a['grads']) ^ set(b['grads'])}"
    for n in a["grads"]:
        torch.testing.assert_close(a["grads"][n], b["grads"][n], rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{what} grad {n}: {m}")
    if exact_meta:
        for k in set(a["meta"]) & set(b["meta"]):
            assert torch.equal(a["meta"][k], b["meta"][k]), f"{what}: dispatcher {k} differs"


def random_routes(T, E, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
