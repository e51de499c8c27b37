"""End to end: a small MoE layer (router linear + E expert MLPs, top-K). Its plain forward
uses ordinary PyTorch only (softmax/sigmoid, torch.topk, per-expert masks, index_add).
Replaying the indices that top-k chose through replay_ops.gate/permute/unpermute must
reproduce that forward's output and the gradients of the router, the experts and the input.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import replay_ops

from _helpers import case_params


class TinyMoE(torch.nn.Module):
    def __init__(self, H, Fh, E, K, dtype, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        def r(*s, scale):
            return torch.nn.Parameter((torch.randn(*s, generator=g) * scale).to(dtype))

        self.E, self.K = E, K
        self.router = r(H, E, scale=1.0 / H**0.5)
        self.w1 = r(E, H, Fh, scale=1.0 / H**0.5)
        self.b1 = r(E, Fh, scale=0.5)  # a bias: padding rows become nonzero after the MLP
        self.w2 = r(E, Fh, H, scale=1.0 / Fh**0.5)

    def expert(self, e, x):
        return F.gelu(x @ self.w1[e] + self.b1[e]) @ self.w2[e]

    def plain_forward(self, x, score_func, normalize, scaling):
        """Ordinary top-k MoE, no replay_ops."""
        logits = x @ self.router
        xs = logits.double() if logits.dtype == torch.float64 else logits.float()
        if score_func == "softmax":
            scores = torch.softmax(xs, dim=-1)
        elif score_func == "sigmoid":
            scores = torch.sigmoid(xs)
        else:
            scores = F.softplus(xs).sqrt()
        topv, topi = torch.topk(scores, self.K, dim=-1)
        if normalize and (score_func == "softmax" or self.K > 1):
            topv = topv / (topv.sum(-1, keepdim=True) + (0.0 if score_func == "softmax" else 1e-20))
        w = (topv * scaling).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, k = (topi == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, w[tok, k, None] * self.expert(e, x[tok]))
        return out, topi

    def replay_forward(self, x, topi, score_func, normalize, scaling, align, backend):
        logits = x @ self.router
        plan = replay_ops.gate(logits, topi, score_func=score_func, normalize=normalize,
                               scaling_factor=scaling, align=align, backend=backend)
        xp = replay_ops.permute(x, plan, backend=backend)
        offs = plan.expert_offsets.tolist()
        y = torch.cat([self.expert(e, xp[offs[e]:offs[e + 1]]) for e in range(self.E)])
        return replay_ops.unpermute(y, plan, backend=backend), plan


CASES = [
    # (score_func, normalize, scaling, align, dtype)
    ("softmax", True, 1.0, 1, torch.float32),  # Mixtral / Qwen3-MoE
    ("softmax", False, 1.0, 16, torch.float32),  # pre-softmax, Qwen1.5-MoE / OLMoE
    ("sigmoid", True, 2.5, 16, torch.float32),  # DeepSeek-V3 style
    ("sqrtsoftplus", True, 1.0, 4, torch.float32),
    ("softmax", True, 1.0, 16, torch.float64),
    ("sigmoid", False, 1.5, 1, torch.float64),
]
CASES_INTERP = [CASES[0], CASES[2], CASES[4]]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-6), torch.float64: dict(rtol=1e-11, atol=1e-13)}


@pytest.mark.parametrize(
    "device,backend,case",
    case_params(CASES, CASES_INTERP,
                ids=lambda c: f"{c[0]}-norm{int(c[1])}-s{c[2]}-a{c[3]}-{str(c[4])[6:]}"),
)
def test_replayed_topk_reproduces_plain_moe(device, backend, case):
    score_func, normalize, scaling, align, dtype = case
    T, H, Fh, E, K = 45, 16, 24, 8, 2
    model = TinyMoE(H, Fh, E, K, dtype).to(device)
    x0 = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    params = [model.router, model.w1, model.b1, model.w2]

    x = x0.clone().requires_grad_(True)
    ref_out, topi = model.plain_forward(x, score_func, normalize, scaling)
    ref_grads = torch.autograd.grad(ref_out, [x, *params], gy)

    x = x0.clone().requires_grad_(True)
    out, plan = model.replay_forward(x, topi.to(torch.int16), score_func, normalize, scaling,
                                     align, backend)
    grads = torch.autograd.grad(out, [x, *params], gy)

    assert torch.equal(plan.expert_indices.long(), topi.long())
    assert int(plan.tokens_per_expert.sum()) == T * K
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    for name, g, rg in zip(("x", "router", "w1", "b1", "w2"), grads, ref_grads):
        torch.testing.assert_close(g, rg, **TOL[dtype], msg=lambda m: f"grad {name}: {m}")
    assert grads[1].abs().sum() > 0  # the router does learn through the replayed gate


@pytest.mark.parametrize("device,backend,n", case_params([None]))
def test_replay_after_router_update_uses_recorded_experts(device, backend, n):
    """R2/R3: record top-k, change the router, replay. The experts stay the recorded ones
    (even where the new top-k differs) and the weights come from the current logits."""
    T, H, Fh, E, K = 40, 16, 8, 8, 2
    model = TinyMoE(H, Fh, E, K, torch.float64).to(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, dtype=torch.float64, generator=g).to(device)
    _, recorded = model.plain_forward(x, "softmax", True, 1.0)
    with torch.no_grad():
        model.router.add_(torch.randn(H, E, dtype=torch.float64, device=device) * 0.5)
    _, live = model.plain_forward(x, "softmax", True, 1.0)
    assert not torch.equal(live, recorded)  # the update flips some choices
    out, plan = model.replay_forward(x, recorded.to(torch.int32), "softmax", True, 1.0, 1, backend)
    assert torch.equal(plan.expert_indices.long(), recorded.long())
    logits = (x @ model.router).detach()
    want_w = torch.softmax(logits.gather(1, recorded), dim=-1)
    torch.testing.assert_close(plan.weights.detach(), want_w, rtol=1e-12, atol=1e-14)
    want = torch.zeros_like(x)
    for t in range(T):
        for k in range(K):
            e = int(recorded[t, k])
            want[t] += want_w[t, k] * model.expert(e, x[t : t + 1])[0].detach()
    torch.testing.assert_close(out.detach(), want, rtol=1e-10, atol=1e-12)
