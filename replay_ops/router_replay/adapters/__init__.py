"""Rollout adapters (R3): routing returned by the rollout engines, in the training formats.

    from replay_ops.router_replay.adapters import ModelShape, vllm_batch, sglang_batch

    shape = ModelShape(num_experts=64, top_k=8, moe_layer_ids=[1, 2, 3], num_hidden_layers=4)
    batch = vllm_batch(routed_experts, prompt_lens, response_lens, shape, packing="thd")
    router_replay.set_routing(batch)  # checked against `shape` already: not scanned again

Modules: `batch` (the types, checks and packing into the training formats that every
engine shares), one module per
engine (`vllm`, `sglang`), and `verl` (verl's own padded layout and batch key).

## The adapter contract (a new rollout engine is a new module)

An engine module turns one batch of the engine's per-request routing into a list of
`SequenceRouting`, one per request in batch order, and offers a `<engine>_batch` that packs
them with `batch.pack`. It must:

1. call `check_batch(payloads, batch_size, who, allow_missing)` first: one entry per
   request, None for a request without routing, which is an error unless `allow_missing`;
2. give a request without routing `missing_sequence(layout, n)` (every slot -1, mask False);
3. append each turn of a request through `MultiTurnRouting.add_turn(routing, seq_len,
   start)` (which checks the rows against `seq_len - 1 - start`, maps absolute or MoE layers
   with `to_moe`, checks the values, and never overwrites earlier turns), then take
   `.sequence(num_tokens)`, which adds the final token's placeholder row (mask False); an
   engine module that checks the MoE columns itself first takes them from `moe_columns`
   (the one layer-mapping decision) and gives that result to `add_turn`;
4. raise `RoutingMismatchError` naming the request (and turn) and both lengths whenever the
   payload does not line up with the request, and never guess a layer count or a length
   that the data cannot settle (see `sglang.payload_layers`).

Outputs are int16 `[n, L_moe, K]` with -1 for no route, indexed by MoE ordinal
(`layer_index="moe"` for `RouterReplay.set_routing`). Ids are logical expert ids. The
`<engine>_batch` functions return a `ReplayBatch` checked against the model shape (its
values were scanned once, per turn, by `to_moe`), which no sink scans again.
"""
from ..._deprecated import deprecated_names
from .batch import (
    INDEX_DTYPE,
    PACKINGS,
    ModelShape,
    MoEColumns,
    MultiTurnRouting,
    ReplayBatch,
    RoutingMismatchError,
    SequenceRouting,
    check_batch,
    missing_sequence,
    moe_columns,
    pack,
    pack_padded,
    pack_thd,
    to_moe,
)
from .sglang import decode_sglang, encode_sglang, payload_layers, sglang_batch, sglang_sequences
from .verl import from_verl_padded, routing_from_batch
from .vllm import decode_vllm, encode_vllm, vllm_batch, vllm_dtype, vllm_sequences

__all__ = [
    "INDEX_DTYPE",
    "ModelShape",
    "MoEColumns",
    "PACKINGS",
    "MultiTurnRouting",
    "ReplayBatch",
    "RoutingMismatchError",
    "SequenceRouting",
    "check_batch",
    "decode_sglang",
    "decode_vllm",
    "encode_sglang",
    "encode_vllm",
    "from_verl_padded",
    "missing_sequence",
    "moe_columns",
    "pack",
    "pack_padded",
    "pack_thd",
    "payload_layers",
    "routing_from_batch",
    "sglang_batch",
    "sglang_sequences",
    "to_moe",
    "vllm_batch",
    "vllm_dtype",
    "vllm_sequences",
]


# deprecated (one release): the model shape is ModelShape
__getattr__ = deprecated_names(__name__, {"ModelLayout": ("ModelShape", ModelShape)})
