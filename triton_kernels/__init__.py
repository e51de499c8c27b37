"""Triton kernels for replay_ops, installed as `replay_ops.triton_kernels`.

One file per op: `gate.py` (fused gate weights + dispatch plan, and the gate backward),
`permute.py` (permute and its backward), `unpermute.py` (unpermute and its backward).
"""
