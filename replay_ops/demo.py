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
  sampled response tokens twice: with native routing, and with R3 (the inference routing
  replayed through `replay_ops.integrations.hf`).

It reports, per MoE layer and overall, the fraction of (token, layer) routing decisions that
differ from the inference engine's, the fraction of tokens with at least one differing
layer, and the per-token log-prob gap (k3 KL estimate, mean and max |Δ logprob|).
An R2 round trip follows: the training engine records its routing to a record file in the
old-logprob pass, takes one optimizer step, and replays the file in the update pass.

Outputs (folder `--out`, default `demo_out/`): `summary.json`, `demo_chart.png`,
`r2_routing.safetensors`. Run with `python -m replay_ops demo` (`--help` for the flags).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time

import torch

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

    @classmethod
    def from_size(cls, size: str = "small", **overrides) -> "DemoConfig":
        if size not in SIZES:
            raise ValueError(f"demo: unknown size={size!r}; expected one of {sorted(SIZES)}")
        fields = dict(SIZES[size])
        fields.update({k: v for k, v in overrides.items() if v is not None})
        return cls(size=size, **fields)


# ----------------------------------------------------------------------------- helpers


def _progress(it, cfg: DemoConfig, desc: str, total: int | None = None):
    if not cfg.progress:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a declared dependency
        return it
    return tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


def _atomic_write(path: str, data: bytes) -> None:
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-" + os.path.basename(path))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a summary is for everyone
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i: i + size] for i in range(0, len(order), size)]


def _pad(seqs: list[torch.Tensor], side: str, pad_id: int, device):
    """[B, S] ids, [B, S] attention mask, [B, S] position ids, for `side` padding."""
    S = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), S), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for b, s in enumerate(seqs):
        if side == "left":
            ids[b, S - len(s):], mask[b, S - len(s):] = s, 1
        else:
            ids[b, : len(s)], mask[b, : len(s)] = s, 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def _token_slots(mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row of a [B, S] mask, the flat positions b*S + s of its real tokens, in order."""
    B, S = mask.shape
    return [b * S + mask[b].nonzero().flatten().cpu() for b in range(B)]


def _response_logprobs(logits: torch.Tensor, ids: torch.Tensor, slots, prompt_lens, seq_ids):
    """{seq: fp32 [response_len]} log p(token_t | tokens_<t) of every response token."""
    B, S, V = logits.shape
    flat_logits = logits.reshape(B * S, V)
    flat_ids = ids.reshape(B * S)
    out = {}
    for b, sid in enumerate(seq_ids):
        sl = slots[b].to(logits.device)
        P = prompt_lens[sid]
        tgt = sl[P:]  # response tokens
        src = sl[P - 1: -1]  # the positions that predict them
        lp = torch.log_softmax(flat_logits[src].float(), dim=-1)
        out[sid] = lp.gather(1, flat_ids[tgt][:, None]).squeeze(1).cpu()
    return out


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, L] bool: the expert *sets* of (token, layer) differ."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


# ----------------------------------------------------------------------------- the demo


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
    from .integrations import hf
    from .testing import tiny
    from .router_replay import ReplayAction, RouterReplayConfig

    t_start = time.perf_counter()
    timing = {}
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("demo: --device cuda was given but torch.cuda.is_available() is False")
    os.makedirs(cfg.out, exist_ok=True)
    torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ the model, twice
    model_kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                    num_layers=cfg.num_layers, num_experts=cfg.num_experts, top_k=cfg.top_k,
                    expert_size=cfg.expert_size, initializer_range=cfg.initializer_range)
    infer_model = tiny.tiny_model(cfg.arch, seed=cfg.seed, dtype=torch.bfloat16, **model_kw)
    train_model = tiny.tiny_model(cfg.arch, seed=cfg.seed, dtype=torch.float32, **model_kw)
    infer_model.to(device)
    train_model.to(device)
    n_params = sum(p.numel() for p in train_model.parameters())
    infer_patch = hf.patch_model(infer_model, RouterReplayConfig(mode="R3"))
    train_patch = hf.patch_model(train_model, RouterReplayConfig(mode="R3", recompute=False))
    lay = train_patch.layout
    L, K = len(lay.moe_layer_ids), lay.top_k
    pad_id = cfg.vocab_size - 1

    # ------------------------------------------------------------------ prompts
    g = torch.Generator().manual_seed(cfg.seed)
    prompt_lens, resp_lens, prompts = {}, {}, {}
    for i in range(cfg.num_seqs):
        lo, hi = cfg.prompt_len
        prompt_lens[i] = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lo, hi = cfg.response_len
        resp_lens[i] = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts[i] = torch.randint(0, cfg.vocab_size - 1, (prompt_lens[i],), generator=g)

    # ------------------------------------------------------------------ inference: sample
    t0 = time.perf_counter()
    seqs = {}
    infer_batches = _batches(list(range(cfg.num_seqs)), cfg.infer_batch)
    sample_batches = _batches(list(range(cfg.num_seqs)), cfg.sample_batch)
    with torch.no_grad():
        for bi, batch in enumerate(sample_batches):
            ids, mask, _ = _pad([prompts[i] for i in batch], "left", pad_id, device)
            new = max(resp_lens[i] for i in batch)
            gen = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + bi)
            cur_ids, cur_mask, outs = ids, mask, []
            past = None
            for step in _progress(range(new), cfg, f"inference: sampling {len(batch)} responses"):
                # a plain sampling loop with a KV cache, bf16
                pos = (cur_mask.cumsum(-1) - 1).clamp_min(0)
                step_in = cur_ids if past is None else cur_ids[:, -1:]
                step_pos = pos if past is None else pos[:, -1:]
                o = infer_model(input_ids=step_in, attention_mask=cur_mask, position_ids=step_pos,
                                past_key_values=past, use_cache=True)
                past = o.past_key_values
                probs = torch.softmax(o.logits[:, -1].float() / cfg.temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
                outs.append(nxt)
                cur_ids = torch.cat([cur_ids, nxt], dim=1)
                cur_mask = torch.cat([cur_mask, torch.ones_like(nxt)], dim=1)
            gen_ids = torch.cat(outs, dim=1).cpu()
            for b, i in enumerate(batch):
                seqs[i] = torch.cat([prompts[i], gen_ids[b, : resp_lens[i]]])
    timing["inference_sampling_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ inference: score + record
    t0 = time.perf_counter()
    infer_routing, infer_lp = {}, {}
    rr = infer_patch.replay
    with torch.no_grad():
        for batch in _progress(infer_batches, cfg, "inference: scoring + recording routing"):
            ids, mask, pos = _pad([seqs[i] for i in batch], "left", pad_id, device)
            rr.clear()
            rr.set_action(ReplayAction.RECORD)
            logits = infer_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            rec = rr.recorded()  # [B*S, L, K] int32, padding tokens included
            slots = _token_slots(mask)
            for b, i in enumerate(batch):
                infer_routing[i] = rec[slots[b].to(rec.device)].cpu().to(torch.int16)
            infer_lp.update(_response_logprobs(logits, ids, slots, prompt_lens, batch))
    rr.set_action(None)
    timing["inference_scoring_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ training: native vs R3
    order = sorted(range(cfg.num_seqs), key=lambda i: (-len(seqs[i]), i))
    train_batches = _batches(order, cfg.train_batch)
    train_routing = {"native": {}, "R3": {}}
    train_lp = {"native": {}, "R3": {}}
    rr = train_patch.replay
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in _progress(train_batches, cfg, "training: fp32 log-probs, native and R3"):
            ids, mask, pos = _pad([seqs[i] for i in batch], "right", pad_id, device)
            slots = _token_slots(mask)
            B, S = ids.shape
            # Native routing (RECORD runs the model's own top-k and keeps what it picked).
            rr.clear()
            rr.set_action(ReplayAction.RECORD)
            logits = train_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            used = rr.recorded()
            for b, i in enumerate(batch):
                train_routing["native"][i] = used[slots[b].to(used.device)].cpu()
            train_lp["native"].update(_response_logprobs(logits, ids, slots, prompt_lens, batch))
            # R3: the inference routing, moved into this layout; padding rows are not replayed.
            routing = torch.full((B * S, L, K), -1, dtype=torch.int16)
            replay_mask = torch.zeros(B * S, dtype=torch.bool)
            for b, i in enumerate(batch):
                routing[slots[b]] = infer_routing[i]
                replay_mask[slots[b]] = True
            rr.clear()
            rr.set_routing(routing.to(device), replay_mask.to(device))
            rr.set_action(ReplayAction.REPLAY_FORWARD)
            logits = train_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            rr.check_all_layers_routed(expected=1)  # no MoE layer bypassed the replay
            used = train_patch.last_routing()
            for b, i in enumerate(batch):
                train_routing["R3"][i] = used[slots[b].to(used.device)].cpu()
            train_lp["R3"].update(_response_logprobs(logits, ids, slots, prompt_lens, batch))
    rr.set_action(None)
    timing["training_passes_s"] = time.perf_counter() - t0

    # ------------------------------------------------------------------ metrics
    seq_order = list(range(cfg.num_seqs))
    ref_routing = torch.cat([infer_routing[i].to(torch.int32) for i in seq_order])
    ref_lp = torch.cat([infer_lp[i] for i in seq_order])
    results = {}
    for name in ("native", "R3"):
        r = torch.cat([train_routing[name][i].to(torch.int32) for i in seq_order])
        mm = _mismatch(r, ref_routing)  # [T, L]
        d = torch.cat([train_lp[name][i] for i in seq_order]) - ref_lp
        k3 = torch.expm1(d) - d  # r - 1 - log r with r = p_train / p_infer
        results[name] = {
            "routing_mismatch": float(mm.float().mean()),
            "routing_mismatch_per_layer": [float(x) for x in mm.float().mean(0)],
            "tokens_with_any_mismatch": float(mm.any(1).float().mean()),
            "kl_k3_mean": float(k3.double().mean()),
            "abs_dlogprob_mean": float(d.abs().double().mean()),
            "abs_dlogprob_max": float(d.abs().max()),
            "_abs_dlogprob": d.abs(),
        }

    # ------------------------------------------------------------------ R2 round trip
    t0 = time.perf_counter()
    r2 = _r2_round_trip(cfg, train_model, train_patch, seqs, prompt_lens, train_batches[0],
                        pad_id, device)
    timing["r2_round_trip_s"] = time.perf_counter() - t0

    n_tokens = int(ref_routing.shape[0])
    summary = {
        "config": {k: (list(v) if isinstance(v, tuple) else v)
                   for k, v in dataclasses.asdict(cfg).items()},
        "model": {
            "arch": cfg.arch, "parameters": n_params, "moe_layer_ids": lay.moe_layer_ids,
            "num_experts": lay.num_experts, "top_k": K, "score_func": lay.score_func,
            "normalize": lay.normalize,
        },
        "workload": {
            "sequences": cfg.num_seqs, "tokens": n_tokens,
            "response_tokens": int(ref_lp.numel()),
            "inference": f"bf16, sampled in batches of {cfg.sample_batch}, scored in batches "
                         f"of {cfg.infer_batch} in prompt order, left padding",
            "training": f"fp32, batches of {cfg.train_batch} sorted by length, right padding",
        },
        "no_replay": {k: v for k, v in results["native"].items() if not k.startswith("_")},
        "r3_replay": {k: v for k, v in results["R3"].items() if not k.startswith("_")},
        "r2_round_trip": r2,
        "backend": _backend_name(device),
        "versions": _versions(),
        "timing": {k: round(v, 2) for k, v in timing.items()},
    }
    kl0, kl1 = summary["no_replay"]["kl_k3_mean"], summary["r3_replay"]["kl_k3_mean"]
    summary["kl_reduction"] = (kl0 / kl1) if kl1 > 0 else math.inf
    infer_patch.remove()
    train_patch.remove()

    chart = os.path.join(cfg.out, "demo_chart.png")
    if cfg.chart:
        t0 = time.perf_counter()
        try:
            _chart(chart, summary, results, lay.moe_layer_ids)
            summary["chart"] = chart
        except ImportError as e:  # the numbers stand without the picture
            summary["chart"] = None
            summary["chart_skipped"] = f"matplotlib is not installed ({e})"
        timing["chart_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t_start
    summary["timing"] = {k: round(v, 2) for k, v in timing.items()}
    path = os.path.join(cfg.out, "summary.json")
    _atomic_write(path, (json.dumps(summary, indent=2) + "\n").encode())
    summary["summary_file"] = path
    return summary


def _r2_round_trip(cfg, model, patch, seqs, prompt_lens, batch, pad_id, device) -> dict:
    """Old-logprob pass records to a file; one optimizer step; the update pass replays the
    file. Native routing after the step drifts; the replayed routing does not."""
    from .integrations import hf
    from .router_replay import ReplayAction, RouterReplayConfig

    path = os.path.join(cfg.out, "r2_routing.safetensors")
    ids, mask, pos = _pad([seqs[i] for i in batch], "right", pad_id, device)
    slots = _token_slots(mask)
    sel = torch.cat(slots).to(device)
    patch.remove()
    record_cfg = RouterReplayConfig(mode="R2", record_file=path, recompute=False)
    with hf.patch_model(model, record_cfg) as p:
        p.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        old_lp = _response_logprobs(logits, ids, slots, prompt_lens, batch)
        recorded = p.replay.recorded()
        p.replay.save(model_name=f"demo-{cfg.arch}")
    file_bytes = os.path.getsize(path)

    replay_cfg = RouterReplayConfig(mode="R2", replay_file=path, recompute=False)
    with hf.patch_model(model, replay_cfg) as p:  # loads the file at construction
        rr = p.replay
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():  # replay before any update: bitwise the recorded pass
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        same_lp = _response_logprobs(logits, ids, slots, prompt_lens, batch)
        file_routing = p.last_routing()
        bitwise = all(torch.equal(same_lp[i], old_lp[i]) for i in batch)
        # One policy-gradient-like step on the response tokens (replayed routing).
        opt = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        lp = _response_logprobs(logits, ids, slots, prompt_lens, batch)
        loss = -torch.cat([lp[i] for i in batch]).mean()  # (.cpu() keeps the graph)
        snapshot = {n: q.detach().clone() for n, q in model.named_parameters()}
        opt.zero_grad()
        loss.backward()
        opt.step()
        rr.clear_queues()
        # Update pass, replayed from the file.
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        replayed_after = p.last_routing()
        # Update pass, native routing (what R2 prevents).
        rr.set_action(ReplayAction.RECORD)
        rr.clear_records()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        native_after = rr.recorded()
        source = rr.routing_source
    with torch.no_grad():  # restore the weights for anything that runs after
        for n, q in model.named_parameters():
            q.copy_(snapshot[n])
    mm_native = _mismatch(native_after[sel], recorded[sel])
    mm_replay = _mismatch(replayed_after[sel], recorded[sel])
    return {
        "record_file": path,
        "record_file_bytes": file_bytes,
        "routing_source": source,
        "tokens": int(sel.numel()),
        "file_routing_equals_recorded": bool(torch.equal(file_routing, recorded)),
        "replay_logprobs_bitwise_equal_before_update": bool(bitwise),
        "after_update_routing_mismatch_native": float(mm_native.float().mean()),
        "after_update_routing_mismatch_r2": float(mm_replay.float().mean()),
        "learning_rate": cfg.learning_rate,
    }


def _backend_name(device) -> str:
    try:
        from . import backends

        return backends()["active"][device.type]
    except Exception as e:  # pragma: no cover - report, do not fail the demo
        return f"unknown ({e})"


def _versions() -> dict:
    import transformers

    from . import __version__

    return {"replay_ops": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__}


# ----------------------------------------------------------------------------- output


def _chart(path: str, summary: dict, results: dict, layer_ids: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110)
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
    a.set_title("Training (fp32) vs inference (bf16) routing")
    a.legend()
    lo = 1e-6
    bins = torch.logspace(math.log10(lo), 0, 37).numpy()
    for name, label, color in (("native", "no replay", "#d95f02"), ("R3", "R3 replay", "#1b9e77")):
        d = results[name]["_abs_dlogprob"].clamp_min(lo).numpy()
        b.hist(d, bins=bins, histtype="step", linewidth=1.8, label=label, color=color)
    b.set_xscale("log")
    b.set_xlabel("|log p_train - log p_infer| per response token")
    b.set_ylabel("tokens")
    kl0, kl1 = summary["no_replay"]["kl_k3_mean"], summary["r3_replay"]["kl_k3_mean"]
    b.set_title(f"Log-prob gap (k3 KL: {kl0:.2e} -> {kl1:.2e})")
    b.legend()
    fig.suptitle(f"Router replay on a {summary['model']['arch']} model "
                 f"({summary['workload']['tokens']} tokens, {len(layer_ids)} MoE layers)")
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


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
    lines.append(f"  inference engine: {w['inference']}")
    lines.append(f"  training engine:  {w['training']}")
    lines.append(f"  {w['sequences']} sequences, {w['tokens']} tokens, "
                 f"{w['response_tokens']} sampled response tokens; backend: {s['backend']}")
    lines.append("")
    lines.append("Routing decisions that differ from the inference engine, per MoE layer")
    lines.append(f"  {'layer':>5} | {'no replay':>10} | {'R3 replay':>10}")
    lines.append(f"  {'-' * 5}-+-{'-' * 10}-+-{'-' * 10}")
    for lid, a, b in zip(m["moe_layer_ids"], n["routing_mismatch_per_layer"],
                         r["routing_mismatch_per_layer"]):
        lines.append(f"  {lid:>5} | {100 * a:>9.2f}% | {100 * b:>9.2f}%")
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
                 f"KL {s['kl_reduction']:.1f}x lower")
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
    lines.append(f"    native {100 * q['after_update_routing_mismatch_native']:.2f}%, "
                 f"R2 replay {100 * q['after_update_routing_mismatch_r2']:.2f}%")
    lines.append("")
    t = s["timing"]
    chart = f", {s['chart']}" if s.get("chart") else ""
    lines.append(f"wrote {s.get('summary_file', '')}{chart}  ({t.get('total_s', 0):.1f} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .testing.tiny import ARCHS

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
    p.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    a = p.parse_args(argv)
    cfg = DemoConfig.from_size(
        a.size, arch=a.arch, device=a.device, seed=a.seed, out=a.out, num_seqs=a.num_seqs,
        num_layers=a.layers, num_experts=a.experts, top_k=a.top_k, threads=a.threads,
    )
    cfg.chart = not a.no_chart
    cfg.progress = not a.no_progress
    print(f"replay_ops demo: size={cfg.size} arch={cfg.arch} device={cfg.device} "
          f"seed={cfg.seed} out={cfg.out}", flush=True)
    summary = run(cfg)
    print(format_report(summary), flush=True)
    ok = summary["r3_replay"]["routing_mismatch"] == 0 and summary["kl_reduction"] > 1
    return 0 if ok else 1
