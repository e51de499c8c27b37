"""Helpers for tests, benchmarks, examples and the demo (not needed to use the ops).

* `replay_ops.testing.tiny`: tiny random-weight `transformers` MoE models, built locally.
* `replay_ops.testing.checks`: seeded inputs, the tolerance rule against the fp64
  reference, exact integer comparison, the plan's structural invariants, and a counter of
  the host's reads of tensor memory.
* `replay_ops.testing.megatron_cpu`: Megatron-Core's MoE layer on a CPU over gloo (CPU
  stand-ins for the CUDA entry points it calls, a gloo world, layer builders, `spawn`).
"""
