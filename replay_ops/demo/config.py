"""The demo's sizes and options."""
from __future__ import annotations

import dataclasses

SIZES = {
    # name: model and workload (see DemoConfig fields)
    "tiny": dict(vocab_size=128, hidden_size=32, num_layers=3, num_experts=16, top_k=4,
                 expert_size=16, num_seqs=8, prompt_len=(6, 12), response_len=(6, 12),
                 infer_batch=4, train_batch=3, sample_batch=8),
    "small": dict(vocab_size=1024, hidden_size=128, num_layers=8, num_experts=64, top_k=8,
                  expert_size=64, num_seqs=48, prompt_len=(24, 64), response_len=(24, 56),
                  infer_batch=8, train_batch=6, sample_batch=48),
    "medium": dict(vocab_size=2048, hidden_size=256, num_layers=8, num_experts=64, top_k=8,
                   expert_size=128, num_seqs=64, prompt_len=(32, 96), response_len=(64, 128),
                   infer_batch=16, train_batch=12, sample_batch=64),
}


@dataclasses.dataclass
class DemoConfig:
    arch: str = "qwen3_moe"
    size: str = "small"
    device: str = "cpu"
    seed: int = 0
    out: str = "demo_out"
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 8
    num_experts: int = 64
    top_k: int = 8
    expert_size: int = 64
    num_seqs: int = 48
    prompt_len: tuple = (24, 64)
    response_len: tuple = (24, 56)
    infer_batch: int = 8
    train_batch: int = 6
    sample_batch: int = 48
    threads: int = 1  # intra-op threads on CPU (the matrices are small: one is fastest)
    initializer_range: float = 0.06
    temperature: float = 1.0
    learning_rate: float = 3e-3
    chart: bool = True
    progress: bool = True
    engine: str = "builtin"  # "builtin" (bf16 transformers), "vllm" or "sglang" (a real server)
    vllm_dtype: str = "bfloat16"  # the dtype the real engine runs the model in (vllm, sglang)
    inject: bool = False  # vllm: route injection (own routes, other routes, throughput)
    resume: bool = False  # vllm: resume under the next policy, without and with injection

    @classmethod
    def from_size(cls, size: str = "small", **overrides) -> "DemoConfig":
        if size not in SIZES:
            raise ValueError(f"demo: unknown size={size!r}; expected one of {sorted(SIZES)}")
        fields = dict(SIZES[size])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(size=size, **fields)
