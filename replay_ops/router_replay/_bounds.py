"""Sizes that routing arriving from another process (record files, `ReplayBatch` bytes,
engine payloads) may claim: one
set of bounds for the codec and the decoders around it.

The bounds are far beyond any real model (the largest MoE models have fewer than 100
layers and top-k below 32) and keep a crafted header from asking for a Python list of a
billion layer ids or a tensor of terabytes. Token counts have no fixed bound: they come
from data that is physically present (a mask of one bit per token, a payload, a list of
sequence boundaries) or from the caller's `max_tokens=` / `max_bytes=`.
"""
from __future__ import annotations

MAX_LAYERS = 1024  # L, num_hidden_layers
MAX_TOP_K = 256  # K
MAX_LAYER_SLOTS = 1 << 16  # L * K of one token
MAX_TOKENS = 2**40  # tokens of one codec blob
MAX_IDS = 2**36  # T * L * K of one codec blob (128 GiB as int16)


def check_limits(who: str, num_tokens: int, row_bytes: int, max_tokens, max_bytes,
                 error, field: str = "num_tokens") -> None:
    """Refuse (`error`) a decoded size above the caller's `max_tokens` / `max_bytes`."""
    for name, v in (("max_tokens", max_tokens), ("max_bytes", max_bytes)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"{who}: {name} must be a non-negative integer or None, got {v!r}")
    if max_tokens is not None and num_tokens > max_tokens:
        raise error(f"{who}: {field}={num_tokens} exceeds max_tokens={max_tokens}")
    if max_bytes is not None and num_tokens * row_bytes > max_bytes:
        raise error(f"{who}: {field}={num_tokens} tokens decode to {num_tokens * row_bytes} "
                    f"bytes, more than max_bytes={max_bytes}")
