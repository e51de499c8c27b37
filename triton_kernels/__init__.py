"""Triton kernels for replay_ops, installed as `replay_ops.triton_kernels`.

One file per op, each with its public launchers next to its private kernels:
`gate.py` (fused gate weights + dispatch plan, and the gate backward), `permute.py`
(permute and its backward), `unpermute.py` (unpermute, its backward, and the gather-sum
that the permute backward shares), `gate_dense.py` (the dense gate, its backward, and
permute with the row probabilities and its backward), `codec.py` (the routing codec's per-row sort/permutation
transform and its inverse). `_common.py` holds the helpers they share.
"""
