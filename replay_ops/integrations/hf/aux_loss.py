"""The auxiliary load-balancing loss of a patched model counts the routing that was used.

transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE; DeepSeek-V3 has no such
loss there) compute, with `output_router_logits=True`,

    aux_loss = load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)
    loss = loss + router_aux_loss_coef * aux_loss          # when labels are given

the Switch Transformer loss `E * sum_e f_e * P_e` over every MoE layer's rows: `f_e`, the
share of the top-k slots sent to expert e, and `P_e`, the mean router probability of e
(softmax of the router logits). transformers takes `f` from a top-k of the logits again.
Under replay the tokens are sent to the replayed experts, not to that top-k, so a patched
model counts the routing each MoE layer actually used (after fallback rows, in RECORD the
model's own choice), as Megatron-Core's router computes its auxiliary loss from the routing
map after replay. `P` is the router's softmax as in transformers (the loss reaches the
router's weights through it alone, since the counts have no gradient), and the
attention mask weighs rows as there.

How: the patched block marks the router logits it routed (`mark_routed`: the tensor the
router returned, which transformers' `router_logits` output collects, carries the layer's
`[T, K]` expert indices), and while a model of that architecture is patched, the
architecture's module-level `load_balancing_loss_func` is wrapped (`acquire` / `release`,
counted per module): a layer whose logits carry indices is counted from them
(`load_balancing_loss`), the others exactly as transformers does; with no marked layer the
original function runs. A model that is not patched never has marked logits, so the
wrapper changes nothing for it. Empty slots (-1, a row with fewer routed experts) count for
no expert, as they send the token nowhere.
"""
from __future__ import annotations

import functools
import sys
from typing import Sequence

import torch

__all__ = ["ATTR", "acquire", "load_balancing_loss", "mark_routed", "release", "routed_of"]

ATTR = "_replay_ops_routed"  # the attribute of a router logits tensor holding its indices
FUNCTION = "load_balancing_loss_func"  # the name transformers' modeling modules use


def mark_routed(router_logits: torch.Tensor, indices: torch.Tensor) -> None:
    """Record on `router_logits` (the tensor the router module returned) the expert indices
    `[T, K]` its layer was routed with."""
    setattr(router_logits, ATTR, indices)


def routed_of(router_logits: torch.Tensor) -> torch.Tensor | None:
    return getattr(router_logits, ATTR, None)


def load_balancing_loss(gate_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' `load_balancing_loss_func` (transformers 5.x) with each layer's
    selection taken from its marked indices (`mark_routed`), or, for an unmarked layer,
    from `topk(softmax(logits), top_k)` as there. Same reductions, in the same order."""
    device = gate_logits[0].device
    tokens_per_expert_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    router_prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    total_rows = 0.0
    flat_mask = None
    if attention_mask is not None:
        flat_mask = attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        routing_weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        selected = routed_of(layer_gate)
        if selected is None:
            selected = torch.topk(routing_weights, top_k, dim=-1)[1]
        selected = selected.to(device)
        # one row of E counts per slot: 1 at the expert, none for an empty slot (-1)
        valid = selected >= 0
        one_hot = torch.nn.functional.one_hot(selected.clamp_min(0).long(), num_experts)
        one_hot = one_hot.to(torch.float32) * valid.unsqueeze(-1)
        if flat_mask is None:
            tokens_per_expert_sum = tokens_per_expert_sum + one_hot.sum(dim=(0, 1))
            router_prob_sum = router_prob_sum + routing_weights.float().sum(dim=0)
            total_rows = total_rows + routing_weights.shape[0]
        else:
            tokens_per_expert_sum = tokens_per_expert_sum + (
                one_hot * flat_mask[:, None, None]).sum(dim=(0, 1))
            router_prob_sum = router_prob_sum + (
                routing_weights.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            total_rows = total_rows + flat_mask.sum()
    tokens_per_expert = tokens_per_expert_sum / total_rows
    router_prob_per_expert = router_prob_sum / total_rows
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def _wrap(original):
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None,
                                 *args, **kwargs):
        if (not args and not kwargs and isinstance(gate_logits, tuple) and gate_logits
                and num_experts is not None
                and any(routed_of(g) is not None for g in gate_logits)):
            return load_balancing_loss(gate_logits, num_experts, top_k, attention_mask)
        return original(gate_logits, num_experts, top_k, attention_mask, *args, **kwargs)

    load_balancing_loss_func._replay_ops_original = original
    return load_balancing_loss_func


# module name -> [the original function, the wrapper installed, patches holding it]
_INSTALLED: dict[str, list] = {}


def acquire(module_name: str) -> bool:
    """Wrap `module_name`'s `load_balancing_loss_func` (once; counted). False when the
    module has none (the architecture computes no such loss)."""
    mod = sys.modules.get(module_name)
    original = getattr(mod, FUNCTION, None) if mod is not None else None
    if original is None:
        return False
    entry = _INSTALLED.get(module_name)
    if entry is None:
        entry = _INSTALLED[module_name] = [original, _wrap(original), 0]
        setattr(mod, FUNCTION, entry[1])
    entry[2] += 1
    return True


def release(module_name: str) -> None:
    """Undo one `acquire`; the last one puts the original function back (unless something
    replaced the wrapper since, which is then left as it is)."""
    entry = _INSTALLED.get(module_name)
    if entry is None:
        return
    entry[2] -= 1
    if entry[2] <= 0:
        del _INSTALLED[module_name]
        mod = sys.modules.get(module_name)
        if mod is not None and getattr(mod, FUNCTION, None) is entry[1]:
            setattr(mod, FUNCTION, entry[0])
