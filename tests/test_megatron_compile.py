"""Megatron-Core's MoE router with the replay gate under torch.compile(fullgraph=True): the
replay router's forward in REPLAY_FORWARD traces with no graph break, and its outputs and
gradients equal the eager router's (CPU, one process; Megatron-Core is real)."""
from __future__ import annotations

import pytest
import torch

from _helpers import require_client  # noqa: E402

require_client("megatron.core", "megatron-core")

from replay_ops.testing import megatron_cpu as env  # noqa: E402

env.install_cpu_shims()
env.set_torch_cuda_shims(False)

from megatron.core.transformer.moe.router_replay import RouterReplayAction  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from _megatron_env import cuda_stand_ins, single_world  # noqa: E402,F401  (fixtures)

pytestmark = pytest.mark.usefixtures("single_world")

E, K = env.E_DEFAULT, 2
S, B, H = 6, 2, 16
T = S * B


@pytest.fixture(autouse=True)
def _dynamo_folds_the_device_stand_in():
    """Megatron's `gating` moves a CPU router weight to `torch.cuda.current_device()`, which
    on this CPU machine is the stand-in of replay_ops.testing.megatron_cpu. Dynamo
    constant-folds the real `torch.cuda.current_device` (with a guard); it is told to treat
    the stand-in the same way (on a GPU the weight is on the device and that branch is not
    taken)."""
    from torch._dynamo.variables import torch as dyn_torch

    fn = torch.cuda.current_device
    added = [d for d in (dyn_torch.constant_fold_functions,
                         dyn_torch.constant_fold_functions_need_guards) if fn not in d]
    for d in added:
        d[fn] = None
    yield
    for d in added:
        d.pop(fn, None)


def _hidden(seed):
    return torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("padding", ["topk", "spread"])
def test_replay_router_forward_compiles_without_breaks(padding):
    from replay_ops.integrations import megatron as rom

    cfg = env.moe_config()
    layer = env.build_moe_layer(cfg, replay=True, options=rom.ReplayOptions(padding=padding, validate=False))
    router = layer.router
    rr = router.router_replay
    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(router.forward, fullgraph=True, backend=cnt)
    results = {}
    for kind, fn in (("eager", router.forward), ("compiled", compiled)):
        out = []
        for step in range(2):
            rr.clear_indices()
            rr.set_target_indices(env.random_routes(T, E, K, seed=10 + step))
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.zero_grad(set_to_none=True)
            x = _hidden(step).requires_grad_(True)
            probs, rmap = fn(x)
            (probs * torch.linspace(0.5, 1.5, E)).sum().backward()
            out.append((probs.detach(), rmap, x.grad, router.weight.grad))
        results[kind] = out
    assert cnt.frame_count == 1, f"{cnt.frame_count} compiles for 2 steps (a recompile)"
    assert dict(counters["graph_break"]) == {}
    for a, b in zip(results["eager"], results["compiled"]):
        for u, v in zip(a, b):
            assert torch.equal(u, v)
