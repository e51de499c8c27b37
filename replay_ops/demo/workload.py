"""The demo's workload: the two engines, the sampled responses, and the passes that record,
replay and compare routing. Every function is one stage of `replay_ops.demo.run`."""
from __future__ import annotations

import os
import sys

import torch

from .config import DemoConfig
from .metrics import mismatch


def progress(it, cfg: DemoConfig, desc: str, total: int | None = None):
    if not cfg.progress:
        return it
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a declared dependency
        return it
    return tqdm(it, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)


def batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i: i + size] for i in range(0, len(order), size)]


def pad(seqs: list[torch.Tensor], side: str, pad_id: int, device):
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


def token_slots(mask: torch.Tensor) -> list[torch.Tensor]:
    """Per row of a [B, S] mask, the flat positions b*S + s of its real tokens, in order."""
    B, S = mask.shape
    return [b * S + mask[b].nonzero().flatten().cpu() for b in range(B)]


def response_logprobs(logits: torch.Tensor, ids: torch.Tensor, slots, prompt_lens, seq_ids):
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




# ----------------------------------------------------------------------------- stages
class TrainingEngine:
    """The training engine: an fp32 model patched with a RouterReplay (R3, no recompute).
    Offers what `training_passes` and `r2_round_trip` use; the real engines' runs build it
    from the checkpoint the engine serves (`vllm_rollout.TrainingEngine`)."""

    def __init__(self, cfg: DemoConfig, train_model: torch.nn.Module) -> None:
        from ..integrations import hf
        from ..router_replay import RouterReplayConfig

        self.train_model = train_model
        self.num_params = sum(p.numel() for p in train_model.parameters())
        # agreement: the gate also reports, per MoE layer, how many replayed tokens' sets
        # are the training model's own choice (RouterReplay.agreement(), in the report)
        self.train_patch = hf.patch_model(train_model,
                                          RouterReplayConfig(mode="R3", recompute=False,
                                                             agreement=True))
        self.moe = self.train_patch.moe
        self.pad_id = cfg.vocab_size - 1

    def remove(self) -> None:
        self.train_patch.remove()


class Engines(TrainingEngine):
    """The same random-weight model twice: the inference engine (bf16, `infer_model`) and
    the training engine (fp32), each patched with its own RouterReplay (R3)."""

    def __init__(self, cfg: DemoConfig, device: torch.device) -> None:
        from ..integrations import hf
        from ..router_replay import RouterReplayConfig
        from ..testing import tiny

        kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_layers=cfg.num_layers, num_experts=cfg.num_experts, top_k=cfg.top_k,
                  expert_size=cfg.expert_size, initializer_range=cfg.initializer_range)
        self.infer_model = tiny.tiny_model(cfg.arch, seed=cfg.seed, dtype=torch.bfloat16,
                                           **kw).to(device)
        self.infer_patch = hf.patch_model(self.infer_model, RouterReplayConfig(mode="R3"))
        super().__init__(cfg, tiny.tiny_model(cfg.arch, seed=cfg.seed, dtype=torch.float32,
                                              **kw).to(device))

    def remove(self) -> None:
        self.infer_patch.remove()
        super().remove()


def make_prompts(cfg: DemoConfig):
    """({seq: prompt_len}, {seq: response_len}, {seq: prompt ids}), drawn under the seed."""
    g = torch.Generator().manual_seed(cfg.seed)
    prompt_lens, resp_lens, prompts = {}, {}, {}
    for i in range(cfg.num_seqs):
        lo, hi = cfg.prompt_len
        prompt_lens[i] = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lo, hi = cfg.response_len
        resp_lens[i] = int(torch.randint(lo, hi + 1, (1,), generator=g))
        prompts[i] = torch.randint(0, cfg.vocab_size - 1, (prompt_lens[i],), generator=g)
    return prompt_lens, resp_lens, prompts


def sample_responses(cfg, eng: Engines, prompts, resp_lens, device) -> dict:
    """{seq: prompt + sampled response}: a plain sampling loop with a KV cache, in bf16."""
    seqs = {}
    with torch.no_grad():
        for bi, batch in enumerate(batches(list(range(cfg.num_seqs)), cfg.sample_batch)):
            ids, mask, _ = pad([prompts[i] for i in batch], "left", eng.pad_id, device)
            new = max(resp_lens[i] for i in batch)
            gen = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + bi)
            cur_ids, cur_mask, outs, past = ids, mask, [], None
            for _ in progress(range(new), cfg, f"inference: sampling {len(batch)} responses"):
                pos = (cur_mask.cumsum(-1) - 1).clamp_min(0)
                step_in = cur_ids if past is None else cur_ids[:, -1:]
                step_pos = pos if past is None else pos[:, -1:]
                o = eng.infer_model(input_ids=step_in, attention_mask=cur_mask,
                                    position_ids=step_pos, past_key_values=past, use_cache=True)
                past = o.past_key_values
                probs = torch.softmax(o.logits[:, -1].float() / cfg.temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen)
                outs.append(nxt)
                cur_ids = torch.cat([cur_ids, nxt], dim=1)
                cur_mask = torch.cat([cur_mask, torch.ones_like(nxt)], dim=1)
            gen_ids = torch.cat(outs, dim=1).cpu()
            for b, i in enumerate(batch):
                seqs[i] = torch.cat([prompts[i], gen_ids[b, : resp_lens[i]]])
    return seqs


def score_inference(cfg, eng: Engines, seqs, prompt_lens, device):
    """The inference engine's prefill passes (left padding, prompt order): ({seq: routing
    [n, L, K] int16}, {seq: response log-probs}), the routing what vLLM/SGLang return."""
    from ..router_replay import ReplayAction

    routing, logprobs = {}, {}
    rr = eng.infer_patch.replay
    with torch.no_grad():
        for batch in progress(batches(list(range(cfg.num_seqs)), cfg.infer_batch), cfg,
                              "inference: scoring + recording routing"):
            ids, mask, pos = pad([seqs[i] for i in batch], "left", eng.pad_id, device)
            rr.clear()
            rr.set_action(ReplayAction.RECORD)
            logits = eng.infer_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            rec = rr.recorded()  # [B*S, L, K] int32, padding tokens included
            slots = token_slots(mask)
            for b, i in enumerate(batch):
                routing[i] = rec[slots[b].to(rec.device)].cpu().to(torch.int16)
            logprobs.update(response_logprobs(logits, ids, slots, prompt_lens, batch))
    rr.set_action(None)
    return routing, logprobs


def training_passes(cfg, eng: Engines, seqs, prompt_lens, infer_routing, train_batches, device,
                    infer_mask=None):
    """The training engine's passes (right padding, batches sorted by length), each batch
    twice: the model's own routing, and R3 (the inference routing replayed). `infer_mask` ({seq:
    bool [n]}, default all True): the rows that have inference routing (a rollout engine
    has none for a sequence's final token); other rows keep the model's own top-k. Returns
    ({"own"|"R3": {seq: routing used}}, {"own"|"R3": {seq: response log-probs}})."""
    from ..router_replay import ReplayAction

    L, K = len(eng.moe.moe_layer_ids), eng.moe.top_k
    routing = {"own": {}, "R3": {}}
    logprobs = {"own": {}, "R3": {}}
    rr = eng.train_patch.replay
    with torch.no_grad():
        for batch in progress(train_batches, cfg, "training: fp32 log-probs, own routing and R3"):
            ids, mask, pos = pad([seqs[i] for i in batch], "right", eng.pad_id, device)
            slots = token_slots(mask)
            B, S = ids.shape
            # The model's own routing (RECORD runs its own top-k and keeps what it picked).
            rr.clear()
            rr.set_action(ReplayAction.RECORD)
            logits = eng.train_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            used = rr.recorded()
            for b, i in enumerate(batch):
                routing["own"][i] = used[slots[b].to(used.device)].cpu()
            logprobs["own"].update(response_logprobs(logits, ids, slots, prompt_lens, batch))
            # R3: the inference routing, moved into this layout; padding rows are not replayed.
            r3 = torch.full((B * S, L, K), -1, dtype=torch.int16)
            replay_mask = torch.zeros(B * S, dtype=torch.bool)
            for b, i in enumerate(batch):
                r3[slots[b]] = infer_routing[i]
                replay_mask[slots[b]] = True if infer_mask is None else infer_mask[i]
            rr.clear()
            rr.set_routing(r3.to(device), replay_mask.to(device))
            rr.set_action(ReplayAction.REPLAY_FORWARD)
            logits = eng.train_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            rr.check_all_layers_routed(expected=1)  # no MoE layer bypassed the replay
            used = eng.train_patch.last_routing()
            for b, i in enumerate(batch):
                routing["R3"][i] = used[slots[b].to(used.device)].cpu()
            logprobs["R3"].update(response_logprobs(logits, ids, slots, prompt_lens, batch))
    rr.set_action(None)
    return routing, logprobs


def r2_round_trip(cfg, model, patch, seqs, prompt_lens, batch, pad_id, device) -> dict:
    """Old-logprob pass records to a file; one optimizer step; the update pass replays the
    file. The model's own routing after the step drifts; the replayed routing does not."""
    from ..integrations import hf
    from ..router_replay import ReplayAction, RouterReplayConfig

    path = os.path.join(cfg.out, "r2_routing.safetensors")
    ids, mask, pos = pad([seqs[i] for i in batch], "right", pad_id, device)
    slots = token_slots(mask)
    sel = torch.cat(slots).to(device)
    patch.remove()
    record_cfg = RouterReplayConfig(mode="R2", record_file=path, recompute=False)
    with hf.patch_model(model, record_cfg) as p:
        p.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        old_lp = response_logprobs(logits, ids, slots, prompt_lens, batch)
        recorded = p.replay.recorded()
        p.replay.save(model_name=f"demo-{cfg.arch}")
    file_bytes = os.path.getsize(path)

    replay_cfg = RouterReplayConfig(mode="R2", replay_file=path, recompute=False)
    with hf.patch_model(model, replay_cfg) as p:  # loads the file at construction
        rr = p.replay
        rr.set_action(ReplayAction.REPLAY_FORWARD)
        with torch.no_grad():  # replay before any update: bitwise the recorded pass
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        same_lp = response_logprobs(logits, ids, slots, prompt_lens, batch)
        file_routing = p.last_routing()
        bitwise = all(torch.equal(same_lp[i], old_lp[i]) for i in batch)
        # One policy-gradient-like step on the response tokens (replayed routing).
        opt = torch.optim.SGD(model.parameters(), lr=cfg.learning_rate)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        lp = response_logprobs(logits, ids, slots, prompt_lens, batch)
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
        source = rr.routing_source  # (the RECORD below starts a new step and drops it)
        # Update pass, the model's own routing (what R2 prevents).
        rr.set_action(ReplayAction.RECORD)
        rr.clear_records()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=pos)
        own_after = rr.recorded()
    with torch.no_grad():  # restore the weights for anything that runs after
        for n, q in model.named_parameters():
            q.copy_(snapshot[n])
    mm_own = mismatch(own_after[sel], recorded[sel])
    mm_replay = mismatch(replayed_after[sel], recorded[sel])
    return {
        "record_file": path,
        "record_file_bytes": file_bytes,
        "routing_source": source,
        "tokens": int(sel.numel()),
        "file_routing_equals_recorded": bool(torch.equal(file_routing, recorded)),
        "replay_logprobs_bitwise_equal_before_update": bool(bitwise),
        "after_update_routing_mismatch_own": float(mm_own.float().mean()),
        "after_update_routing_mismatch_r2": float(mm_replay.float().mean()),
        "learning_rate": cfg.learning_rate,
    }


