"""The registry guard on a GPU (CUDA only: it skips without a GPU, saying why).

The parity tests generate their CUDA cases from the registry (`_helpers.backend_params`,
`case_params`: one set per backend usable for CUDA tensors), so a backend that is not usable
on the GPU machine (Triton failing to load, the native extension built without its CUDA
kernels) would silently lose all its cases, about 290 for Triton, and the GPU run would
pass without them. Here every backend the registry names for CUDA must be usable there and
have generated cases. `make gpu-check` also counts the CUDA cases each backend actually ran
(tools/gpu_test_plan.py) and fails the run on a backend with none."""
from __future__ import annotations

import pytest

from replay_ops import backends as rb

from _helpers import backend_params, case_params


def generated_backends(params: list, device: str) -> set[str]:
    """The backends that pytest params of `backend_params()` ((device, backend)) or of
    `case_params()` (device, backend, case) hold for `device`."""
    out = set()
    for p in params:
        values = p.values[0] if len(p.values) == 1 else p.values
        if values[0] == device:
            out.add(values[1])
    return out


@pytest.mark.gpu
def test_every_cuda_backend_of_the_registry_has_cases():
    named = rb.AUTO_ORDER["cuda"]
    why = {b: rb.available(b, "cuda").reason for b in named if not rb.available(b, "cuda")}
    assert not why, (f"backends the registry names for CUDA tensors are not usable on this "
                     f"GPU machine, so their CUDA cases are not generated: {why}")
    for params in (backend_params(), case_params([0])):
        missing = [b for b in named if b not in generated_backends(params, "cuda")]
        assert not missing, f"no CUDA case generated for {missing}"
