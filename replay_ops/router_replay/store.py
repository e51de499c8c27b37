"""The routing a `RouterReplay` replays: one tensor for every MoE layer, its replay mask,
its layer mapping and where it came from, checked once when it is set.

`RoutingStore.set` takes a bare tensor (checked here: the layer mapping decided by L, the
replay mask given or derived, the values scanned with `validate`); `set_checked` takes a
`ReplayBatch` checked against this model's shape (nothing scanned again, no mapping
decided again); `set_recorded` takes a recording (scanned when it was read out). With a
static buffer (`use_static_buffer`) each of them copies into preallocated tensors instead
of keeping the tensor given, so the layers read the same addresses every step.
"""
from __future__ import annotations

import torch

from .._validate import UNSIGNED, signed_routing, unsigned_note
from ..errors import RoutingError
from .shape import ModelShape, describe_bad_route, first_bad_route


class RouterReplayError(RoutingError, RuntimeError):
    """Routing that cannot be replayed as asked (missing, mis-shaped, out of order)."""


def describe_source(source: str | None) -> str:
    """Where a routing came from, for messages ("set_routing", "recorded", "file:<path>")."""
    if source is None:
        return "nowhere"
    if source.startswith("file:"):
        return f"the record file {source[5:]!r}"
    if source == "recorded":
        return "the recording (RECORD forwards of this RouterReplay)"
    return "set_routing()"


class RoutingStore:
    """The routing to replay for a model of `shape`: `routing` [T, L, K] (a tensor given,
    or a view of the static buffer), `cols` {layer id: its column}, `mask` [T] bool or None
    (every row replayed), `mapping` ("moe" or "absolute") and `source`."""

    def __init__(self, shape: ModelShape) -> None:
        self.shape = shape
        self.static: tuple[torch.Tensor, torch.Tensor] | None = None  # use_static_buffer
        self.forget()

    def forget(self) -> None:
        self.routing: torch.Tensor | None = None
        self.cols: dict[int, int] = {}
        self.mask: torch.Tensor | None = None
        self.mapping: str | None = None
        self.source: str | None = None

    # ------------------------------------------------------------------ routing in
    def set(self, indices, replay_mask, layer_index: str, source: str, validate: bool) -> None:
        """A bare routing tensor (see `RouterReplay.set_routing` for the rules)."""
        if not isinstance(indices, torch.Tensor):
            raise TypeError(
                f"RouterReplay.set_routing: indices must be a torch.Tensor or a ReplayBatch, "
                f"got {type(indices).__name__}"
            )
        if indices.dim() == 4:
            B, S = indices.shape[:2]
            indices = indices.reshape(B * S, *indices.shape[2:])
            if replay_mask is not None and replay_mask.dim() == 2:
                replay_mask = replay_mask.reshape(B * S)
        if indices.dim() != 3:
            raise ValueError(
                f"RouterReplay.set_routing: indices must be [T, L, K] or [B, S, L, K], got "
                f"shape {tuple(indices.shape)}"
            )
        indices, dtype = signed_routing(indices, "RouterReplay.set_routing", "indices")
        T, L, K = indices.shape
        if K != self.shape.top_k:
            raise ValueError(
                f"RouterReplay.set_routing: indices have K={K} slots per token but the model "
                f"has top_k={self.shape.top_k} (shape {tuple(indices.shape)})"
            )
        mapping = self.shape.mapping_for(L, "RouterReplay.set_routing", layer_index)
        cols = dict(zip(self.shape.moe_layer_ids, self.shape.columns(mapping)))
        if replay_mask is not None:
            if replay_mask.dtype != torch.bool or tuple(replay_mask.shape) != (T,):
                raise ValueError(
                    f"RouterReplay.set_routing: replay_mask must be bool [T]=({T},), got "
                    f"{replay_mask.dtype} {tuple(replay_mask.shape)}"
                )
            if replay_mask.device != indices.device:
                replay_mask = replay_mask.to(indices.device)
            if validate:
                self._check_masked_rows(indices, cols, replay_mask, source)
        else:
            replay_mask = self._derive_mask(indices, cols)
        # unsigned routing is always checked: its type cannot hold -1, so a format's
        # stand-in for an empty slot (often the type's maximum) would otherwise pass
        if validate or dtype in UNSIGNED:
            self.check_values(indices[:, self.shape.columns(mapping), :], replay_mask, source,
                              dtype)
        self._keep(indices, replay_mask, mapping, cols, source)

    def set_checked(self, batch, source: str) -> None:
        """A `ReplayBatch` checked against this shape: kept as it is, with its mask and its
        layer mapping (a padded [B, S] batch is flattened to B*S tokens, batch-first)."""
        idx, mask = batch.indices, batch.replay_mask
        if idx.dim() == 4:
            idx = idx.reshape(-1, *idx.shape[2:])
            mask = mask.reshape(-1)
        if mask.device != idx.device:
            mask = mask.to(idx.device)
        mapping = batch.layer_index
        self._keep(idx, mask, mapping,
                   dict(zip(self.shape.moe_layer_ids, self.shape.columns(mapping))), source)

    def set_recorded(self, rec: torch.Tensor) -> None:
        """A recording [T, L_moe, K] (checked when it was read out), every row replayed."""
        self._keep(rec, None, "moe", dict(zip(self.shape.moe_layer_ids,
                                              range(self.shape.num_moe_layers))), "recorded")

    def _keep(self, indices, mask, mapping: str, cols: dict, source: str) -> None:
        if self.static is not None:
            self._copy_static(indices[:, [cols[lid] for lid in self.shape.moe_layer_ids], :]
                              if mapping != "moe" else indices, mask, source)
            return
        self.routing, self.cols, self.mask = indices, cols, mask
        self.mapping, self.source = mapping, source

    # ------------------------------------------------------------------ checks
    def check_values(self, moe_routing: torch.Tensor, mask, source: str,
                     dtype: torch.dtype | None = None) -> None:
        """The replayed rows of [T, L_moe, K] routing name experts in range, none twice in a
        token's layer (one host sync). `dtype`: the dtype the routing arrived in, for the
        message."""
        E = self.shape.num_experts
        bad = first_bad_route(moe_routing, E, mask)
        if bad is not None:
            raise RouterReplayError(
                f"RouterReplay: the routing from {describe_source(source)} cannot be "
                f"replayed: {describe_bad_route(bad, E, self.shape.moe_layer_ids)}"
                f"{unsigned_note(dtype, bad.value) if bad.kind == 'range' else ''}"
            )

    def _check_masked_rows(self, indices: torch.Tensor, cols: dict[int, int],
                           mask: torch.Tensor, source: str) -> None:
        """A row marked for replay is routed in every MoE layer: one with every slot -1 in
        a MoE layer would get no expert there (its MoE output 0) instead of falling back."""
        sel = torch.tensor(sorted(set(cols.values())), device=indices.device)
        empty = (indices.index_select(1, sel) < 0).all(dim=2) & mask[:, None]  # [T, L_moe]
        if not bool(empty.any()):
            return
        t = int(empty.any(dim=1).nonzero()[0, 0])
        layers = [self.shape.moe_layer_ids[j] for j in empty[t].nonzero().flatten().tolist()]
        raise RouterReplayError(
            f"RouterReplay.set_routing: token {t} is marked for replay (replay_mask True) but "
            f"has no route (every slot -1) in MoE layers {layers} (routing from "
            f"{describe_source(source)}); replayed, it would get no expert there. Set its "
            f"replay_mask False (the model's own top-k) or route it in every MoE layer")

    def _derive_mask(self, indices: torch.Tensor, cols: dict[int, int]) -> torch.Tensor | None:
        sel = torch.tensor(sorted(set(cols.values())), device=indices.device)
        empty = (indices.index_select(1, sel) < 0).all(dim=2)  # [T, L_moe]
        all_empty = empty.all(dim=1)
        partial = empty.any(dim=1) & ~all_empty
        # one host read for both flags
        any_partial, any_empty = torch.stack([partial.any(), all_empty.any()]).tolist()
        if not any_partial and not any_empty:
            # every row has a route: no mask, so the layers run no fallback selection
            return None
        if any_partial:
            t = int(partial.nonzero()[0, 0])
            layers = [self.shape.moe_layer_ids[j]
                      for j in empty[t].nonzero().flatten().tolist()]
            raise RouterReplayError(
                f"RouterReplay.set_routing: token {t} has no route (all slots -1) in MoE "
                f"layers {layers} but has routes in the other MoE layers; pass an explicit "
                f"replay_mask or fix the recording"
            )
        return ~all_empty

    # ------------------------------------------------------------------ static buffers
    def use_static_buffer(self, max_tokens: int, device) -> None:
        L, K = self.shape.num_moe_layers, self.shape.top_k
        self.static = (torch.full((max_tokens, L, K), -1, dtype=torch.int32, device=device),
                       torch.zeros(max_tokens, dtype=torch.bool, device=device))
        self.forget()

    def _copy_static(self, moe_routing: torch.Tensor, mask: torch.Tensor | None,
                     source: str) -> None:
        buf, mbuf = self.static
        T = moe_routing.shape[0]
        if T > buf.shape[0]:
            raise RouterReplayError(
                f"RouterReplay.set_routing: indices have T={T} tokens but the static buffer "
                f"holds max_tokens={buf.shape[0]} (use_static_buffer); allocate a larger "
                f"one or split the batch")
        buf[:T].copy_(moe_routing)
        if mask is None:
            mbuf[:T].fill_(True)
        else:
            mbuf[:T].copy_(mask)
        self.routing = buf[:T]
        self.cols = dict(zip(self.shape.moe_layer_ids, range(self.shape.num_moe_layers)))
        self.mask = mbuf[:T]
        self.mapping = "moe"
        self.source = source

    # ------------------------------------------------------------------ routing out
    def layer_view(self, layer_id: int) -> torch.Tensor:
        """The [T, K] view of the routing that `layer_id` replays (no copy)."""
        return self.routing[:, self.cols[layer_id], :]

    def move_to(self, device: torch.device) -> None:
        """Move the routing (and mask) to the model's device, keeping its layout, so that
        each layer's slice stays a view. Set the routing on the model's device to avoid
        this copy."""
        self.routing = self.routing.to(device)
        if self.mask is not None:
            self.mask = self.mask.to(device)
