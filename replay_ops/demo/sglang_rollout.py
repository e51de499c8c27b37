"""The demo with a real SGLang as the inference engine (`python -m replay_ops demo --engine
sglang`).

The same story as `--engine vllm` (`vllm_rollout`): the model (random weights, built locally
under the seed) is saved as a checkpoint; SGLang's HTTP server loads it (127.0.0.1 only) and
samples every response through batched `/generate` requests (one int
`routed_experts_start_len` per batch, as SGLang takes it), returning per request the sampled
tokens' log-probabilities and `routed_experts` (base64 int32) in `meta_info`. The SGLang
adapter (`sglang_batch`, with the requests that were sent) turns the payloads into the
training layout; the training engine (the same checkpoint in fp32 through transformers)
computes the response log-probs with the model's own routing and with SGLang's routing replayed (R3),
measured against SGLang's own sampled-token log-probs; the R2 round trip follows.
"""
from __future__ import annotations

import os
import time

import torch

from .config import DemoConfig
from .sglang_engine import SglangRuntime, SglangServer, find_sglang, sglang_version
from .vllm_rollout import build_checkpoint, sample_responses, train_and_compare


def routing_from_generations(gens: dict, moe):
    """The payloads through the SGLang adapter (packed THD), the start of each taken from the
    request that was sent: ({seq: int16 [n, L_moe, K]}, {seq: bool [n]}, the ReplayBatch)."""
    from ..router_replay.adapters import ModelShape, sglang_batch

    ids = sorted(gens)
    shape = ModelShape.of(moe)
    batch = sglang_batch([gens[i].meta_info for i in ids], [gens[i].seq_len for i in ids],
                         [len(gens[i].prompt_ids) for i in ids], shape,
                         requests=[_single(gens[i]) for i in ids],
                         num_layers=shape.num_hidden_layers, packing="thd")
    cu = batch.cu_seqlens.tolist()
    routing = {i: batch.indices[cu[j]:cu[j + 1]] for j, i in enumerate(ids)}
    mask = {i: batch.replay_mask[cu[j]:cu[j + 1]] for j, i in enumerate(ids)}
    return routing, mask, batch


def _single(g) -> dict:
    """The part of a (possibly batched) request body that concerns this request."""
    return {k: g.request[k] for k in ("return_routed_experts", "routed_experts_start_len")}


def run(cfg: DemoConfig, device: torch.device, timing: dict, *,
        runtime: SglangRuntime | None = None, log=print):
    """The inference side on SGLang, then the training passes; returns (engine, results, r2,
    facts about the engine run)."""
    t0 = time.perf_counter()
    runtime = runtime or find_sglang(install=True, log=log)
    timing["sglang_find_or_install_s"] = time.perf_counter() - t0
    model_dir = build_checkpoint(cfg, os.path.join(os.path.abspath(cfg.out), "sglang_model"),
                                 vllm=False)
    gens, seqs, infer_lp, prompt_lens, _ = sample_responses(
        cfg, "sglang", runtime, timing, log,
        lambda max_len, log_path: SglangServer(model_dir, runtime, dtype=cfg.vllm_dtype,
                                               context_length=max_len, log_path=log_path),
        lambda srv, prompts, lens, seeds: srv.generate_batch(
            prompts, lens, seeds=seeds, temperature=cfg.temperature, starts=0))
    eng, results, r2, batch = train_and_compare(
        cfg, device, timing, model_dir, seqs, prompt_lens, infer_lp,
        lambda moe: routing_from_generations(gens, moe))
    facts = {
        "engine": "sglang",
        "runtime": runtime.source,
        "version": sglang_version(runtime),
        "dtype": cfg.vllm_dtype,
        "requests": "requests in one batched /generate",
        "server": "HTTP server on 127.0.0.1, --enable-return-routed-experts"
                  + (", CPU engine (torch_native attention)" if runtime.cpu else ""),
        "routed_experts_dtype": gens[0].meta_info.get("routed_experts_dtype", "int32"),
        "routed_experts_layers": _layers(batch, eng.moe),
        "routed_rows": int(batch.replay_mask.sum()),
        "server_start_s": round(timing["sglang_server_start_s"], 1),
        "generation_s": round(timing["sglang_generation_s"], 1),
    }
    return eng, results, r2, facts


def _layers(batch, moe) -> int:
    """L of the payloads: every hidden layer ("absolute") or the MoE layers ("moe")."""
    from ..router_replay.adapters import ModelShape

    shape = ModelShape.of(moe)
    return shape.num_hidden_layers if batch.mappings[0] == "absolute" else shape.num_moe_layers
