"""Tiny random-weight `transformers` MoE models, built locally (nothing is downloaded).

Used by the parity tests and the demo. Every supported architecture keeps its own routing
features: Qwen2-MoE has a shared expert and a dense layer (`mlp_only_layers`), DeepSeek-V3
has dense first layers, sigmoid scores, a non-zero `e_score_correction_bias`, group-limited
selection (`n_group`/`topk_group`) and `routed_scaling_factor`.
"""
from __future__ import annotations

import torch

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")


def tiny_config(
    model_type: str,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 3,
    num_experts: int = 8,
    top_k: int = 2,
    expert_size: int = 32,
    num_heads: int = 4,
    initializer_range: float = 0.02,
    dense_layers: tuple = (),
):
    """A small config of `model_type` (one of ARCHS). `dense_layers`: layer ids that get a
    dense MLP instead of experts (Qwen3-MoE's `mlp_only_layers`; qwen3_moe only)."""
    import transformers as tf

    head_dim = hidden_size // num_heads
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    if dense_layers and model_type != "qwen3_moe":
        raise ValueError(f"tiny_config: dense_layers is for qwen3_moe, got {model_type!r}")
    if model_type == "mixtral":
        return tf.MixtralConfig(
            **common, head_dim=head_dim, num_local_experts=num_experts,
            num_experts_per_tok=top_k, intermediate_size=expert_size,
        )
    if model_type == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common, num_experts=num_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=expert_size, shared_expert_intermediate_size=2 * expert_size,
            intermediate_size=2 * expert_size, norm_topk_prob=False, decoder_sparse_step=1,
            mlp_only_layers=[1] if num_layers > 2 else [],
        )
    if model_type == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=expert_size, intermediate_size=2 * expert_size,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=list(dense_layers),
        )
    if model_type == "olmoe":
        return tf.OlmoeConfig(
            **common, num_experts=num_experts, num_experts_per_tok=top_k,
            intermediate_size=expert_size, norm_topk_prob=False,
        )
    if model_type == "deepseek_v3":
        if num_experts % 4:
            raise ValueError(f"tiny_config: deepseek_v3 needs num_experts % 4 == 0 (4 groups), "
                             f"got num_experts={num_experts}")
        common["num_key_value_heads"] = num_heads  # MLA: one latent KV per head
        return tf.DeepseekV3Config(
            **common, n_routed_experts=num_experts, num_experts_per_tok=top_k,
            moe_intermediate_size=expert_size, intermediate_size=2 * expert_size,
            n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            norm_topk_prob=True, first_k_dense_replace=1 if num_layers > 1 else 0,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=head_dim,
        )
    raise ValueError(f"tiny_config: unknown model_type={model_type!r}; expected one of {ARCHS}")


def tiny_model(model_type: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    """A `...ForCausalLM` of `tiny_config(model_type, **kw)` with random weights drawn under
    `seed` (bitwise the same for the same arguments), in eval mode."""
    import transformers as tf

    config = tiny_config(model_type, **kw)
    cls = {
        "mixtral": tf.MixtralForCausalLM,
        "qwen2_moe": tf.Qwen2MoeForCausalLM,
        "qwen3_moe": tf.Qwen3MoeForCausalLM,
        "olmoe": tf.OlmoeForCausalLM,
        "deepseek_v3": tf.DeepseekV3ForCausalLM,
    }[model_type]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        if model_type == "deepseek_v3":
            # A non-zero expert bias, so that selection (biased) and weights (unbiased) differ.
            for mod in model.modules():
                if type(mod).__name__ == "DeepseekV3TopkRouter":
                    mod.e_score_correction_bias.copy_(0.05 * torch.randn(mod.num_experts))
    return model.to(dtype).eval()
