"""Integrations of replay_ops with model libraries.

`replay_ops.integrations.hf`: Hugging Face `transformers` MoE models (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V3, and any added with `hf.register_family`). It is imported on demand, so `import replay_ops` never
needs `transformers`.
"""
