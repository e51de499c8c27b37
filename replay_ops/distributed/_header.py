"""The fixed-size header every rank exchanges before any collective whose size depends on
its input. It is the "cheap, bounded check": its length depends only on the group size W,
so the exchange cannot block on a rank whose input is wrong, and after it every rank holds
every rank's header, checks the same things and raises the same error.

One header is a row of int64:

    [0]  MAGIC                  marks a replay_ops.distributed header
    [1]  op                     OP_DISPATCH, or OP_FAILURE (report_failure)
    [2]  rank                   the sender's rank in the group
    [3]  W                      the sender's group size
    [4]  E                      plan.num_experts
    [5]  K                      plan.top_k
    [6]  H                      hidden.shape[1]
    [7]  dtype code             of hidden
    [8]  align                  plan.align (the local layout's padding)
    [9]  device type code       cpu 0, cuda 1, other 2
    [10] hidden.requires_grad   1/0 (every rank must agree: the backward runs collectives)
    [11] plan weights need grad 1/0
    [12] error code             ERR_NONE, ERR_LOCAL (message below), ERR_RANGE, ERR_DUPLICATE
    [13] error row   [14] error column   [15] error value
    [16 : 16+MSG_WORDS]         UTF-8 message of a local error, zero padded
    [HDR : HDR+W]               rows this rank sends to each rank (its send counts)

Everything but the error fields and the send counts is known on the host; on a GPU those
parts are cached device tensors, so building the header reads nothing back.
"""
from __future__ import annotations

import functools

import torch

MAGIC = 0x52504C59  # "RPLY"
OP_DISPATCH = 1
OP_FAILURE = 2

ERR_NONE = 0
ERR_LOCAL = 1
ERR_RANGE = 2
ERR_DUPLICATE = 3

MSG_WORDS = 64  # 512 bytes of message
F_ERR = 12
F_MSG = 16
HDR = F_MSG + MSG_WORDS

DTYPE_CODES = {
    torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float64: 4,
}
DTYPE_NAMES = {v: str(k).replace("torch.", "") for k, v in DTYPE_CODES.items()}
DEVICE_CODES = {"cpu": 0, "cuda": 1}
DEVICE_NAMES = {0: "cpu", 1: "cuda", 2: "other"}


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPE_CODES.get(dtype, 99)


def device_code(device: torch.device) -> int:
    return DEVICE_CODES.get(device.type, 2)


@functools.lru_cache(maxsize=128)
def _const_part(device: torch.device, fields: tuple) -> torch.Tensor:
    # Created once per (device, fields): on a GPU the host-to-device copy happens here,
    # not in every dispatch.
    return torch.tensor(fields, dtype=torch.int64, device=device)


@functools.lru_cache(maxsize=16)
def _zeros(device: torch.device, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64, device=device)


def build(
    device: torch.device,
    *,
    rank: int,
    world: int,
    E: int,
    K: int,
    H: int,
    dtype: torch.dtype,
    align: int,
    hidden_grad: bool,
    weights_grad: bool,
    deferred: torch.Tensor | None,
    send_counts: torch.Tensor,
) -> torch.Tensor:
    """The header of a rank whose local checks passed. `deferred` is the [4] int64 device
    tensor (code, row, column, value) of data checks done without a host read (or None);
    `send_counts` the [W] device tensor of rows sent to each rank."""
    const = _const_part(device, (
        MAGIC, OP_DISPATCH, rank, world, E, K, H, dtype_code(dtype), align,
        device_code(device), int(hidden_grad), int(weights_grad),
    ))
    err = deferred.to(torch.int64) if deferred is not None else _zeros(device, 4)
    return torch.cat([const, err, _zeros(device, MSG_WORDS), send_counts.to(torch.int64)])


def build_failure(device: torch.device, *, rank: int, world: int, op: int, message: str) -> torch.Tensor:
    """The header of a rank that failed before it could dispatch: it carries the message."""
    row = [0] * (HDR + world)
    row[0], row[1], row[2], row[3] = MAGIC, op, rank, world
    row[F_ERR] = ERR_LOCAL
    data = message.encode("utf-8")[: MSG_WORDS * 8]
    data = data + b"\0" * (MSG_WORDS * 8 - len(data))
    for i in range(MSG_WORDS):
        row[F_MSG + i] = int.from_bytes(data[8 * i: 8 * i + 8], "little", signed=True)
    return torch.tensor(row, dtype=torch.int64, device=device)


def decode_message(row: list[int]) -> str:
    data = b"".join(
        int(v).to_bytes(8, "little", signed=True) for v in row[F_MSG: F_MSG + MSG_WORDS]
    )
    return data.rstrip(b"\0").decode("utf-8", errors="replace")
