"""The demo's metrics: how much routing and log-probabilities of the training engine differ
from the inference engine's."""
from __future__ import annotations

import torch


def mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, L] bool: the expert *sets* of (token, layer) differ."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1)


def compare(train_routing: dict, train_lp: dict, infer_routing: dict, infer_lp: dict,
            seq_order: list[int], infer_mask: dict | None = None) -> dict:
    """Per training mode ("own", "R3"): the fraction of (token, layer) routing decisions
    that differ from the inference engine's (overall and per MoE layer), the fraction of
    tokens with at least one differing layer, and the per-token log-prob gap (the k3 KL
    estimate, mean and max |delta logprob|). `_abs_dlogprob` keeps the gaps for the chart.
    `infer_mask` ({seq: bool [n]}): only the rows the inference engine routed are compared."""
    def rows(d: dict, i: int) -> torch.Tensor:
        r = d[i].to(torch.int32)
        return r if infer_mask is None else r[infer_mask[i].to(r.device)]

    ref_routing = torch.cat([rows(infer_routing, i) for i in seq_order])
    ref_lp = torch.cat([infer_lp[i] for i in seq_order])
    results = {}
    for name in train_routing:
        r = torch.cat([rows(train_routing[name], i) for i in seq_order])
        mm = mismatch(r, ref_routing)  # [T, L]
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
    results["_tokens"] = int(ref_routing.shape[0])
    results["_response_tokens"] = int(ref_lp.numel())
    return results
