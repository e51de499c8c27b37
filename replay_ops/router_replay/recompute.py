"""The recompute queue: per MoE layer, the indices each replayed forward used, first in,
first out, for the recompute of activation checkpointing (`REPLAY_BACKWARD`).

An entry is queued when a recompute can follow: a grad-enabled forward (a non-reentrant
checkpoint), or a forward run without grad inside an autograd Function's forward (a
reentrant checkpoint, `torch.utils.checkpoint(..., use_reentrant=True)`), whose node then
holds the entry. An entry lives as long as the autograd graph of its forward: once that
graph is freed (backpropagated, or dropped without a backward) the entry can never be
recomputed and is discarded, so a pop never replays another batch's routing.
"""
from __future__ import annotations

import collections
import sys
import weakref
from collections.abc import Iterable

import torch

from ..plan import RoutingPlan
from .store import RouterReplayError


class RecomputeQueues:
    """One first-in, first-out queue of `_QueueEntry` per MoE layer id."""

    def __init__(self, layer_ids: Iterable[int]) -> None:
        self._q: dict[int, collections.deque] = {lid: collections.deque() for lid in layer_ids}

    def clear(self) -> None:
        for q in self._q.values():
            q.clear()

    def depth(self, layer_id: int) -> int:
        """Entries waiting for a recompute (entries whose forward's graph is gone are not
        counted: they can never be recomputed)."""
        q = self._q[layer_id]
        _drop_dead(q)
        return len(q)

    def push(self, layer_id: int, plan: RoutingPlan, max_queue: int) -> RoutingPlan:
        """Queue the indices of a replayed forward's `plan` when a recompute can follow (see
        the module docstring); returns the plan, its weights bound to the entry when the
        forward's graph holds it."""
        node = None if torch.is_grad_enabled() else _enclosing_function_node()
        if not (torch.is_grad_enabled() or node is not None):
            return plan
        q = self._q[layer_id]
        _drop_dead(q)
        if len(q) >= max_queue:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: {len(q)} replayed forwards are "
                f"waiting for REPLAY_BACKWARD (max_queue={max_queue}); "
                f"without activation recompute set recompute=False, or call "
                f"clear_queues() after each step"
            )
        entry = _QueueEntry(plan.expert_indices.detach())
        if node is not None:
            _bind_to_node(node, entry)
        elif plan.weights.requires_grad:
            plan = plan._replace(weights=_bind_to_graph(plan.weights, entry))
        q.append(entry)
        return plan

    def pop(self, layer_id: int, num_tokens: int) -> torch.Tensor:
        """The indices of the oldest live replayed forward of the layer, for a recompute of
        `num_tokens` tokens."""
        q = self._q[layer_id]
        _drop_dead(q)
        if not q:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD but the layer's "
                f"queue is empty: the recompute has no matching REPLAY_FORWARD (forwards "
                f"are queued when recompute=True and grad is enabled, or inside a reentrant "
                f"checkpoint's forward; an entry goes when the graph of its forward is "
                f"freed)"
            )
        idx = q.popleft().indices
        if idx.shape[0] != num_tokens:
            raise RouterReplayError(
                f"RouterReplay.route: layer {layer_id}: REPLAY_BACKWARD pops {idx.shape[0]} "
                f"tokens but the recomputed logits have T={num_tokens} tokens; recompute "
                f"order differs from the forward order"
            )
        return idx


class _QueueEntry:
    """The indices a REPLAY_FORWARD used, waiting for its recompute. `alive` turns False
    when the autograd graph of that forward is freed (backpropagated, or dropped without a
    backward: a skipped step, an evaluation forward with grad enabled): such an entry can
    never be recomputed, and popping it would replay another batch's routing."""

    __slots__ = ("__weakref__", "alive", "indices", "token_ref")

    def __init__(self, indices: torch.Tensor):
        self.indices = indices
        self.alive = True
        self.token_ref = None  # set by _bind_to_graph; kept so that its callback fires


class _GraphToken:
    """Held by a node of the forward's graph; its deletion marks the queue entry dead."""

    __slots__ = ("__weakref__",)


class _Bind(torch.autograd.Function):
    """Identity on the gate weights whose node holds a token: the node lives exactly as
    long as the forward's graph."""

    @staticmethod
    def forward(ctx, weights, token):
        ctx.token = token
        return weights.view_as(weights)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _bind_to_graph(weights: torch.Tensor, entry: _QueueEntry) -> torch.Tensor:
    token = _GraphToken()
    entry_ref = weakref.ref(entry)

    def _freed(_ref, entry_ref=entry_ref):
        e = entry_ref()
        if e is not None:
            e.alive = False

    entry.token_ref = weakref.ref(token, _freed)
    return _Bind.apply(weights, token)


def _bind_to_node(node, entry: _QueueEntry) -> None:
    """The entry lives as long as `node`, the context (and backward node) of the autograd
    Function whose forward runs the layer: a reentrant checkpoint's, which its backward
    recomputes; freed without a backward (no input needed grad, or the graph was
    dropped), it takes the entry with it."""
    token = _GraphToken()
    entry_ref = weakref.ref(entry)

    def _freed(_ref, entry_ref=entry_ref):
        e = entry_ref()
        if e is not None:
            e.alive = False

    entry.token_ref = weakref.ref(token, _freed)
    tokens = getattr(node, "_replay_ops_tokens", None)
    if tokens is None:
        tokens = node._replay_ops_tokens = []
    tokens.append(token)


def _enclosing_function_node():
    """The context of the innermost autograd Function whose forward is running further up
    this call (a reentrant checkpoint: `torch.utils.checkpoint(..., use_reentrant=True)`
    runs the layers inside `CheckpointFunction.forward`, without grad, and again in its
    backward), or None. Looked up only for a replayed forward run without grad."""
    ctx_type = torch.autograd.function.FunctionCtx
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_varnames[:1] == ("ctx",):
            ctx = frame.f_locals.get("ctx")
            if isinstance(ctx, ctx_type):
                return ctx
        frame = frame.f_back
    return None


def _drop_dead(q: collections.deque) -> None:
    """Discard the entries whose forward's graph is gone, keeping the order of the rest."""
    if any(not e.alive for e in q):
        live = [e for e in q if e.alive]
        q.clear()
        q.extend(live)
