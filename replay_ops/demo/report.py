"""The demo's outputs: the summary, the text report and the chart."""
from __future__ import annotations

import dataclasses
import math

import torch

from .._atomic import atomic_target


def summary(cfg, eng, results: dict, r2: dict, device, timing: dict,
            engine: dict | None = None) -> dict:
    """The summary of a run (written to summary.json). `engine`: facts about a real
    inference engine's run (`--engine vllm` or `--engine sglang`)."""
    lay = eng.moe
    if engine is None:
        inference = (f"bf16, sampled in batches of {cfg.sample_batch}, scored in batches "
                     f"of {cfg.infer_batch} in prompt order, left padding")
    else:
        version = engine.get("version") or engine.get("vllm_version")
        inference = (f"{version} ({engine['dtype']}), {cfg.num_seqs} "
                     f"{engine.get('requests', 'concurrent requests')} to its {engine['server']}"
                     f"; routed_experts "
                     f"{engine['routed_experts_dtype']} [rows, L={engine['routed_experts_layers']}"
                     f", K]")
    s = {
        "config": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(cfg).items()},
        "model": {
            "arch": cfg.arch, "parameters": eng.num_params, "moe_layer_ids": lay.moe_layer_ids,
            "num_experts": lay.num_experts, "top_k": lay.top_k, "score_func": lay.score_func,
            "normalize": lay.normalize,
        },
        "workload": {
            "sequences": cfg.num_seqs, "tokens": results["_tokens"],
            "response_tokens": results["_response_tokens"],
            "inference": inference,
            "training": f"fp32, batches of {cfg.train_batch} sorted by length, right padding",
        },
        "no_replay": {k: v for k, v in results["own"].items() if not k.startswith("_")},
        "r3_replay": {k: v for k, v in results["R3"].items() if not k.startswith("_")},
        "r2_round_trip": r2,
        "backend": backend_name(device),
        "versions": versions(),
        "timing": {k: round(v, 2) for k, v in timing.items()},
    }
    # per MoE layer: the fraction of replayed tokens whose replayed set (the inference
    # engine's) is the set the training model's own selection picks from its logits under
    # R3 (the gate's plan.agreement, counted by RouterReplay over every R3 pass)
    agree = _agreement(eng)
    if agree is not None:
        s["r3_replay"]["agreement_per_layer"] = [agree.get(lid) for lid in lay.moe_layer_ids]
    if engine is not None:
        s["engine"] = engine
    kl0, kl1 = s["no_replay"]["kl_k3_mean"], s["r3_replay"]["kl_k3_mean"]
    s["kl_reduction"] = (kl0 / kl1) if kl1 > 0 else math.inf
    return s


def _agreement(eng) -> dict | None:
    """The training engine's RouterReplay.agreement() ({layer id: fraction}), or None when
    it did not count it."""
    replay = getattr(getattr(eng, "train_patch", None), "replay", None)
    if replay is None or not getattr(replay.config, "agreement", False):
        return None
    return replay.agreement()


def engine_label(summary: dict) -> str:
    """The real inference engine's name in the report ("vLLM", "SGLang")."""
    return {"vllm": "vLLM", "sglang": "SGLang"}.get(summary["engine"].get("engine"), "vLLM")


def backend_name(device) -> str:
    try:
        from .. import backends

        return backends()["active"][device.type]
    except Exception as e:  # pragma: no cover - report, do not fail the demo
        return f"unknown ({e})"


def versions() -> dict:
    import transformers

    from .. import __version__

    return {"replay_ops": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


def chart(path: str, summary: dict, results: dict, layer_ids: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    resume = summary.get("resume")
    if resume is None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
    else:
        fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.2), dpi=110)
    x = torch.arange(len(layer_ids)).numpy()
    w = 0.38
    nat = [100 * v for v in summary["no_replay"]["routing_mismatch_per_layer"]]
    r3 = [100 * v for v in summary["r3_replay"]["routing_mismatch_per_layer"]]
    a.bar(x - w / 2, nat, w, label="no replay", color="#d95f02")
    a.bar(x + w / 2, r3, w, label="R3 replay", color="#1b9e77")
    for xi, v in zip(x, r3):
        a.text(xi + w / 2, v, "0" if v == 0 else f"{v:.1f}", ha="center", va="bottom",
               fontsize=8, color="#1b9e77")
    a.set_xticks(x, [str(i) for i in layer_ids])
    a.set_xlabel("MoE layer")
    a.set_ylabel("routing decisions that differ (%)")
    eng = (f"{engine_label(summary)} {summary['engine']['dtype']}" if "engine" in summary
           else "bf16")
    a.set_title(f"Training (fp32) vs inference ({eng}) routing")
    a.legend()
    lo = 1e-6
    bins = torch.logspace(math.log10(lo), 0, 37).numpy()
    for name, label, color in (("own", "no replay", "#d95f02"), ("R3", "R3 replay", "#1b9e77")):
        d = results[name]["_abs_dlogprob"].clamp_min(lo).numpy()
        b.hist(d, bins=bins, histtype="step", linewidth=1.8, label=label, color=color)
    b.set_xscale("log")
    b.set_xlabel("|log p_train - log p_infer| per response token")
    b.set_ylabel("tokens")
    kl0, kl1 = summary["no_replay"]["kl_k3_mean"], summary["r3_replay"]["kl_k3_mean"]
    b.set_title(f"Log-prob gap (k3 KL: {kl0:.2e} -> {kl1:.2e})")
    b.legend()
    if resume is not None:
        wo = [100 * v for v in resume["without_injection"]["prefix_routes_differ_per_layer"]]
        wi = [100 * v for v in resume["with_injection"]["prefix_routes_differ_per_layer"]]
        c.bar(x - w / 2, wo, w, label="resumed without injection", color="#d95f02")
        c.bar(x + w / 2, wi, w, label="resumed with injection", color="#1b9e77")
        for xi, v in zip(x, wi):
            c.text(xi + w / 2, v, "0" if v == 0 else f"{v:.1f}", ha="center", va="bottom",
                   fontsize=8, color="#1b9e77")
        c.set_xticks(x, [str(i) for i in layer_ids])
        c.set_xlabel("MoE layer")
        c.set_ylabel("prefix routes that differ (%)")
        c.set_title(f"Resumed under v1: prefix routes vs the v0 routes\nthat generated them "
                    f"({resume['prefix_rows']} prefix tokens)")
        c.legend()
    fig.suptitle(f"Router replay on a {summary['model']['arch']} model "
                 f"({summary['workload']['tokens']} tokens, {len(layer_ids)} MoE layers)")
    fig.tight_layout()
    with atomic_target(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def format_report(s: dict) -> str:
    """The human-readable table of a summary."""
    n, r = s["no_replay"], s["r3_replay"]
    lines = []
    m, w = s["model"], s["workload"]
    lines.append(
        f"replay_ops demo: {m['arch']} with random weights ({m['parameters']:,} parameters, "
        f"{len(m['moe_layer_ids'])} MoE layers, {m['num_experts']} experts, top-{m['top_k']}, "
        f"{m['score_func']})"
    )
    real = "engine" in s
    lines.append(f"  inference engine: {w['inference']}")
    lines.append(f"  training engine:  {w['training']}")
    lines.append(f"  {w['sequences']} sequences, {w['tokens']} "
                 f"{'routed tokens (the final token of each has no route)' if real else 'tokens'}"
                 f", {w['response_tokens']} sampled response tokens; backend: {s['backend']}")
    if real:
        e = s["engine"]
        lines.append(f"  {engine_label(s)} server started in {e['server_start_s']} s, generated in "
                     f"{e['generation_s']} s ({e['runtime']})")
    lines.append("")
    lines.append("Routing decisions that differ from the inference engine"
                 f"{f' ({engine_label(s)})' if real else ''}, per MoE layer")
    agree = r.get("agreement_per_layer")
    extra = f" | {'R3 agreement':>12}" if agree is not None else ""
    lines.append(f"  {'layer':>5} | {'no replay':>10} | {'R3 replay':>10}{extra}")
    lines.append(f"  {'-' * 5}-+-{'-' * 10}-+-{'-' * 10}"
                 + (f"-+-{'-' * 12}" if agree is not None else ""))
    for j, (lid, a, b) in enumerate(zip(m["moe_layer_ids"], n["routing_mismatch_per_layer"],
                                        r["routing_mismatch_per_layer"])):
        cell = ""
        if agree is not None:
            v = agree[j]
            cell = f" | {'-':>12}" if v is None else f" | {100 * v:>11.2f}%"
        lines.append(f"  {lid:>5} | {100 * a:>9.2f}% | {100 * b:>9.2f}%{cell}")
    if agree is not None:
        lines.append("  R3 agreement: replayed tokens whose replayed expert set is the training "
                     "model's own choice from its logits (the gate's plan.agreement)")
    lines.append("")
    lines.append(f"  {'overall':<44} | {'no replay':>10} | {'R3 replay':>10}")
    lines.append(f"  {'-' * 44}-+-{'-' * 10}-+-{'-' * 10}")
    rows = [
        ("(token, layer) routing decisions that differ", "routing_mismatch", "pct"),
        ("tokens with >= 1 differing layer", "tokens_with_any_mismatch", "pct"),
        ("KL(infer || train), k3 estimate per token", "kl_k3_mean", "sci"),
        ("mean |delta logprob| per token", "abs_dlogprob_mean", "sci"),
        ("max |delta logprob|", "abs_dlogprob_max", "sci"),
    ]
    for label, key, kind in rows:
        fa = f"{100 * n[key]:.2f}%" if kind == "pct" else f"{n[key]:.3e}"
        fb = f"{100 * r[key]:.2f}%" if kind == "pct" else f"{r[key]:.3e}"
        lines.append(f"  {label:<44} | {fa:>10} | {fb:>10}")
    lines.append("")
    lines.append(f"R3 replay: routing difference {100 * r['routing_mismatch']:.2f}% "
                 f"(exactly {'zero' if r['routing_mismatch'] == 0 else 'NOT zero'}); "
                 f"KL {s['kl_reduction']:.1f}x lower"
                 + ("; without replay the engines already routed alike"
                    if n["routing_mismatch"] == 0 else ""))
    q = s["r2_round_trip"]
    lines.append("")
    lines.append(f"R2 round trip ({q['tokens']} tokens, record file {q['record_file']}, "
                 f"{q['record_file_bytes']:,} bytes)")
    lines.append(f"  file routing equals the recorded routing:        "
                 f"{q['file_routing_equals_recorded']}")
    lines.append(f"  replayed log-probs bitwise equal before update:  "
                 f"{q['replay_logprobs_bitwise_equal_before_update']}")
    lines.append(f"  after one optimizer step (lr={q['learning_rate']}), routing that differs "
                 f"from the record:")
    lines.append(f"    own routing {100 * q['after_update_routing_mismatch_own']:.2f}%, "
                 f"R2 replay {100 * q['after_update_routing_mismatch_r2']:.2f}%")
    if "injection" in s:
        lines += [""] + injection_lines(s)
    if "resume" in s:
        lines += [""] + resume_lines(s)
    lines.append("")
    t = s["timing"]
    chart = f", {s['chart']}" if s.get("chart") else ""
    lines.append(f"wrote {s.get('summary_file', '')}{chart}  ({t.get('total_s', 0):.1f} s)")
    return "\n".join(lines)


def injection_lines(s: dict) -> list[str]:
    """The report's lines on route injection (`--inject`)."""
    i = s["injection"]
    o, a, t = i["own_routes"], i["other_routes"], i["throughput"]
    p, q, re = i["r3_plain"], i["r3_other_routes"], i["batch_rerun_without_routes"]
    n, m = i["requests"], o["requests"]
    return [
        f"Route injection (replay_ops' vLLM plugin, REPLAY_OPS_VLLM_INJECT=1; {n} requests)",
        f"  own routes injected at every position ({m} requests, each alone): tokens equal "
        f"{o['tokens_equal']}/{m}, log-probs equal {o['logprobs_equal']}/{m} (max |delta| "
        f"{o['max_abs_dlogprob']:.3e}), routes equal {o['routes_equal']}/{m}",
        f"    (the whole batch re-run without routes: tokens equal {re['tokens_equal']}/{n}, "
        f"log-probs equal {re['logprobs_equal']}/{n}: concurrent requests are batched "
        f"differently from run to run)",
        f"  10% of rows routed elsewhere ({a['rows_changed']} of {a['rows']} rows): returned "
        f"routes equal the injected ones at all {a['positions_checked']} positions",
        f"  training engine replaying them (R3): k3 KL {q['kl_k3_mean']:.3e}, max |delta "
        f"logprob| {q['abs_dlogprob_max']:.3e} (plain requests: {p['kl_k3_mean']:.3e}, "
        f"{p['abs_dlogprob_max']:.3e})",
        f"  throughput, the same batch ({t['tokens']} tokens, median of {t['runs']} runs each, "
        f"alternating): injection off {t['off_tok_s']} tok/s, on {t['on_tok_s']} tok/s "
        f"({t['overhead_pct']:+.1f}% time)",
    ]


def resume_lines(s: dict) -> list[str]:
    """The report's lines on resuming under the next policy (`--resume`)."""
    r = s["resume"]
    wo, wi = r["without_injection"], r["with_injection"]
    lines = [
        f"Resume after a weight update ({r['resumed_requests']} responses: first half by v0, "
        f"second half by v1 after one SGD step, lr={r['learning_rate']})",
        "  prefix routes that differ from the routes that generated those tokens, per MoE "
        "layer",
        f"  {'layer':>5} | {'without':>10} | {'with':>10}",
        f"  {'-' * 5}-+-{'-' * 10}-+-{'-' * 10}",
    ]
    for lid, a, b in zip(s["model"]["moe_layer_ids"], wo["prefix_routes_differ_per_layer"],
                         wi["prefix_routes_differ_per_layer"]):
        lines.append(f"  {lid:>5} | {100 * a:>9.2f}% | {100 * b:>9.2f}%")
    lines.append(f"  {'all':>5} | {100 * wo['prefix_routes_differ']:>9.2f}% | "
                 f"{100 * wi['prefix_routes_differ']:>9.2f}%")
    for name, d in (("without injection", wo), ("with injection", wi)):
        tr = d["training_r3"]
        lines.append(f"  training (v1, R3 over the returned routes), {name}: "
                     f"{100 * tr['prefix_routes_replayed_differ']:.2f}% of the prefix's "
                     f"replayed routes differ from the generating ones; resumed tokens' k3 KL "
                     f"{tr['resumed_tokens_kl_k3_mean']:.3e}")
    return lines
