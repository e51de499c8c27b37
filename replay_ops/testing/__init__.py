"""Helpers for tests, examples and the demo (not needed to use the ops).

`replay_ops.testing.tiny`: tiny random-weight `transformers` MoE models, built locally.
"""
