"""The Megatron tests' fixtures over `replay_ops.testing.megatron_cpu` (the CPU stand-ins,
the gloo world and the layer builders, which `bench/bench_megatron.py` uses too)."""
from __future__ import annotations

import pytest

from replay_ops.testing.megatron_cpu import init_single, mp_init, set_torch_cuda_shims


@pytest.fixture(scope="module")
def cuda_stand_ins():
    """The torch.cuda stand-ins, on while one test module runs."""
    set_torch_cuda_shims(True)
    yield
    set_torch_cuda_shims(False)


@pytest.fixture
def single_world(cuda_stand_ins):
    """A one-process gloo world with Megatron's parallel state, and an empty global
    RouterReplay list after each test. A module uses both fixtures with
    `pytestmark = pytest.mark.usefixtures("single_world")`."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    init_single()
    mp_init()
    yield
    RouterReplay.clear_global_router_replay_instances()
