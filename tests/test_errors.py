"""One class catches every routing error: `replay_ops.RoutingError`."""
from __future__ import annotations

import pytest
import torch

import replay_ops
from replay_ops.integrations.megatron.data import LayoutError
from replay_ops.router_replay import (ModelShape, RouterReplayError, RoutingFileError,
                                      RoutingMismatchError, RoutingShapeError, adapters, codec,
                                      open_routing)
from replay_ops.router_replay.codec import CodecError

ROUTING_ERRORS = {CodecError: ValueError, RoutingFileError: ValueError,
                  RoutingShapeError: ValueError, RoutingMismatchError: ValueError,
                  RouterReplayError: RuntimeError, LayoutError: ValueError}


@pytest.mark.parametrize("cls", list(ROUTING_ERRORS), ids=lambda c: c.__name__)
def test_each_routing_error_is_a_routing_error_and_keeps_its_builtin_base(cls):
    assert issubclass(cls, replay_ops.RoutingError)
    assert issubclass(cls, ROUTING_ERRORS[cls])


def test_megatron_replay_routing_error_is_a_routing_error():
    from replay_ops.integrations.megatron.router import ReplayRoutingError

    assert issubclass(ReplayRoutingError, replay_ops.RoutingError)
    assert issubclass(ReplayRoutingError, RuntimeError)


def test_one_except_clause_catches_bad_routing_from_every_layer(tmp_path):
    shape = ModelShape(8, 2, (0, 1), 2)
    bad = tmp_path / "bad.rr"
    bad.write_bytes(b"not a record file")
    raised = []
    for who, call in [
        ("codec", lambda: codec.decode(b"\x00" * 16)),
        ("file", lambda: open_routing(bad)),
        ("adapter", lambda: adapters.vllm_batch([torch.zeros(3, 2, 2, dtype=torch.int32)],
                                                [2], [4], shape, packing="thd")),
    ]:
        try:
            call()
        except replay_ops.RoutingError as e:
            raised.append((who, type(e).__name__))
    assert [w for w, _ in raised] == ["codec", "file", "adapter"], raised
