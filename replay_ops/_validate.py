"""Input checks shared by every backend.

Static checks (shape, dtype, device, options) always run: they cost no device sync.
Data checks (index range, duplicates in a row) need the index values, so they run only
when `validate=True`; with `validate=False` the ops are sync-free and CUDA-graph safe,
and the caller promises the indices are valid.

Every message names the argument, and for data errors the row and the value.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from . import scores
from .plan import plan_capacity

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)
PLAN_DTYPE = torch.int32


def check_gate_inputs(
    logits: torch.Tensor,
    expert_indices: torch.Tensor,
    replay_mask: torch.Tensor | None,
    score_func: str,
    align: int,
) -> None:
    scores.get(score_func)
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"replay_ops.gate: align must be an integer >= 1, got align={align!r}")
    if logits.dim() != 2:
        raise ValueError(
            f"replay_ops.gate: logits must be 2-D [T, E], got shape {tuple(logits.shape)}"
        )
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(
            f"replay_ops.gate: logits dtype {logits.dtype} is not supported; "
            f"expected one of {LOGIT_DTYPES}"
        )
    if expert_indices.is_floating_point() or expert_indices.is_complex():
        raise TypeError(
            f"replay_ops.gate: expert_indices must be an integer tensor "
            f"(int16/int32/int64), got dtype {expert_indices.dtype}"
        )
    if expert_indices.dtype not in INDEX_DTYPES:
        raise TypeError(
            f"replay_ops.gate: expert_indices dtype {expert_indices.dtype} is not supported; "
            f"expected one of {INDEX_DTYPES}"
        )
    if expert_indices.dim() != 2:
        raise ValueError(
            f"replay_ops.gate: expert_indices must be 2-D [T, K], got shape "
            f"{tuple(expert_indices.shape)} (slice one layer out of a [T, L, K] recording "
            f"with recording[:, layer, :])"
        )
    T, E = logits.shape
    if expert_indices.shape[0] != T:
        raise ValueError(
            f"replay_ops.gate: shape mismatch: logits has T={T} rows but expert_indices has "
            f"{expert_indices.shape[0]} rows (shapes {tuple(logits.shape)} and "
            f"{tuple(expert_indices.shape)})"
        )
    K = expert_indices.shape[1]
    if K < 1:
        raise ValueError(f"replay_ops.gate: expert_indices needs at least one column, got K={K}")
    if K > E:
        raise ValueError(
            f"replay_ops.gate: top-k K={K} (expert_indices.shape[1]) is larger than the "
            f"number of experts E={E} (logits.shape[1])"
        )
    if expert_indices.device != logits.device:
        raise ValueError(
            f"replay_ops.gate: tensors on different devices: logits on {logits.device}, "
            f"expert_indices on {expert_indices.device}"
        )
    plan_capacity(T, K, E, align)
    if replay_mask is not None:
        if replay_mask.dtype != torch.bool:
            raise TypeError(
                f"replay_ops.gate: replay_mask must be a bool tensor, got {replay_mask.dtype}"
            )
        if replay_mask.shape != (T,):
            raise ValueError(
                f"replay_ops.gate: replay_mask must have shape [T]=({T},), got "
                f"{tuple(replay_mask.shape)}"
            )
        if replay_mask.device != logits.device:
            raise ValueError(
                f"replay_ops.gate: tensors on different devices: logits on {logits.device}, "
                f"replay_mask on {replay_mask.device}"
            )


GATE_PADDING = ("empty", "select")


def check_gate_padding(padding) -> None:
    """`replay_ops.gate` routes a padding row (a -1 slot, an id outside [0, E), a repeated
    expert) as "empty" slots or by the model's own selection ("select")."""
    if padding not in GATE_PADDING:
        raise ValueError(f"replay_ops.gate: unknown padding={padding!r}; expected one of "
                         f"{GATE_PADDING} (\"spread\" and \"fallback\" are "
                         f"replay_ops.gate_dense's)")


def check_weights_dtype(op: str, logits: torch.Tensor, weights_dtype) -> None:
    """`weights_dtype` of a gate: None or the logits' dtype (weights rounded to it), or the
    logits' compute dtype (float32 for half and bfloat16 logits: the weights as computed)."""
    if weights_dtype is None or weights_dtype == logits.dtype:
        return
    cdt = scores.compute_dtype(logits.dtype) if logits.is_floating_point() else None
    if weights_dtype != cdt:
        raise ValueError(f"replay_ops.{op}: weights_dtype must be None, the logits' dtype "
                         f"({logits.dtype}) or their compute dtype ({cdt}), got "
                         f"{weights_dtype!r}")


def check_selection(op: str, logits: torch.Tensor, top_k: int, score_func: str, source: str,
                    expert_bias: torch.Tensor | None, round_scores: bool, num_groups: int,
                    group_topk: int, group_score_topn: int) -> None:
    """The selection's options against the call's sizes (static: no device read). Every
    message names the argument and its value."""
    E = logits.shape[1]
    w = f"replay_ops.{op}: selection"
    if source not in ("scores", "logits"):
        raise ValueError(f"{w}.source must be 'scores' or 'logits', got {source!r}")
    if source == "logits" and score_func != "softmax":
        raise ValueError(f"{w}.source='logits' (Megatron-Core's softmax router without "
                         f"pre-softmax) needs score_func='softmax', got "
                         f"score_func={score_func!r}")
    if not isinstance(round_scores, bool):
        raise TypeError(f"{w}.round_scores must be a bool, got {round_scores!r}")
    for name, v in (("num_groups", num_groups), ("group_topk", group_topk),
                    ("group_score_topn", group_score_topn)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{w}.{name} must be an integer >= 0, got {name}={v!r}")
    if expert_bias is not None:
        if not isinstance(expert_bias, torch.Tensor) or not expert_bias.is_floating_point():
            what = expert_bias.dtype if isinstance(expert_bias, torch.Tensor) else \
                type(expert_bias).__name__
            raise TypeError(f"{w}.expert_bias must be a float tensor [E], got {what}")
        if tuple(expert_bias.shape) != (E,):
            raise ValueError(f"{w}.expert_bias must have shape [E]=({E},) (one value per "
                             f"expert of logits {tuple(logits.shape)}), got "
                             f"{tuple(expert_bias.shape)}")
        if expert_bias.device != logits.device:
            raise ValueError(f"replay_ops.{op}: tensors on different devices: logits on "
                             f"{logits.device}, selection.expert_bias on {expert_bias.device}")
    if (num_groups > 0) != (group_topk > 0):
        raise ValueError(f"{w}: group-limited selection needs both num_groups and group_topk "
                         f"(> 0), got num_groups={num_groups}, group_topk={group_topk}")
    if num_groups == 0:
        if group_score_topn:
            raise ValueError(f"{w}.group_score_topn={group_score_topn} needs num_groups and "
                             f"group_topk")
        return
    if E % num_groups:
        raise ValueError(f"{w}.num_groups={num_groups} does not divide the number of experts "
                         f"E={E}")
    if group_topk > num_groups:
        raise ValueError(f"{w}.group_topk={group_topk} is larger than num_groups={num_groups}")
    size = E // num_groups
    n = group_score_topn or top_k // group_topk
    if n < 1:
        raise ValueError(f"{w}: the group score sums the top K // group_topk = {top_k} // "
                         f"{group_topk} = 0 scores of a group (group_topk={group_topk} > "
                         f"K={top_k}); set group_score_topn")
    if n > size:
        raise ValueError(f"{w}: the group score sums the top {n} scores of a group "
                         f"(group_score_topn={group_score_topn}, K={top_k}, group_topk="
                         f"{group_topk}) but a group has E / num_groups = {size} experts")
    if top_k > group_topk * size:
        raise ValueError(f"{w}: K={top_k} experts cannot be chosen from the kept groups: "
                         f"group_topk={group_topk} groups of E / num_groups = {size} experts "
                         f"hold {group_topk * size}")


def check_index_values(
    expert_indices: torch.Tensor, num_experts: int, replay_mask: torch.Tensor | None,
    repeats: bool = True,
) -> None:
    """Data checks: range and (with `repeats`) duplicates. Rows with replay_mask False are
    not checked (their recorded content is ignored: the model's own selection routes them).
    One host read when the indices are valid."""
    idx = expert_indices
    bad = first_bad_route(idx[:, None, :], num_experts, replay_mask, repeats=repeats)
    if bad is None:
        return
    t, k, v, row = bad.token, bad.slot, bad.value, bad.row
    if bad.kind == "range":
        raise ValueError(
            f"replay_ops.gate: expert_indices[{t}, {k}] = {v} is out of range for "
            f"num_experts E={num_experts}; valid values are 0..{num_experts - 1}, or -1 for "
            f"an empty slot (row {t}: {row})"
        )
    raise ValueError(
        f"replay_ops.gate: expert_indices row {t} repeats expert {v} (columns "
        f"{row.index(v)} and {k}; row {t}: {row}); each expert may appear at most once per "
        f"token, or the dispatch token count differs from T*K"
    )


# --------------------------------------------------------------- routing dtypes
# Routing arrives in whatever integer type the engine chose (vLLM 0.32: numpy uint8/uint16
# for <= 256 / more experts, earlier versions int32 or int16; verl: int16; record files:
# uint8 or int16).
# Every entry point turns it into the narrowest signed type that holds all of its values,
# so -1 keeps meaning "no route" and an unsigned value keeps its value: an unsigned type
# cannot hold -1, and its maximum (255, 65535, ...) is an expert id like any other, which
# the range check refuses when it is >= num_experts. No value is read as a sentinel.
SIGNED_ROUTING = {
    torch.int8: torch.int16,
    torch.uint8: torch.int16,
    torch.int16: torch.int16,
    torch.uint16: torch.int32,
    torch.int32: torch.int32,
    torch.uint32: torch.int64,
    torch.int64: torch.int64,
    torch.uint64: torch.int64,
}
UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def signed_routing(x, who: str, arg: str = "routing",
                   error: type[Exception] = TypeError) -> tuple[torch.Tensor, torch.dtype]:
    """(routing as a signed integer tensor holding the same values, its dtype as it came).

    `x` is a torch tensor, a numpy array or a nested list of any integer type: int8/16/32/
    64 or uint8/16/32/64. Signed int16/32/64 tensors come back as they are (no copy); int8
    and unsigned ones are widened without loss (uint64 values above the int64 range are
    refused, with the entry named). A float, bool or complex dtype raises `error` naming
    `arg` and the dtype."""
    if not isinstance(x, torch.Tensor):
        try:
            a = np.asarray(x)
            if not (a.flags.writeable and a.flags.c_contiguous):
                a = a.copy()  # engines may hand over read-only views of their buffers
            x = torch.from_numpy(a)
        except (TypeError, ValueError, RuntimeError) as e:
            raise error(f"{who}: {arg} must be an integer tensor or array, got "
                        f"{type(x).__name__} ({e})") from None
    orig = x.dtype
    if orig not in SIGNED_ROUTING:
        raise error(f"{who}: {arg} must hold integer expert ids (int8/16/32/64 or uint8/16/32/"
                    f"64), got {orig}")
    if orig == torch.uint64:
        bits = x.view(torch.int64)  # the same bits: values >= 2**63 read negative
        pos = _first_true(bits < 0)
        if pos is not None:
            value_error = error if issubclass(error, ValueError) else ValueError
            v = int(bits[tuple(pos)]) + (1 << 64)
            raise value_error(f"{who}: {arg}{pos} = {v} (row {pos[0]}) is not an expert id: it "
                              f"does not fit int64{unsigned_note(orig, v)}")
        return bits, orig
    want = SIGNED_ROUTING[orig]
    return (x if want == orig else x.to(want)), orig


def int16_routing(x, who: str, arg: str = "routing", error: type[Exception] = ValueError,
                  arrived_as: torch.dtype | None = None) -> tuple[torch.Tensor, torch.dtype]:
    """`signed_routing`, then int16 (the training layout's type): a value outside -1..32767
    raises `error` naming the entry, its row and value (one host read when the routing
    is not int16 already). `arrived_as`: the dtype the routing came in, for the message,
    when it was converted already."""
    t, orig = signed_routing(x, who, arg, error)
    orig = arrived_as or orig
    if t.dtype == torch.int16:
        return t, orig
    pos = _first_true((t < -1) | (t > torch.iinfo(torch.int16).max))
    if pos is not None:
        v = int(t[tuple(pos)])
        raise error(f"{who}: {arg}{pos} = {v} (row {pos[0]}) is outside -1..32767, the ids the "
                    f"int16 training layout holds (-1 = no route){unsigned_note(orig, v)}")
    return t.to(torch.int16), orig


def _first_true(flags: torch.Tensor) -> list[int] | None:
    """The index of the first True entry (row-major), or None (one host read)."""
    if flags.numel() == 0 or not bool(flags.any()):
        return None
    return [int(v) for v in flags.nonzero()[0]]


def unsigned_note(dtype: torch.dtype, value: int) -> str:
    """The words added to a range error for routing that arrived unsigned."""
    if dtype not in UNSIGNED:
        return ""
    top = (1 << (8 * dtype.itemsize)) - 1
    what = f"; {value} is its maximum, read as an expert id, not as an empty slot" \
        if value == top else ""
    return (f" (the routing arrived as {dtype}, which cannot hold -1 for an empty slot{what}; "
            f"mark missing routes with -1 in a signed dtype, or with a replay mask)")


class BadRoute(NamedTuple):
    """The first bad entry of a routing tensor [n, L, K]: an expert id outside [-1, E)
    (`kind` "range", at token, layer column, slot, with its value) or a token whose layer
    repeats an expert (`kind` "repeat", `row` the layer's K ids)."""

    kind: str
    token: int
    layer: int
    slot: int
    value: int
    row: list


CHECK_CHUNK_TOKENS = 1 << 16  # tokens checked per step: bounds the temporaries


def first_bad_route(routing: torch.Tensor, num_experts: int,
                    mask: torch.Tensor | None = None, *, repeats: bool = True
                    ) -> BadRoute | None:
    """The one scan of routing values [n, L, K] (-1 = no route): every id in [-1, E), and
    (with `repeats`) no expert twice in a token's layer. Tokens where `mask` [n] is False
    are not checked. One host read when the routing is valid (the tokens are checked in
    chunks, the flags read together); the location of the first bad entry otherwise (range
    errors first, then repeats, each in token order). Each caller words the error for its
    own argument (`describe_bad_route`, `check_index_values`, Megatron's
    `check_expert_range`)."""
    n = routing.shape[0]
    if routing.numel() == 0:
        return None
    if SIGNED_ROUTING.get(routing.dtype, routing.dtype) != routing.dtype:
        routing = routing.to(SIGNED_ROUTING[routing.dtype])  # comparisons need a signed type
    keep = None if mask is None else mask.to(torch.bool).to(routing.device)
    flags = []
    for t0 in range(0, n, CHECK_CHUNK_TOKENS):
        bad, dup = _bad_entries(routing[t0:t0 + CHECK_CHUNK_TOKENS], num_experts,
                                None if keep is None else keep[t0:t0 + CHECK_CHUNK_TOKENS],
                                repeats)
        flags += [bad.any(), dup.any()]
    flags = torch.stack(flags).view(-1, 2).tolist()
    for kind, col in (("range", 0), ("repeat", 1)):
        for c, f in enumerate(flags):
            if not f[col]:
                continue
            t0 = c * CHECK_CHUNK_TOKENS
            r = routing[t0:t0 + CHECK_CHUNK_TOKENS].to(torch.int64)
            bad, dup = _bad_entries(r, num_experts,
                                    None if keep is None else keep[t0:t0 + CHECK_CHUNK_TOKENS],
                                    repeats)
            if kind == "range":
                t, layer, k = (int(v) for v in bad.nonzero()[0])
                return BadRoute(kind, t0 + t, layer, k, int(r[t, layer, k]), r[t, layer].tolist())
            t, layer = (int(v) for v in dup.nonzero()[0])
            row = r[t, layer].tolist()
            k = next(j for j, v in enumerate(row) if v >= 0 and v in row[:j])
            return BadRoute(kind, t0 + t, layer, k, row[k], row)
    return None


def outside_experts(r: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The range predicate, elementwise on the device: ids outside [-1, E) (-1 = no route).
    Used by every range check (the host scans above, the deferred check of
    `replay_ops.distributed.gate`)."""
    return (r < -1) | (r >= num_experts)


def _bad_entries(r: torch.Tensor, num_experts: int, keep: torch.Tensor | None,
                 repeats: bool = True):
    """([n, L, K] ids outside [-1, E), [n, L] layers that repeat an expert), masked."""
    bad = outside_experts(r, num_experts)
    if repeats:
        s = r.sort(dim=2).values
        dup = ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(dim=2)
    else:
        dup = torch.zeros(r.shape[:2], dtype=torch.bool, device=r.device)
    if keep is not None:
        bad = bad & keep[:, None, None]
        dup = dup & keep[:, None]
    return bad, dup


def check_plan_tensors(name: str, row_id_map: torch.Tensor, sorted_slots: torch.Tensor) -> None:
    if row_id_map.dtype != PLAN_DTYPE or row_id_map.dim() != 2 or row_id_map.shape[1] < 1:
        raise ValueError(
            f"replay_ops.{name}: row_id_map must be int32 [T, K] with K >= 1, got "
            f"{row_id_map.dtype} {tuple(row_id_map.shape)}; pass the RoutingPlan returned by "
            "replay_ops.gate"
        )
    if sorted_slots.dtype != PLAN_DTYPE or sorted_slots.dim() != 1:
        raise ValueError(
            f"replay_ops.{name}: sorted_slots must be int32 [T*K + E*(align-1)], got "
            f"{sorted_slots.dtype} {tuple(sorted_slots.shape)}"
        )
    if row_id_map.device != sorted_slots.device:
        raise ValueError(
            f"replay_ops.{name}: tensors on different devices: row_id_map on "
            f"{row_id_map.device}, sorted_slots on {sorted_slots.device}"
        )


def check_hidden(
    name: str, arg: str, x: torch.Tensor, rows: int | None, rows_what: str, device
) -> None:
    """2-D float tensor on `device`; with `rows`, exactly that many rows."""
    if x.dim() != 2:
        raise ValueError(f"replay_ops.{name}: {arg} must be 2-D [rows, H], got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"replay_ops.{name}: {arg} must be floating point, got {x.dtype}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(
            f"replay_ops.{name}: {arg} has {x.shape[0]} rows but the plan has {rows} "
            f"({rows_what}); shape {tuple(x.shape)}"
        )
    if x.device != device:
        raise ValueError(
            f"replay_ops.{name}: tensors on different devices: {arg} on {x.device}, "
            f"the plan on {device}"
        )


def check_dense_inputs(logits, expert_indices, replay_mask, fallback, score_func, align,
                       padding, ep_size, spread_offset) -> None:
    """The checks of replay_ops.gate, plus the dense mode's own options."""
    from .plan import PADDING_MODES

    check_gate_inputs(logits, expert_indices, replay_mask, score_func, align)
    if padding not in PADDING_MODES:
        raise ValueError(f"replay_ops.gate_dense: unknown padding={padding!r}; expected one of "
                         f"{tuple(PADDING_MODES)}")
    E = logits.shape[1]
    if not isinstance(ep_size, int) or ep_size < 1 or E % ep_size:
        raise ValueError(f"replay_ops.gate_dense: ep_size={ep_size!r} must be a positive "
                         f"integer dividing the number of experts E={E}")
    if not isinstance(spread_offset, int) or spread_offset < 0:
        raise ValueError(f"replay_ops.gate_dense: spread_offset must be an integer >= 0, got "
                         f"{spread_offset!r}")
    if padding == "fallback" and fallback is None:
        raise ValueError("replay_ops.gate_dense: padding='fallback' needs the fallback "
                         "indices (fallback=[T, K] expert ids)")
    if fallback is not None:
        if fallback.dtype not in INDEX_DTYPES or tuple(fallback.shape) != tuple(
                expert_indices.shape):
            raise ValueError(
                f"replay_ops.gate_dense: fallback must be an int16/int32/int64 tensor shaped "
                f"like expert_indices {tuple(expert_indices.shape)}, got {fallback.dtype} "
                f"{tuple(fallback.shape)}")
        if fallback.device != logits.device:
            raise ValueError(
                f"replay_ops.gate_dense: tensors on different devices: logits on "
                f"{logits.device}, fallback on {fallback.device}")


def check_row_flags(row_flags: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                    replay_mask: torch.Tensor | None, padding: str) -> None:
    """validate=True of the dense gate: one host read of the row flags; an id outside
    [-1, E) is an error, and so is a repeated expert with padding="empty" (the other modes
    fill such rows). The message is check_index_values' (which reads more, on the error
    path only)."""
    from .plan import ROW_OUT_OF_RANGE, ROW_REPEAT

    if row_flags.numel() == 0:
        return
    flags = row_flags.numpy(force=True)  # the one host read
    bad = ROW_OUT_OF_RANGE | (ROW_REPEAT if padding == "empty" else 0)
    if not (flags & bad).any():
        return
    # range errors are reported first, so a repeat alone never raises in the filling modes
    check_index_values(expert_indices, num_experts, replay_mask)
    raise AssertionError("replay_ops.gate_dense: a row was flagged but no bad entry was found")
