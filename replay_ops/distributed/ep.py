"""Expert-parallel dispatch and combine over torch.distributed, driven by a RoutingPlan.

An expert-parallel group of W ranks holds E experts, E divisible by W: rank r owns the
global (logical) experts r*E/W .. (r+1)*E/W - 1. Every rank routes its own tokens with
its plan (global expert ids), sends each row to the rank that owns its expert, runs its
local experts on what it received, and sends the results back.

    plan = replay_ops.distributed.gate(logits, recorded, group=g, align=16)
    x_local, handle = replay_ops.distributed.dispatch(hidden, plan, g)
    y_local = grouped_mlp(x_local, handle.local_offsets)    # this rank's E/W experts
    out = replay_ops.distributed.combine(y_local, handle)   # [T, H], weighted by the gates

Everything the exchange needs comes from the plan, with no pass over the tokens:

* send counts: `expert_offsets` is the exclusive prefix sum of the (aligned) per-expert
  counts, so the rows for rank d are `offsets[(d+1)*E/W] - offsets[d*E/W]`: a gather of
  W+1 entries. For a plan built with align > 1 those differences include the plan's own
  padding rows, which are never sent; the send counts are then the per-rank sums of
  `tokens_per_expert` (E entries) and the sender's rows are renumbered without padding
  (one elementwise pass over the [T, K] row map, not over the hidden states).
* receive counts: one fixed-size all-gather of every rank's header (which carries its send
  counts) gives every rank what each source sends it; reading it is the one host sync.
* the regrouping by local expert: one all-to-all of the per-expert counts (E/W entries per
  rank pair) gives C[s, j], the rows source s sends for local expert j. The received rows
  arrive source-major; their place in the local expert-major layout follows from C in
  closed form (prefix sums), on the device.

The local layout on each rank is a `RoutingPlan` of the received rows (K = 1, E/W
experts, the plan's `align`): expert j's rows, ordered by (source rank, token, slot), then
padding up to a multiple of align. It is exactly the slice of the single-process layout of
the concatenated batch (rank 0's tokens, then rank 1's, ...) that holds this rank's
experts, so the experts see bitwise the same inputs as on one device.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import replay_ops
from replay_ops._validate import outside_experts
from replay_ops.plan import RoutingPlan

from . import _header as hd



class DistributedInputError(ValueError):
    """Bad input on one or more ranks of an expert-parallel group. Every rank of the group
    raises it, with the same message, so no rank is left waiting in a collective."""


# ----------------------------------------------------------------------------- the group
def group_info(group=None) -> tuple[object | None, int, int]:
    """(group, rank, world size). `group=None` is the default group when torch.distributed
    is initialized, otherwise a single process (rank 0 of 1, no collectives)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        group = dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def local_expert_range(num_experts: int, group=None) -> range:
    """The global expert ids this rank owns (E must be divisible by the group size)."""
    _, rank, world = group_info(group)
    if num_experts % world:
        raise DistributedInputError(
            f"replay_ops.distributed: num_experts E={num_experts} is not divisible by the "
            f"expert-parallel group size W={world} (rank {rank})"
        )
    n = num_experts // world
    return range(rank * n, (rank + 1) * n)


# ----------------------------------------------------------------------------- the handle
@dataclasses.dataclass
class DispatchHandle:
    """What `combine` (and the backward passes) need to undo a `dispatch`.

    Host values (no device read): `rank`, `world_size`, `send_counts[d]` (rows this rank
    sent to rank d), `recv_counts[s]` (rows it received from rank s), `num_rows` (rows of
    the local buffer), `local_experts` (global ids of this rank's experts), `align`.
    Device values: `local_plan`, the RoutingPlan of the received rows (K = 1, one slot per
    received row, experts = local experts); `local_offsets` = local_plan.expert_offsets
    ([E/W + 1], int32, the grouped-GEMM offsets) and `tokens_per_local_expert` =
    local_plan.tokens_per_expert. `plan` is the sender-side plan without padding rows (the
    caller's plan itself when it has align = 1). `x_local` is the tensor dispatch returned;
    combine links its backward to it, so every rank runs dispatch's backward exchange.
    """

    group: object | None
    rank: int
    world_size: int
    plan: RoutingPlan = dataclasses.field(repr=False)
    local_plan: RoutingPlan = dataclasses.field(repr=False)
    send_counts: list[int]
    recv_counts: list[int]
    num_rows: int
    local_experts: range
    align: int
    hidden_size: int
    dtype: torch.dtype
    backend: str | None = None
    x_local: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def local_offsets(self) -> torch.Tensor:
        return self.local_plan.expert_offsets

    @property
    def tokens_per_local_expert(self) -> torch.Tensor:
        return self.local_plan.tokens_per_expert

    @property
    def num_recv(self) -> int:
        return sum(self.recv_counts)

    @property
    def num_sent(self) -> int:
        return sum(self.send_counts)

    def bytes_moved(self) -> dict:
        """Bytes this rank sends to other ranks (its own rows stay local) in one dispatch
        and one combine; the count exchanges are included."""
        el = torch.empty((), dtype=self.dtype).element_size()
        remote_send = self.num_sent - self.send_counts[self.rank]
        remote_recv = self.num_recv - self.recv_counts[self.rank]
        E_l = len(self.local_experts)
        counts = 4 * E_l * (self.world_size - 1) + 8 * (hd.HDR + self.world_size) * (self.world_size - 1)
        return {
            "dispatch_sent": remote_send * self.hidden_size * el + counts,
            "combine_sent": remote_recv * self.hidden_size * el,
        }


# ----------------------------------------------------------------------------- autograd
def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with fixed splits; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits = (out_splits, in_splits, group)
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.splits
        return _a2a(grad, in_splits, out_splits, group), None, None, None


def _exchange(x, out_splits, in_splits, group, world):
    if world == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _FromLocal(torch.autograd.Function):
    """Local expert-major rows back to arrival order: out[i] = y[row_id_map[i]] (a gather).
    Its backward is the forward regrouping, `replay_ops.permute` with the local plan (a
    gather too, zero for padding rows): no scatter, no atomics."""

    @staticmethod
    def forward(ctx, y, local_plan, num_rows, backend):
        ctx.local = (local_plan, num_rows, backend)
        return y.index_select(0, local_plan.row_id_map[:, 0])

    @staticmethod
    def backward(ctx, grad):
        local_plan, num_rows, backend = ctx.local
        g = replay_ops.permute(grad.contiguous(), local_plan, num_rows, validate=False,
                               backend=backend)
        return g, None, None, None


class _Join(torch.autograd.Function):
    """Returns `y` unchanged and makes `x_local` (dispatch's output) a graph input with a zero
    gradient, so that the backward always reaches dispatch's exchange: a rank whose expert
    output does not depend on its received rows (no rows, say) still sends the gradients of
    the rows it received back to their owners, as every other rank expects."""

    @staticmethod
    def forward(ctx, y, x_local):
        ctx.x_meta = (x_local.shape, x_local.dtype, x_local.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.x_meta
        return grad, torch.zeros(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- plans
def _compact_plan(plan: RoutingPlan) -> RoutingPlan:
    """The same routing with align = 1: padding rows removed, every valid slot renumbered
    to `row_id_map - (padding rows before its expert)`. Elementwise over [T, K]."""
    T, K = plan.expert_indices.shape
    dev = plan.expert_indices.device
    counts = plan.tokens_per_expert.long()
    offsets = plan.expert_offsets.long()
    starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    shift = offsets[:-1] - starts[:-1]  # padding rows before expert e's segment
    idx = plan.expert_indices.long()
    valid = idx >= 0
    rows = torch.where(valid, plan.row_id_map.long() - shift[idx.clamp_min(0)], -1)
    N = T * K
    slots = torch.arange(N, device=dev)
    flat_rows = rows.reshape(-1)
    target = torch.where(flat_rows >= 0, flat_rows, N)  # empty slots: a scratch entry, cut off
    sorted_slots = torch.full((N + 1,), -1, dtype=torch.long, device=dev)
    sorted_slots = sorted_slots.scatter(0, target, torch.where(flat_rows >= 0, slots, -1))[:N]
    i32 = torch.int32
    return RoutingPlan(plan.weights, plan.expert_indices, plan.tokens_per_expert,
                       starts.to(i32), rows.to(i32), sorted_slots.to(i32))


def _local_plan(C: torch.Tensor, world: int, E_l: int, align: int, n_recv: int,
                dtype: torch.dtype) -> RoutingPlan:
    """RoutingPlan of the received rows, from C [W, E_l] (rows source s sent for local
    expert j), with no host read. Received row i (source-major, as all_to_all_single lays
    them out) goes to row `row_id_map[i]` of the local expert-major layout."""
    dev = C.device
    C = C.long().view(world, E_l)
    tot = C.sum(0)  # [E_l]
    padded = (tot + align - 1) // align * align
    zero = tot.new_zeros(1)
    offsets = torch.cat([zero, padded.cumsum(0)])  # [E_l + 1]
    before = C.cumsum(0) - C  # rows of earlier sources, per local expert
    start_local = (offsets[:-1].unsqueeze(0) + before).reshape(-1)  # block (s, j)
    flat = C.reshape(-1)
    start_recv = flat.cumsum(0) - flat  # where block (s, j) starts in arrival order
    block = torch.repeat_interleave(torch.arange(world * E_l, device=dev), flat,
                                    output_size=n_recv)
    i = torch.arange(n_recv, device=dev)
    rows = start_local[block] + (i - start_recv[block])
    R = n_recv + E_l * (align - 1)
    sorted_slots = torch.full((R,), -1, dtype=torch.long, device=dev).scatter(0, rows, i)
    i32 = torch.int32
    return RoutingPlan(
        torch.ones(n_recv, 1, dtype=dtype, device=dev),
        (block % E_l).to(i32).unsqueeze(1),
        tot.to(i32),
        offsets.to(i32),
        rows.to(i32).unsqueeze(1),
        sorted_slots.to(i32),
    )


# ----------------------------------------------------------------------------- checks
class CheckedRoutingPlan(RoutingPlan):
    """A RoutingPlan from `replay_ops.distributed.gate`: its data checks (index range,
    duplicates) were computed on the device and are reported by the next `dispatch`
    on every rank. `deferred_check` is int64 [4]: (code, row, column, value)."""

    deferred_check: torch.Tensor

    def _replace(self, **fields) -> "CheckedRoutingPlan":
        out = super()._replace(**fields)
        out.deferred_check = self.deferred_check
        return out


def gate(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    *,
    group=None,
    replay_mask: torch.Tensor | None = None,
    **kwargs,
) -> CheckedRoutingPlan:
    """`replay_ops.gate` for expert parallelism: the same plan, but the data checks of the
    recorded indices (range, duplicates in a row) run on the device and are reported by
    `dispatch`, on every rank of the group, instead of raising on this rank alone (which
    would leave the others waiting in the exchange). Rows that fail are gated as empty
    (all slots -1) so that nothing out of range reaches a kernel; `dispatch` then raises.
    Without an error this costs no host read (`validate=False` underneath).
    Shape, dtype and option errors still raise here, before any collective."""
    if "validate" in kwargs:
        raise TypeError("replay_ops.distributed.gate: validate is not an option here; the data "
                        "checks always run and are reported by dispatch")
    group_info(group)  # an unusable group fails here, before any work
    if expert_indices.is_floating_point() or logits.dim() != 2 or expert_indices.dim() != 2:
        # let replay_ops.gate word the error
        return replay_ops.gate(logits, expert_indices, replay_mask=replay_mask, **kwargs)
    E = logits.shape[1]
    idx = expert_indices.to(torch.int64)
    T, K = idx.shape
    checked = (replay_mask if replay_mask is not None and replay_mask.shape == (T,)
               else torch.ones(T, dtype=torch.bool, device=idx.device))
    bad = outside_experts(idx, E) & checked[:, None]
    earlier = torch.ones(K, K, dtype=torch.bool, device=idx.device).tril(-1)  # [k, j]: j < k
    same = (idx[:, :, None] == idx[:, None, :]) & earlier & (idx >= 0)[:, :, None]
    dup = same.any(dim=2) & checked[:, None] & ~bad.any(dim=1, keepdim=True)
    any_bad, any_dup = bad.any(), dup.any()
    which = torch.where(any_bad, bad, dup).reshape(-1)
    first = which.to(torch.int32).argmax() if which.numel() else torch.zeros((), dtype=torch.long,
                                                                          device=idx.device)
    code = torch.where(any_bad, hd.ERR_RANGE, torch.where(any_dup, hd.ERR_DUPLICATE, hd.ERR_NONE))
    value = idx.reshape(-1)[first] if which.numel() else first
    check = torch.stack([code.to(torch.int64), first // max(K, 1), first % max(K, 1),
                         value.to(torch.int64)])
    row_bad = bad.any(dim=1) | dup.any(dim=1)
    safe = torch.where(row_bad[:, None], -1, idx).to(expert_indices.dtype)
    plan = replay_ops.gate(logits, safe, replay_mask=replay_mask, validate=False, **kwargs)
    out = CheckedRoutingPlan(*plan)
    out.deferred_check = check
    return out


def _local_checks(hidden, plan, world):
    """Static checks of this rank's input (no device read). Returns (E_local, align)."""
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be the RoutingPlan from replay_ops.gate, got "
                        f"{type(plan).__name__}")
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be a 2-D [T, H] tensor, got {shape}")
    if hidden.dtype not in hd.DTYPE_CODES:
        raise TypeError(f"hidden dtype {hidden.dtype} is not supported; expected one of "
                        f"{tuple(hd.DTYPE_CODES)}")
    T, E = plan.num_tokens, plan.num_experts
    if hidden.shape[0] != T:
        raise ValueError(f"hidden has {hidden.shape[0]} rows but the plan routes T={T} tokens "
                         f"(hidden {tuple(hidden.shape)}, expert_indices "
                         f"{tuple(plan.expert_indices.shape)})")
    if hidden.device != plan.expert_indices.device:
        raise ValueError(f"hidden is on {hidden.device} but the plan is on "
                         f"{plan.expert_indices.device}")
    if E % world:
        raise ValueError(f"num_experts E={E} is not divisible by the expert-parallel group "
                         f"size W={world}")
    return E // world, plan.align


def _raise_on_every_rank(op: str, rows: list[list[int]], world: int) -> None:
    """Every rank runs this on the same gathered headers, so every rank raises the same
    error (or none)."""
    problems = []
    for s, row in enumerate(rows):
        if row[0] != hd.MAGIC or row[3] != world:
            problems.append(f"rank {s}: is not in a replay_ops.distributed exchange (header "
                            f"{row[:4]}); the ranks call different collectives")
            continue
        code = row[hd.F_ERR]
        if code == hd.ERR_LOCAL:
            problems.append(f"rank {s}: {hd.decode_message(row)}")
        elif code == hd.ERR_RANGE:
            t, k, v = row[hd.F_ERR + 1: hd.F_ERR + 4]
            problems.append(
                f"rank {s}: expert_indices[{t}, {k}] = {v} is out of range for num_experts "
                f"E={row[4]}; valid values are 0..{row[4] - 1}, or -1 for an empty slot")
        elif code == hd.ERR_DUPLICATE:
            t, k, v = row[hd.F_ERR + 1: hd.F_ERR + 4]
            problems.append(
                f"rank {s}: expert_indices row {t} repeats expert {v} (column {k}); each "
                f"expert may appear at most once per token")
    if not problems:
        fields = [(4, "num_experts E (plan.num_experts)", str), (5, "top_k K (plan.top_k)", str),
                  (6, "hidden size H (hidden.shape[1])", str),
                  (7, "dtype of hidden", lambda c: hd.DTYPE_NAMES.get(c, f"code {c}")),
                  (8, "align (plan.align)", str),
                  (9, "device type", lambda c: hd.DEVICE_NAMES.get(c, str(c))),
                  (10, "hidden.requires_grad (the backward exchanges gradients)",
                   lambda c: str(bool(c))),
                  (11, "plan.weights.requires_grad (the backward exchanges gradients)",
                   lambda c: str(bool(c)))]
        for i, what, fmt in fields:
            vals = [row[i] for row in rows]
            if len(set(vals)) > 1:
                per = ", ".join(f"rank {s}: {fmt(v)}" for s, v in enumerate(vals))
                problems.append(f"ranks disagree on {what}: {per}")
    if problems:
        bad = sorted({p.split(":")[0] for p in problems if p.startswith("rank ")})
        where = f" on {', '.join(bad)}" if bad else ""
        raise DistributedInputError(
            f"replay_ops.distributed.{op}: bad input{where} of a group of {world} ranks (every "
            f"rank raises this error):\n  " + "\n  ".join(problems))


def _gather_headers(header: torch.Tensor, group, world: int) -> list[list[int]]:
    """All-gather of the fixed-size headers and its one host read."""
    if world == 1:
        return [header.tolist()]
    out = header.new_empty(world * header.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, header, group=group)
    flat = out.tolist()  # the host sync of a dispatch
    n = header.numel()
    return [flat[s * n:(s + 1) * n] for s in range(world)]


def report_failure(exc: BaseException, group=None, *, op: str = "dispatch") -> None:
    """Tell the other ranks of `group`, which are in `dispatch`, that this rank failed
    before its dispatch (for example `replay_ops.gate` raised on its routing): it takes
    part in the header exchange with the error message, so every rank raises
    `DistributedInputError` naming this rank and the error instead of waiting. Raises
    here too (chained to `exc`)."""
    group, rank, world = group_info(group)
    dev = _exchange_device(group, None)
    msg = f"{type(exc).__name__}: {exc}"
    header = hd.build_failure(dev, rank=rank, world=world, op=hd.OP_FAILURE, message=msg)
    rows = _gather_headers(header, group, world)
    try:
        _raise_on_every_rank(op, rows, world)
    except DistributedInputError as err:
        raise err from exc
    raise DistributedInputError(f"replay_ops.distributed.{op}: {msg}") from exc  # pragma: no cover


def _exchange_device(group, hidden) -> torch.device:
    """Device for the header of a rank whose input may be unusable: where the other ranks'
    headers are (NCCL needs a CUDA tensor)."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(hidden, torch.Tensor):
        return hidden.device
    return torch.device("cpu")


# ----------------------------------------------------------------------------- dispatch
def dispatch(
    hidden: torch.Tensor,
    plan: RoutingPlan,
    group=None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, DispatchHandle]:
    """Send every routed row of `hidden` [T, H] to the rank that owns its expert.

    Returns `(x_local, handle)`: `x_local` [handle.num_rows, H] holds this rank's experts'
    rows, expert-major (`handle.local_offsets`), ordered by (source rank, token, slot)
    inside an expert, each expert padded with zero rows to a multiple of `plan.align`.
    With align = 1 it has exactly the received rows; with align > 1 its length is the
    static bound `received + (E/W)*(align-1)` and rows past `local_offsets[-1]` are zero.

    Collectives, in order: an all-gather of a fixed-size header (checks, send counts), one
    host read of it (the only host sync), an all-to-all of the per-expert counts, an
    all-to-all of the rows. Bad input on any rank raises `DistributedInputError` on every
    rank after the header exchange. Differentiable: the backward sends gradients back and
    sums them per token (a combine without weights).
    """
    group, rank, world = group_info(group)
    try:
        E_l, align = _local_checks(hidden, plan, world)
        if plan.align == 1:
            send_plan = plan
            send_counts = plan.expert_offsets[::E_l].diff()  # W+1 entries of the prefix sum
        else:
            send_plan = _compact_plan(plan)
            send_counts = plan.tokens_per_expert.view(world, E_l).sum(1)
        deferred = getattr(plan, "deferred_check", None)
        if isinstance(plan, CheckedRoutingPlan) and deferred is None:
            raise ValueError(
                "plan is a CheckedRoutingPlan without its deferred checks (a copy made "
                "with type(plan)(*plan) or _make loses them); use plan._replace(...), or "
                "the plan replay_ops.distributed.gate returned")
        grad = torch.is_grad_enabled()
        header = hd.build(
            hidden.device, rank=rank, world=world, E=plan.num_experts, K=plan.top_k,
            H=hidden.shape[1], dtype=hidden.dtype, align=align,
            hidden_grad=grad and hidden.requires_grad,
            weights_grad=grad and plan.weights.requires_grad,
            deferred=deferred, send_counts=send_counts,
        )
    except Exception as exc:  # a local problem: report it in the exchange, then everyone raises
        dev = _exchange_device(group, hidden)
        header = hd.build_failure(dev, rank=rank, world=world, op=hd.OP_DISPATCH,
                                  message=f"{type(exc).__name__}: {exc}")
        rows = _gather_headers(header, group, world)
        try:
            _raise_on_every_rank("dispatch", rows, world)
        except DistributedInputError as err:
            raise err from exc
        raise  # pragma: no cover
    rows = _gather_headers(header, group, world)
    _raise_on_every_rank("dispatch", rows, world)
    send = rows[rank][hd.HDR:hd.HDR + world]
    recv = [rows[s][hd.HDR + rank] for s in range(world)]
    n_send, n_recv = sum(send), sum(recv)

    # Per-expert counts: C[s, j] = rows source s sends for local expert j (device only).
    if world == 1:
        C = plan.tokens_per_expert
    else:
        C = torch.empty_like(plan.tokens_per_expert)
        dist.all_to_all_single(C, plan.tokens_per_expert.contiguous(), group=group)
    x_send = replay_ops.permute(hidden, send_plan, n_send, validate=False, backend=backend)
    x_recv = _exchange(x_send, recv, send, group, world)
    local_plan = _local_plan(C, world, E_l, align, n_recv, hidden.dtype)
    num_rows = local_plan.max_rows
    x_local = replay_ops.permute(x_recv, local_plan, num_rows, validate=False, backend=backend)
    handle = DispatchHandle(
        group=group, rank=rank, world_size=world, plan=send_plan, local_plan=local_plan,
        send_counts=send, recv_counts=recv, num_rows=num_rows,
        local_experts=range(rank * E_l, (rank + 1) * E_l), align=align,
        hidden_size=hidden.shape[1], dtype=hidden.dtype,
        backend=backend,
        x_local=x_local,
    )
    return x_local, handle


# ----------------------------------------------------------------------------- combine
def combine(expert_out: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send the local experts' outputs back and sum them per token, weighted by the gate
    weights: out[t] = sum_k weights[t, k] * y(t, k), accumulated in fp32 in the recorded
    column order (`replay_ops.unpermute`). `expert_out` is [handle.num_rows, H] in the
    layout `dispatch` returned (padding rows are ignored). It is cast to the dtype of the
    `hidden` given to dispatch (the same on every rank), which the output has. No host
    sync.

    Differentiable with respect to `expert_out` and, through the plan's weights, the
    router logits; the backward is a dispatch of the output gradient. With gradients
    enabled every rank takes part in both backward exchanges, whatever its experts did
    (an output not in the graph is attached; the output is linked to `x_local`).

    A rank whose `expert_out` has the wrong shape still takes part in the exchange (with
    NaN rows, so the other ranks do not wait and get NaN, never a plausible value) and
    raises.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"replay_ops.distributed.combine: handle must be the DispatchHandle "
                        f"from dispatch, got {type(handle).__name__}")
    want = (handle.num_rows, handle.hidden_size)
    error = None
    if not isinstance(expert_out, torch.Tensor) or tuple(expert_out.shape) != want:
        shape = (tuple(expert_out.shape) if isinstance(expert_out, torch.Tensor)
                 else type(expert_out).__name__)
        error = (f"replay_ops.distributed.combine: rank {handle.rank}: expert_out must be "
                 f"[handle.num_rows, H] = {list(want)} (the layout dispatch returned), got "
                 f"{shape}")
    elif not expert_out.is_floating_point() or expert_out.device != handle.local_plan.row_id_map.device:
        error = (f"replay_ops.distributed.combine: rank {handle.rank}: expert_out must be a "
                 f"floating-point tensor on {handle.local_plan.row_id_map.device}, got "
                 f"{expert_out.dtype} on {expert_out.device}")
    if error is not None:
        if handle.world_size > 1:
            dev = handle.local_plan.row_id_map.device
            nan = torch.full((handle.num_recv, handle.hidden_size), float("nan"),
                             dtype=handle.dtype, device=dev)
            _a2a(nan, handle.send_counts, handle.recv_counts, handle.group)
        raise ValueError(error)
    # The rows travel in the dtype every rank agreed on at dispatch (hidden's): ranks whose
    # experts return another dtype (autocast, or a rank with no rows returning its fp32
    # input) would otherwise exchange byte streams of different lengths.
    expert_out = expert_out.to(handle.dtype)
    if torch.is_grad_enabled() and handle.world_size > 1:
        # Every rank must run both backward exchanges, or the others wait for this one. The
        # combine exchange: a rank whose expert output is not in the graph (no rows, frozen
        # experts) joins it anyway, since the experts of other ranks may need its gradient.
        if not expert_out.requires_grad:
            expert_out = expert_out.detach().requires_grad_(True)
        # The dispatch exchange: reached even when the output does not use x_local.
        if handle.x_local is not None and handle.x_local.requires_grad:
            expert_out = _Join.apply(expert_out, handle.x_local)
    y_recv = _FromLocal.apply(expert_out, handle.local_plan, handle.num_rows, handle.backend)
    y_back = _exchange(y_recv, handle.send_counts, handle.recv_counts, handle.group,
                       handle.world_size)
    return replay_ops.unpermute(y_back, handle.plan, validate=False, backend=handle.backend)
