"""Mutation testing: does the test suite notice when the code is wrong?

    python tools/mutate.py                  # every mutant (make mutate)
    python tools/mutate.py --only M07 M21   # some of them
    python tools/mutate.py --list           # the list, without running it
    python tools/mutate.py --only M07 --show  # and the test output of killed mutants
    python tools/mutate.py --python-only    # every mutant outside csrc/ (no C++ rebuilds)

Each mutant is one small, deliberate bug: a text replacement in one file of the package
(Python, Triton or C++). The script copies the tree into a sandbox (the Triton kernels at
their installed place, `replay_ops/triton_kernels`), applies one mutant at a time, rebuilds
the native extension when the mutant is in C++ (ninja recompiles only the changed file),
runs the tests that should catch it, and restores the file. A mutant is *killed* when those
tests fail (or time out) and *survives* when they pass: a survivor is a hole in the tests.
Before anything runs, every chosen mutant is checked against the checkout: one whose
original text does not occur exactly once in its file (the code moved) is refused, and
the script exits with status 2 naming it.

The results table is printed and written to tools/mutation_results.md: a whole run rewrites
it; a run of some mutants (`--only`, `--python-only`) replaces their rows, each row naming
the run (date and git commit) it comes from. The sandbox uses the checkout's built library
and builds its own only when a chosen mutant is in C++ (or no library is built). This is
not part of `make test` (the C++ mutants rebuild the extension several times); run it
after changing the code or the tests.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "tools" / "mutation_results.md"


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # path in the repository
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest arguments
    what: str


T_TORCH = ("-k", "torch")
M = Mutant
MUTANTS = [
    # ----------------------------------------------------- torch backend (Python)
    M("M01", "replay_ops/backends/torch.py",
      "    if sf is scores.SOFTMAX and not normalize:\n        w = sf.forward(x)",
      "    if sf is scores.SOFTMAX and normalize:\n        w = sf.forward(x)",
      ("tests/test_gate.py", *T_TORCH), "softmax weights: the two normalize modes swapped"),
    M("M02", "replay_ops/backends/torch.py",
      "            many = valid.sum(dim=1, keepdim=True) > 1\n            w = torch.where(many,",
      "            many = valid.sum(dim=1, keepdim=True) > 0\n            w = torch.where(many,",
      ("tests/test_gate.py", *T_TORCH),
      "sigmoid/sqrtsoftplus: a row with one valid slot is normalised (weight 1)"),
    M("M03", "replay_ops/backends/torch.py",
      "(_weights(x, idx, sf, opts.normalize) * opts.scaling_factor)",
      "(_weights(x, idx, sf, opts.normalize) * 1.0)",
      ("tests/test_gate.py", *T_TORCH), "scaling_factor ignored"),
    M("M04", "replay_ops/backends/torch.py",
      "    offsets = torch.cat([zero, ((counts + align - 1) // align * align).cumsum(0)])",
      "    offsets = torch.cat([zero, counts.cumsum(0)])",
      ("tests/test_gate.py", *T_TORCH), "plan: no padding rows up to a multiple of align"),
    M("M05", "replay_ops/backends/torch.py",
      "    order = torch.sort(key, stable=True).indices",
      "    order = torch.sort(key * (idx.numel() + 1) - torch.arange(key.numel()), "
      "stable=True).indices",
      ("tests/test_gate.py", *T_TORCH), "plan order: slots descending within an expert"),
    M("M06", "replay_ops/backends/torch.py",
      "    g = torch.where(valid, grad_weights.to(x.dtype), 0.0) * scaling_factor",
      "    g = grad_weights.to(x.dtype) * scaling_factor",
      ("tests/test_gate.py", *T_TORCH), "gate backward: empty slots' gradients not dropped"),
    M("M07", "replay_ops/backends/torch.py",
      "    grad_w = torch.where(valid, (go[:, None, :] * rows.to(cdt)).sum(dim=-1), 0.0)",
      "    grad_w = (go[:, None, :] * rows.to(cdt)).sum(dim=-1)",
      ("tests/test_unpermute.py", *T_TORCH),
      "unpermute backward: the weight gradient of empty slots not zeroed"),
    M("M08", "replay_ops/backends/torch.py",
      "    return _sum_slots(rows, valid).to(grad_out.dtype)",
      "    return _sum_slots(rows, torch.ones_like(valid)).to(grad_out.dtype)",
      ("tests/test_permute.py", *T_TORCH), "permute backward: empty slots summed in"),
    # ----------------------------------------------------- ops layer, plan (Python)
    M("M09", "replay_ops/backends/torch.py",
      "        idx = torch.where(flagged[:, None], sel_idx.to(torch.int32), idx)",
      "        idx = torch.where(flagged[:, None], idx, sel_idx.to(torch.int32))",
      ("tests/test_gate.py", "-k", "replay_mask or fallback"),
      "replay_mask (torch): recorded rows and the model's own selection swapped"),
    M("M10", "replay_ops/_validate.py",
      "return (r < -1) | (r >= num_experts)", "return (r < -1) | (r > num_experts)",
      ("tests/test_validation.py",), "validation: index == E accepted"),
    M("M11", "replay_ops/_validate.py",
      "first_bad_route(idx[:, None, :], num_experts, replay_mask, repeats=repeats)",
      "first_bad_route(idx[:, None, :], num_experts, None, repeats=repeats)",
      ("tests/test_validation.py",), "validation: fallback rows (replay_mask False) checked"),
    M("M12", "replay_ops/plan.py",
      "        valid = self.expert_indices >= 0", "        valid = self.expert_indices > 0",
      ("tests/test_gate.py", "-k", "dense"), "to_dense: expert 0 dropped"),
    # ----------------------------------------------------- replay system (Python)
    M("M13", "replay_ops/router_replay/recompute.py",
      "        idx = q.popleft()", "        idx = q.pop()",
      ("tests/test_router_replay.py",), "recompute queue: last in, first out"),
    M("M14", "replay_ops/router_replay/replay.py",
      "            self._start_new_recording()  # (as the first RECORD route would)",
      "            pass",
      ("tests/test_router_replay.py",),
      "R2: set_action(RECORD) after a replay does not start the next step"),
    M("M55", "replay_ops/router_replay/replay.py",
      "            # old step).\n            self._start_new_recording()",
      "            # old step).\n            pass",
      ("tests/test_router_replay.py",),
      "R2: a route(action=RECORD) after a replay appends to the previous step's recording"),
    M("M15", "replay_ops/router_replay/files.py",
      "        if stored != got:\n            raise RoutingFileError(path, f\"header checksum",
      "        if stored is None:\n            raise RoutingFileError(path, f\"header checksum",
      ("tests/test_replay_files.py",), "record files: the header checksum not compared"),
    M("M16", "replay_ops/router_replay/files.py",
      "np.memmap(self.file, mode=\"c\"", "np.memmap(self.path, mode=\"c\"",
      ("tests/test_replay_files.py", "-k", "replaced or racing"),
      "record files: the maps reopen the path (a torn read)"),
    M("M17", "replay_ops/router_replay/files.py",
      "        for arr in (self.cu_seqlens_np, self.raw_np):",
      "        for arr in (self.raw_np,):",
      ("tests/test_replay_files.py",), "record files: the data checksum skips cu_seqlens"),
    M("M18", "replay_ops/router_replay/adapters/batch.py",
      "        torch.zeros(n, dtype=torch.bool),", "        torch.ones(n, dtype=torch.bool),",
      ("tests/test_adapters.py",), "adapters: a request without routing is replayed"),
    M("M19", "replay_ops/router_replay/adapters/batch.py",
      "        mask = torch.cat(self._masks + [torch.zeros(1, dtype=torch.bool)])",
      "        mask = torch.cat(self._masks + [torch.ones(1, dtype=torch.bool)])",
      ("tests/test_adapters.py",), "adapters: the final token (no route) is replayed"),
    M("M20", "replay_ops/router_replay/adapters/verl.py",
      "    mask = am & (pos != last[:, None])", "    mask = am",
      ("tests/test_adapters.py",), "verl layout: the last real token is replayed"),
    M("M21", "replay_ops/router_replay/adapters/sglang.py",
      "        if len(readings) > 1:", "        if len(readings) > 2:",
      ("tests/test_adapters.py",), "SGLang: an ambiguous payload read with a guessed L"),
    M("M22", "replay_ops/router_replay/config.py",
      "    if mode is ReplayMode.R2 and flag:", "    if mode is ReplayMode.R2 and flag and False:",
      ("tests/test_config.py",), "config: R2 with rollout routing replay accepted"),
    M("M23", "replay_ops/router_replay/config.py",
      "    if mode is ReplayMode.DISABLED and (cfg.record_file or cfg.replay_file):",
      "    if mode is ReplayMode.DISABLED and cfg.replay_file:",
      ("tests/test_config.py",), "config: a record_file with mode=disabled accepted"),
    M("M24", "replay_ops/integrations/hf/block.py",
      "        y = grouped_mlp(experts, rows, plan.expert_offsets[1:])",
      "        y = grouped_mlp(experts, rows, plan.expert_offsets[:-1])",
      ("tests/test_hf_integration.py", "-k", "qwen3_moe"),
      "HF: the grouped GEMM's group ends shifted by one expert (each segment runs the "
      "previous expert's weights)"),
    # ----------------------------------------------------- Triton kernels
    M("M25", "triton_kernels/gate.py",
      "    return tl.where(z >= 0, fdiv(1.0, 1.0 + e), fdiv(e, 1.0 + e))",
      "    return fdiv(1.0, 1.0 + e)",
      ("tests/test_gate.py", "-k", "triton and modes"), "Triton sigmoid wrong for z < 0"),
    M("M26", "triton_kernels/gate.py",
      "        sp = tl.where(z > _SOFTPLUS_THRESHOLD, z,", "        sp = tl.where(z > 0.0, z,",
      ("tests/test_gate.py", "-k", "triton and modes"),
      "Triton sqrt-softplus linear from 0 instead of 20"),
    M("M27", "triton_kernels/gate.py",
      "    z = tl.where(valid, x, float(\"-inf\"))", "    z = x",
      ("tests/test_gate.py", "-k", "triton and (empty or modes or extreme)"),
      "Triton softmax over the selection counts empty slots"),
    M("M28", "triton_kernels/gate.py",
      "    padded = (counts + align - 1) // align * align", "    padded = counts",
      ("tests/test_gate.py", "-k", "triton and align"), "Triton plan: no align padding"),
    M("M29", "triton_kernels/_common.py",
      "    return slot, tok, (slot >= 0) & (tok < T)", "    return slot, tok, tok < T",
      ("tests/test_permute.py", "-k", "triton"),
      "Triton permute (sorted_row_tokens): padding rows copy token 0"),
    M("M30", "triton_kernels/_common.py",
      "    return slot, tok, (slot >= 0) & (tok < T)", "    return slot, tok, tok < T",
      ("tests/test_unpermute.py", "-k", "triton"),
      "Triton unpermute backward: padding rows get token 0's gradient"),
    # ----------------------------------------------------- C++ (CPU kernels, shared math)
    M("M31", "csrc/include/replay_math.h",
      "return normalize && nvalid > 1; }", "return normalize && nvalid > 0; }",
      ("tests/test_gate.py", "-k", "native and modes"),
      "C++: a row with one valid slot is normalised"),
    M("M32", "csrc/include/replay_math.h",
      "  acc_t sp = x > acc_t(kSoftplusThreshold) ? x : ro_log1p(ro_exp(x));",
      "  acc_t sp = x > acc_t(0) ? x : ro_log1p(ro_exp(x));",
      ("tests/test_gate.py", "-k", "native and modes"), "C++ sqrt-softplus linear from 0"),
    M("M33", "csrc/cpu/gate_cpu.cpp",
      "        h[e] = static_cast<int32_t>(running[e]);\n        running[e] += v;",
      "        running[e] += v;\n        h[e] = static_cast<int32_t>(running[e]);",
      ("tests/test_native.py", "-k", "many_chunks or structure"),
      "C++ plan: chunk bases inclusive instead of exclusive"),
    M("M34", "csrc/cpu/permute_cpu.cpp",
      "          if (r >= 0 && r < R) d = dot(g, X + r * H, H);",
      "          if (r < R) d = dot(g, X + (r < 0 ? 0 : r) * H, H);",
      ("tests/test_unpermute.py", "-k", "native"),
      "C++ unpermute backward: empty slots get a weight gradient"),
    # ----------------------------------------------------- dense gate (gate_dense), torch
    M("M35", "replay_ops/backends/torch.py",
      "    rmap = _scatter_rows(torch.ones_like(tot), idx, first, E, torch.uint8).bool()",
      "    rmap = probs != 0",
      ("tests/test_gate_dense.py", "-k", "torch"),
      "dense (torch): routing_map read off the probs (a routed weight of 0 is not routed)"),
    M("M36", "replay_ops/backends/torch.py",
      "    flags |= ((idx < -1) | (idx >= E)).any(dim=1).to(torch.uint8) * _RANGE",
      "    flags |= ((idx < -1) | (idx > E)).any(dim=1).to(torch.uint8) * _RANGE",
      ("tests/test_gate_dense.py", "-k", "torch"),
      "dense (torch) row flags: an id equal to E not flagged out of range"),
    M("M37", "replay_ops/backends/torch.py",
      "        s = key.sort(dim=1).values\n",
      "        s = key\n",
      ("tests/test_gate_dense.py", "-k", "torch"),
      "dense (torch) row flags: only a repeat in adjacent slots flagged (no sort)"),
    M("M38", "replay_ops/plan.py",
      "    i = (offset % E + s + torch.arange(K, device=device) + w) % E",
      "    i = (offset % E + s + torch.arange(1, K + 1, device=device) + w) % E",
      ("tests/test_gate_dense.py", "-k", "torch"),
      "dense (torch) spread padding: slot values off by one"),
    M("M39", "replay_ops/backends/torch.py",
      "    return _scatter_rows(tot, idx, first, num_experts, grad.dtype)",
      "    return _scatter_rows(torch.where(ok, v, 0.0), idx, first, num_experts, grad.dtype)",
      ("tests/test_gate_dense.py", "-k", "torch and permute_probs"),
      "permute(probs=) backward (torch): a repeated expert gets its first row's gradient only"),
    # ----------------------------------------------------- dense gate, C++ and Triton
    M("M40", "csrc/cpu/gate_cpu.cpp",
      "      if (e < 0 || m[e]) continue;  // empty, or a repeat already written",
      "      if (e < 0) continue;  // empty, or a repeat already written",
      ("tests/test_gate_dense.py", "-k", "native"),
      "C++ dense: a repeated expert's entry overwritten by the sum of its later slots"),
    M("M41", "csrc/include/replay_math.h",
      "  } else if (flags & kRowMasked) {\n    return -1;",
      "  } else if (flags & kRowMasked) {\n    e = static_cast<int64_t>(ip[k * sk]);",
      ("tests/test_gate_dense.py", "-k", "native"),
      "C++ dense: a masked row without fallback routes its recorded ids"),
    M("M42", "triton_kernels/gate_dense.py",
      "            acc += tl.where(on, _col(w, cols, k)[:, None], 0.0)",
      "            acc = tl.where(on, _col(w, cols, k)[:, None], acc)",
      ("tests/test_gate_dense.py", "-k", "triton"),
      "Triton dense: a repeated expert keeps its last slot's weight (not the sum)"),
    M("M43", "triton_kernels/gate_dense.py",
      "        fill = tl.where((flags == 8)[:, None], -1, rec)",
      "        fill = rec",
      ("tests/test_gate_dense.py", "-k", "triton"),
      "Triton dense: a masked row without fallback routes its recorded ids"),
    # ----------------------------------------------------- Megatron router, verl inputs
    M("M44", "replay_ops/integrations/megatron/router.py",
      "        if known is not None and known.name == a.name:\n            return known\n",
      "        if known is not None and known.name == a.name:\n"
      "            return known if known is a else None\n",
      ("tests/test_megatron_clients.py", "-k", "verl_enum"),
      "Megatron router: actions compared by identity (verl's enum routes natively)"),
    M("M45", "replay_ops/integrations/megatron/router.py",
      "        out = self._gate(logits, idx, mask=keep, fallback=fallback, padding=padding,",
      "        out = self._gate(logits, idx, mask=None, fallback=fallback, padding=padding,",
      ("tests/test_megatron_clients.py", "-k", "replay_mask"),
      "Megatron router: replay_mask False rows replayed instead of taking their own top-k"),
    M("M46", "replay_ops/integrations/megatron/router.py",
      "        return target, (masks.pop(0) if masks is not None else None)",
      "        return target, (masks[0] if masks is not None else None)",
      ("tests/test_megatron_clients.py", "-k", "fifo"),
      "Megatron router: REPLAY_BACKWARD pops the index FIFO but not the mask FIFO"),
    M("M47", "replay_ops/integrations/megatron/router.py",
      "        if not rr.replay_backward_list:\n            if self.is_mtp_layer:\n"
      "                return None\n",
      "        if not rr.replay_backward_list:\n            if self.is_mtp_layer:\n"
      "                pass\n",
      ("tests/test_verl_clients.py", "-k", "one_process"),
      "Megatron router: an MTP router without target raises under REPLAY_BACKWARD"),
    M("M48", "replay_ops/integrations/megatron/wiring.py",
      "        inplace = (not in_mtp) or mtp_here or (container and parent_inplace)",
      "        inplace = True",
      ("tests/test_megatron_layers.py", "-k", "mtp"),
      "replay_spec: the MTP builder written into the decoder's shared layer specs "
      "(decoder routers without target route natively)"),
    M("M49", "replay_ops/_validate.py",
      "        pos = _first_true(bits < 0)",
      "        pos = _first_true(bits < -1)",
      ("tests/test_routing_dtypes.py", "-k", "uint64"),
      "routing dtypes: uint64 2^64-1 wraps to -1 (an empty slot) in silence"),
    M("M50", "replay_ops/router_replay/adapters/verl.py",
      "    elif zero_rows == \"error\" and bool(zero.any()):",
      "    elif zero_rows == \"error\" and bool(zero.all()):",
      ("tests/test_adapters.py", "-k", "verl"),
      "verl layout: a zero row inside the mask accepted (unless every row is zero)"),
    M("M51", "replay_ops/router_replay/adapters/vllm.py",
      "    if not bool(zero.any()):\n        return\n    n, Lm = zero.shape",
      "    if not bool(zero.all()):\n        return\n    n, Lm = zero.shape",
      ("tests/test_vllm_adapter.py", "tests/test_adapters.py"),
      "vLLM: zero-filled rows accepted unless the whole payload is zero"),
    M("M52", "replay_ops/router_replay/adapters/batch.py",
      "    bad = (cols != 0) & (cols != -1)", "    bad = (cols != 0) & (cols < -1)",
      ("tests/test_vllm_adapter.py", "tests/test_adapters.py"),
      "adapters: routes in a layer the model says is dense accepted"),
    M("M53", "replay_ops/router_replay/adapters/vllm.py",
      "    if t.dtype == torch.uint16 and E <= 256:", "    if t.dtype == torch.uint16 and E < 8:",
      ("tests/test_vllm_adapter.py",),
      "vLLM: a uint16 payload accepted for a model with <= 256 experts"),
    M("M54", "replay_ops/router_replay/adapters/vllm.py",
      "                elif omitted == \"mask\":",
      "                elif omitted == \"mask\" or True:",
      ("tests/test_vllm_adapter.py",),
      "vLLM: rows omitted by routed_experts_prompt_start silently masked"),
    # ----------------------------------------------------- the model's own selection
    M("M250", "replay_ops/options.py",
      "        on_logits = score_function == \"softmax\" and not pre_softmax",
      "        on_logits = score_function == \"softmax\" and pre_softmax",
      ("tests/test_selection.py", "-k", "megatron or presets"),
      "Selection.megatron: pre-softmax and raw-logit selection swapped"),
    M("M251", "replay_ops/_validate.py",
      "    if top_k > group_topk * size:",
      "    if top_k > group_topk * size + size:",
      ("tests/test_selection.py", "-k", "bad_selection"),
      "selection checks: K above the kept groups' experts accepted"),
    M("M252", "replay_ops/ops.py",
      "    if replay_mask is not None or padding == \"select\":\n        f.add(SELECT)",
      "    if padding == \"select\":\n        f.add(SELECT)",
      ("tests/test_selection.py", "-k", "passed_over"),
      "ops: a masked gate not marked as selecting (a backend without the selection runs it)"),
    M("M253", "replay_ops/backends/torch.py",
      "        1, _top(gs, sel.group_topk), True)",
      "        1, _top(gs, sel.group_topk + 1), True)",
      ("tests/test_selection.py", "-k", "torch"),
      "selection (torch): one group too many kept"),
    M("M254", "replay_ops/backends/torch.py",
      "    return key * (1 << 32) + (n - 1 - torch.arange(n, device=v.device))",
      "    return key * (1 << 32) + torch.arange(n, device=v.device)",
      ("tests/test_selection.py", "-k", "torch and tie"),
      "selection (torch): ties broken by the higher id"),
    M("M255", "replay_ops/backends/torch.py",
      "        flagged = pad if flagged is None else flagged | pad",
      "        flagged = pad if flagged is None else flagged",
      ("tests/test_selection.py", "-k", "torch and flagged_rows_like"),
      "selection (torch): padding='select' rows ignored when a replay_mask is given"),
    M("M256", "replay_ops/backends/torch.py",
      "        return lse_s - lse, ok, member, (lse_s, lse)",
      "        return lse_s, ok, member, (lse_s, lse)",
      ("tests/test_selection.py", "-k", "torch and agreement"),
      "set_logprob (torch): the log-partition over all experts left out"),
    M("M257", "replay_ops/backends/torch.py",
      "        return g * (inside - torch.exp(x - lse[:, None]))",
      "        return g * inside",
      ("tests/test_selection.py", "-k", "torch and gradcheck"),
      "set_logprob gradient (torch): the softmax normaliser's term dropped"),
    M("M258", "replay_ops/backends/torch.py",
      "    return eq.any(dim=2).all(dim=1) & eq.any(dim=1).all(dim=1)",
      "    return eq.any(dim=2).all(dim=1)",
      ("tests/test_selection.py", "-k", "torch and agreement"),
      "agreement (torch): a row with a repeated expert agrees"),
    M("M259", "replay_ops/ops.py",
      "    if not ctx.agreement:  # the size-0 placeholder (a traced graph may hand it zeros)\n"
      "        grad_set_logprob = None\n    grad = None",
      "    grad_set_logprob = None\n    grad = None",
      ("tests/test_selection.py", "-k", "native and gradcheck"),
      "autograd: the gradient of set_logprob dropped"),
    M("M260", "replay_ops/api.py",
      "    agree = out[6:8] if opts.return_agreement else (None, None)",
      "    agree = (None, None)",
      ("tests/test_selection.py", "-k", "native and agreement"),
      "api: the agreement outputs never returned"),
    M("M261", "replay_ops/router_replay/replay.py",
      "selection=DEFAULT_SELECTION if selection is None else selection)",
      "selection=DEFAULT_SELECTION)",
      ("tests/test_selection.py", "-k", "router_replay"),
      "RouterReplay.route: the layer's selection not handed to the gate"),
    M("M270", "csrc/include/replay_select.h",
      "  RO_HDI static bool beats(acc_t v, acc_t b) { return v > b || (v != v && b == b); }",
      "  RO_HDI static bool beats(acc_t v, acc_t b) { return v >= b || (v != v && b == b); }",
      ("tests/test_selection.py", "-k", "native and tie"),
      "C++ selection: an equal value displaces a lower id (ties to the higher id)"),
    M("M271", "csrc/include/replay_select.h",
      "    for (int64_t i = 1; i < best.n; ++i) s += vals[i];  // the largest first",
      "    for (int64_t i = 1; i < 1; ++i) s += vals[i];  // the largest first",
      ("tests/test_selection.py", "-k", "native and (groups or megatron)"),
      "C++ selection: a group's score is its largest value alone"),
    M("M272", "csrc/cpu/gate_cpu.cpp",
      "          masked || (padding == rm::kPadSelect && rm::row_flags(ip, sk, K, E, false) != 0);",
      "          masked || (padding == rm::kPadSelect && rm::row_flags(ip, sk, K, E, false) == 1);",
      ("tests/test_selection.py", "-k", "native and flagged_rows_like"),
      "C++ selection: with padding='select' only rows whose one flag is a -1 slot selected"),
    M("M273", "csrc/cpu/gate_cpu.cpp",
      "      v[j] = BIAS ? u + BIAS[j] : u;",
      "      v[j] = u;",
      ("tests/test_selection.py", "-k", "native and (bias or megatron or transformers)"),
      "C++ selection: the expert bias ignored"),
    M("M274", "csrc/include/replay_select.h",
      "  return before == K - 1;",
      "  return before <= K;",
      ("tests/test_selection.py", "-k", "native and agreement"),
      "C++ agreement: a set one expert off the model's top-k agrees"),
    M("M275", "csrc/cpu/gate_cpu.cpp",
      "      row[j] -= g * (rm::ro_exp(static_cast<acc_t>(x[j]) - m) / s);",
      "      row[j] -= acc_t(0) * (rm::ro_exp(static_cast<acc_t>(x[j]) - m) / s);",
      ("tests/test_selection.py", "-k", "native and gradcheck"),
      "C++ set_logprob gradient: the softmax normaliser's term dropped"),
    M("M276", "triton_kernels/select.py",
      "    j = tl.min(tl.where(cand, ids, _NO_ID), axis=1)",
      "    j = tl.max(tl.where(cand, ids, -1), axis=1)",
      ("tests/test_selection_triton.py", "-k", "tie"),
      "Triton selection: equal values taken by the higher id"),
    M("M277", "triton_kernels/select.py",
      "    cand = tl.where(has_nan[:, None], isn, avail & (vv == m[:, None]))",
      "    cand = avail & (vv == m[:, None])",
      ("tests/test_selection_triton.py", "-k", "tie"),
      "Triton selection: a NaN no longer ranks above every number"),
    M("M278", "triton_kernels/select.py",
      "                s = tl.where(i == 0, val, s + val)  # the largest first",
      "                s = tl.where(i == 0, val, s)  # the largest first",
      ("tests/test_selection_triton.py", "-k", "gate_selects and groups-top2 and fp32"),
      "Triton selection: a group's score is its largest value alone"),
    M("M279", "triton_kernels/select.py",
      "            kept = kept | (grp == gj[:, None])",
      "            kept = kept | (grp >= 0)",
      ("tests/test_selection_triton.py", "-k", "gate_selects and groups and fp32"),
      "Triton selection: the group limit ignored (every group kept)"),
    M("M280", "triton_kernels/gate.py",
      "            need = need | (tl.load(Mask_ptr + rows, mask=rmask, other=1).to(tl.int32) == 0)",
      "            need = need | (tl.load(Mask_ptr + rows, mask=rmask, other=1).to(tl.int32) == 2)",
      ("tests/test_selection_triton.py", "-k", "gate_selects and default-softmax and fp32"),
      "Triton gate: replay_mask False rows keep their recorded ids"),
    M("M281", "triton_kernels/select.py",
      "        later = m2 & inr & (cols[None, :] > j) & (raw == cj[:, None])",
      "        later = m2 & inr & (cols[None, :] > j + K) & (raw == cj[:, None])",
      ("tests/test_selection_triton.py", "-k", "gate_selects and default-softmax and fp32"),
      "Triton gate, padding='select': a repeated expert does not flag its row"),
    M("M282", "triton_kernels/select.py",
      "        ok = ok & found",
      "        ok = ok | found",
      ("tests/test_selection_triton.py", "-k", "near_misses"),
      "Triton agreement: every row agrees"),
    M("M283", "triton_kernels/select.py",
      "        first = first & ~((cols[None, :] > j) & (idx == cj[:, None]))",
      "        first = first",
      ("tests/test_selection_triton.py", "-k", "gate_selects and default-softmax and fp32"),
      "Triton set_logprob: a repeated expert counted twice in the set"),
    M("M284", "triton_kernels/gate.py",
      "            acc = acc - tl.where(ok[:, None] & emask, out, 0.0)",
      "            acc = acc - tl.where(ok[:, None] & emask, 0.0 * out, 0.0)",
      ("tests/test_selection_triton.py", "-k", "gradient and softmax"),
      "Triton set_logprob gradient: the normaliser's term dropped"),
    M("M285", "triton_kernels/gate.py",
      "        _plan_of_slots(IdxOut_ptr, K, 1, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr,",
      "        _plan_of_slots(Idx_ptr, stride_it, stride_ik, RowMap_ptr, ChunkCounts_ptr, Tpe_ptr,",
      ("tests/test_selection_triton.py", "-k", "gate_selects and default-softmax and fp32"),
      "Triton gate: the plan built from the recorded ids, not the selected ones"),
    M("M286", "triton_kernels/gate_dense.py",
      "                need = need & (flags != 8)",
      "                need = need & (flags >= 0)",
      ("tests/test_selection_triton.py", "-k", "dense_selects and default-softmax"),
      "Triton dense gate: a masked row with a fallback row selected instead"),
    M("M287", "triton_kernels/select.py",
      "            u = cast_rne(u, Logits_ptr.dtype.element_ty).to(CDT)",
      "            u = u.to(CDT)",
      ("tests/test_selection_triton.py", "-k", "tie"),
      "Triton selection: round_scores ignored"),
    M("M288", "triton_kernels/select.py",
      "            u = u + tl.load(Bias_ptr + ecols, mask=emask, other=0.0).to(CDT)",
      "            u = u - tl.load(Bias_ptr + ecols, mask=emask, other=0.0).to(CDT)",
      ("tests/test_selection_triton.py", "-k", "gate_selects and bias-round and fp32"),
      "Triton selection: the expert bias subtracted"),
    M("M289", "triton_kernels/select.py",
      "            go = live != 0",
      "            go = flagged != 0",
      ("tests/test_selection_triton.py", "-k", "near_misses"),
      "Triton agreement: only the flagged rows are compared"),
    M("M56", "replay_ops/integrations/megatron/dispatcher.py",
      "         bool(getattr(config, \"moe_router_padding_for_quantization\", False)),",
      "         False,",
      ("tests/test_megatron_router.py", "-k", "refuses_each"),
      "plan dispatcher: FP8/FP4 routing-map padding not refused"),
    M("M57", "replay_ops/integrations/megatron/dispatcher.py",
      "        (\"moe_permute_fusion\", bool(config.moe_permute_fusion),",
      "        (\"moe_permute_fusion\", False,",
      ("tests/test_megatron_router.py", "-k", "refuses_each"),
      "plan dispatcher: TransformerEngine's fused permute not refused"),
    M("M58", "replay_ops/integrations/megatron/dispatcher.py",
      "        (\"moe_shared_expert_overlap\", bool(config.moe_shared_expert_overlap),",
      "        (\"moe_shared_expert_overlap\", False,",
      ("tests/test_megatron_router.py", "-k", "refuses_each"),
      "plan dispatcher: the overlapped shared expert not refused"),
    # ----------------------------------------------------- untrusted routing input
    M("U01", "replay_ops/router_replay/adapters/batch.py",
      "    if not isinstance(head, dict) or set(head) != _BATCH_KEYS:",
      "    if not isinstance(head, dict) or not _BATCH_KEYS <= set(head):",
      ("tests/test_untrusted_routing.py", "-k", "crafted_batch_headers"),
      "ReplayBatch.from_bytes: header fields outside the whitelist accepted"),
    M("U02", "replay_ops/router_replay/adapters/batch.py",
      "    if not (1 <= L <= MAX_LAYERS and 1 <= K <= MAX_TOP_K and L * K <= MAX_LAYER_SLOTS):",
      "    if not (1 <= L and 1 <= K):",
      ("tests/test_untrusted_routing.py", "-k", "crafted_batch_headers"),
      "ReplayBatch.from_bytes: the bounds on L and K removed"),
    M("U03", "replay_ops/router_replay/adapters/batch.py",
      "    if mask_bytes is not None and mask_bytes != (n + 7) // 8:",
      "    if mask_bytes is not None and mask_bytes < (n + 7) // 8 - 2**62:",
      ("tests/test_untrusted_routing.py", "-k", "crafted_batch_headers or memory"),
      "ReplayBatch.from_bytes: the mask bits no longer bound the token count"),
    M("U04", "replay_ops/router_replay/adapters/batch.py",
      "        want = (\"keep\", L, K, n, lens, False)",
      "        want = (\"keep\", L, K, n, list(inf.seq_lens), False)",
      ("tests/test_untrusted_routing.py", "-k", "crafted_batch_headers"),
      "ReplayBatch.from_bytes: cu_seqlens not compared with the blob's sequences"),
    M("U05", "replay_ops/router_replay/adapters/batch.py",
      "            if n and bool((flat < 0).any()):",
      "            if False:",
      ("tests/test_untrusted_routing.py", "-k", "unsigned"),
      "ReplayBatch.from_bytes: empty slots wrap to expert 255 under a uint8 header"),
    M("U06", "replay_ops/router_replay/files.py",
      "    with _locked(path):\n        _write_routing(path, indices, meta, cu_seqlens, encoding, level)",
      "    if True:\n        _write_routing(path, indices, meta, cu_seqlens, encoding, level)",
      ("tests/test_untrusted_routing.py", "-k", "never_lost"),
      "record files: write_routing takes no lock (a concurrent append loses the write)"),
    M("U07", "replay_ops/router_replay/files.py",
      "    H = _meta_int(path, md, \"num_hidden_layers\", 1, MAX_LAYERS)",
      "    H = _meta_int(path, md, \"num_hidden_layers\", 1, 10**12)",
      ("tests/test_untrusted_routing.py", "-k", "crafted_record_headers"),
      "record files: num_hidden_layers unbounded"),
    M("U08", "replay_ops/router_replay/files.py",
      "    except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError...",
      "    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError...",
      ("tests/test_untrusted_routing.py", "-k", "deeply_nested"),
      "record files: a deeply nested header escapes as RecursionError"),
    M("U09", "replay_ops/_atomic.py",
      "            if len(parts) == 3 and parts[0] == host and parts[1].isdigit():",
      "            if len(parts) == 3 and parts[1].isdigit():",
      ("tests/test_untrusted_routing.py", "-k", "temporary"),
      "atomic writes: another host's in-progress temporary removed for a pid dead here"),
    M("U10", "replay_ops/router_replay/adapters/vllm.py",
      "    if need != have:", "    if need < have:",
      ("tests/test_untrusted_routing.py", "-k", "vllm_npy"),
      "vLLM: an .npy header's shape not checked against the bytes present"),
    M("U11", "replay_ops/router_replay/adapters/vllm.py",
      "    if max_rows is not None and shape[0] > max_rows:",
      "    if max_rows is not None and shape[0] > 2**62:",
      ("tests/test_untrusted_routing.py", "-k", "vllm_npy"),
      "vLLM: an .npy header's rows not bounded by the request's tokens"),
    M("U12", "replay_ops/router_replay/adapters/sglang.py",
      "        if b64_size(payload) > 2 * need + 4096:",
      "        if b64_size(payload) > 2**62:",
      ("tests/test_untrusted_routing.py", "-k", "sglang"),
      "SGLang: a payload longer than the request decoded before it is refused"),
    # ----------------------------------------------------- routing codec (hostile input)
    M("MC01", "replay_ops/router_replay/codec/format.py",
      "    if rows.crc() != ch.content_crc:",
      "    if False:",
      ("tests/test_codec.py", "-k", "content_checksum"),
      "codec: the content checksum of a decoded chunk skipped (every path)"),
    M("MC02", "replay_ops/router_replay/codec/device.py",
      "    _check_content(ch, _host_canonical(again,",
      "    (lambda *a: None)(ch, _host_canonical(again,",
      ("tests/test_codec.py", "-k", "content_checksum"),
      "codec: the Triton decode path skips the content checksum"),
    M("MC03", "replay_ops/router_replay/codec/format.py",
      "    seed = zlib.crc32(_U32.pack(index), chain) if fmt.binds_chunks else 0",
      "    seed = 0",
      ("tests/test_codec.py", "-k", "swapped or another_blob"),
      "codec: the binding dropped (chunk checksums not chained to blob and position)"),
    M("MC04", "replay_ops/router_replay/codec/format.py",
      "        if (total, len(seqs), chain) != (h_tokens, h_seqs, h_chain):",
      "        if False:",
      ("tests/test_codec.py", "-k", "bounded"),
      "codec: the blob header's token and sequence counts and chain end not compared with "
      "its chunks (a header that understates the tokens passes max_tokens)"),
    M("MC05", "replay_ops/router_replay/codec/format.py",
      "        if v > top:",
      "        if False:",
      ("tests/test_codec.py", "-k", "bounded"),
      "codec: the bounds on header sizes (K, L, tokens, T*L*K) removed"),
    M("MC06", "replay_ops/router_replay/codec/format.py",
      "            if want > ZSTD_MAX_RATIO * plen:",
      "            if False:",
      ("tests/test_codec.py", "-k", "zstd_frames"),
      "codec: a zstd chunk may claim more than a frame of its size can hold"),
    M("MC07", "replay_ops/router_replay/codec/format.py",
      "    if end != len(payload):",
      "    if end > len(payload):",
      ("tests/test_codec.py", "-k", "zstd_frames"),
      "codec: bytes after a zstd frame accepted"),
    M("MC08", "replay_ops/router_replay/codec/__init__.py",
      "        if out.numel() and _overlaps(out):",
      "        if False:",
      ("tests/test_codec.py", "-k", "overlapping"),
      "codec: decode(out=) into overlapping elements accepted"),
    # ----------------------------------------------------- routing bytes, second round
    M("M200", "replay_ops/router_replay/codec/chunk.py",
      "    if not len(lens):\n        return []",
      "    if False:\n        return []",
      ("tests/test_fuzz_codec.py", "-k", "empty_steps"),
      "codec: an append of no sequence writes a chunk of none (first_seq out of order)"),
    M("M201", "replay_ops/router_replay/codec/__init__.py",
      "    held = [c for c in inf.chunks if c.seq_lens]",
      "    held = list(inf.chunks)",
      ("tests/test_fuzz_codec.py", "-k", "older_writers"),
      "codec: decode_sequence searches past older writers' empty chunks as if in order"),
    M("M202", "replay_ops/router_replay/codec/__init__.py",
      "    _covered(done, n, f\"decode_sequence({index})\")",
      "    pass",
      ("tests/test_codec.py", "-k", "cover_its_output"),
      "codec: decode_sequence returns rows its chunks never wrote"),
    M("M203", "replay_ops/router_replay/codec/__init__.py",
      "    _covered(done, T, \"decode\")",
      "    pass",
      ("tests/test_codec.py", "-k", "cover_its_output"),
      "codec: decode returns rows its chunks never wrote"),
    M("M204", "replay_ops/router_replay/codec/format.py",
      "    if bad:\n        rows = ids.reshape(-1, K)",
      "    if False:\n        rows = ids.reshape(-1, K)",
      ("tests/test_fuzz_codec.py", "-k", "forged_rows"),
      "codec: \"set\" rows out of canonical order returned by the numpy path"),
    M("M205", "replay_ops/router_replay/codec/chunk.py",
      "        if order == \"set\":\n            _check_set_rows(ch, out)",
      "        if False:\n            _check_set_rows(ch, out)",
      ("tests/test_fuzz_codec.py", "-k", "forged_rows"),
      "codec: raw \"set\" chunks not checked for canonical order"),
    M("M206", "replay_ops/router_replay/codec/device.py",
      "        _decode_chunk(buf, ch, inf, tok)\n        return",
      "        return",
      ("tests/test_fuzz_codec.py", "-k", "empty_chunks_are_checked"),
      "codec: the device path skips an empty chunk unchecked"),
    M("M207", "replay_ops/router_replay/codec/chunk.py",
      "    out = np.zeros((T, L, K), _NARROW[w])\n    _check_content(ch, Canonical(out))",
      "    out = np.zeros((T, L, K), _NARROW[w])",
      ("tests/test_fuzz_codec.py", "-k", "empty_chunks_are_checked"),
      "codec: an empty chunk's content checksum not checked"),
    M("M208", "replay_ops/router_replay/codec/format.py",
      "        if h_chunks > room // CHUNK_HEADER_SIZE or h_seqs > room // 4:",
      "        if False:",
      ("tests/test_fuzz_codec.py", "-k", "bounded_by_the_bytes"),
      "codec: chunk and sequence counts not bounded by the blob's bytes"),
    M("M209", "replay_ops/router_replay/codec/transform.py",
      "    if n <= _SMALL_ROWS:\n        return _sort_rows_small(canon, order, fmt)",
      "    if False:\n        return _sort_rows_small(canon, order, fmt)",
      ("tests/test_fuzz_codec.py", "-k", "tiny"),
      "codec: a chunk of few rows costs one numpy call per comparator and digit"),
    M("M210", "replay_ops/router_replay/codec/transform.py",
      "                      np.triu(np.ones((k, k), bool), 1))",
      "                      np.tril(np.ones((k, k), bool), -1))",
      ("tests/test_codec.py", "-k", "few_rows"),
      "codec: the few-row Lehmer code counts the slots before each one, not after"),
    M("M211", "replay_ops/router_replay/files.py",
      "        if not stat.S_ISREG(st.st_mode):\n            os.close(fd)",
      "        if False:\n            os.close(fd)",
      ("tests/test_untrusted_routing.py", "-k", "fifo"),
      "record files: a FIFO or a directory read as a record file"),
    M("M212", "replay_ops/router_replay/files.py",
      "os.O_RDONLY | os.O_NONBLOCK | getattr(os, \"O_CLOEXEC\", 0)",
      "os.O_RDONLY | getattr(os, \"O_CLOEXEC\", 0)",
      ("tests/test_untrusted_routing.py", "-k", "fifo"),
      "record files: opened blocking (a FIFO waits for a writer forever)"),
    M("M213", "replay_ops/router_replay/files.py",
      "            if k == 0:\n                raise RoutingFileError",
      "            if k == 0:\n                break\n                raise RoutingFileError",
      ("tests/test_untrusted_routing.py", "-k", "truncated_while"),
      "record files: a short read kept (the rest of the buffer uninitialised)"),
    M("M214", "replay_ops/router_replay/files.py",
      "        self._data = None if mmap else snap.load(",
      "        self._data = None if True else snap.load(",
      ("tests/test_untrusted_routing.py", "-k", "in_place or truncated_after"),
      "record files: verified data used through a map (an in-place writer changes it)"),
    M("M215", "replay_ops/router_replay/files.py",
      "    if mmap and verify:",
      "    if False:",
      ("tests/test_replay_files.py", "-k", "view_of_the_data"),
      "record files: mmap=True with verify=True accepted"),
    M("M216", "replay_ops/router_replay/files.py",
      "    real = os.path.realpath(os.fspath(path))",
      "    real = os.path.abspath(os.fspath(path))",
      ("tests/test_untrusted_routing.py", "-k", "symlink or link_and"),
      "record files: the lock taken beside a symbolic link, not the file it names"),
    M("M217", "replay_ops/_atomic.py",
      "    path = os.path.realpath(os.fspath(path))",
      "    path = os.fspath(path)",
      ("tests/test_untrusted_routing.py", "-k", "symlink"),
      "atomic writes: a symbolic link replaced by a regular file"),
    M("M218", "replay_ops/router_replay/files.py",
      "    extra = {k: _meta_str(path, md, k) for k in md if k not in OWNED_KEYS}",
      "    extra = {}",
      ("tests/test_replay_files.py", "-k", "metadata"),
      "record files: the writer's own metadata keys dropped on read (and by appends)"),
    M("M219", "replay_ops/router_replay/files.py",
      "                         extra={**old.meta.extra, **meta.extra})",
      "                         extra=dict(meta.extra))",
      ("tests/test_replay_files.py", "-k", "metadata"),
      "record files: an append drops the file's own metadata keys"),
    M("M220", "replay_ops/router_replay/__main__.py",
      "            rf.check_routes()\n",
      "            pass\n",
      ("tests/test_replay_files.py", "-k", "decodes_what"),
      "command line: verify says OK without decoding"),
    M("M221", "replay_ops/router_replay/__main__.py",
      "        except (RoutingFileError, OSError) as e:",
      "        except FileNotFoundError as e:",
      ("tests/test_replay_files.py", "-k", "decodes_what"),
      "command line: an undecodable file ends in a traceback"),
    M("M222", "replay_ops/router_replay/files.py",
      "        bad = first_bad_route(idx, self.meta.num_experts)\n        if bad is None:",
      "        bad = None\n        if bad is None:",
      ("tests/test_replay_files.py", "-k", "decodes_what"),
      "command line: routes not checked (an expert out of range passes verify)"),
    M("M223", "replay_ops/router_replay/adapters/batch.py",
      "            mask = routed_rows(new, who, self.model_shape.moe_layer_ids, self.rows)",
      "            mask = torch.ones(new.shape[0], dtype=torch.bool)",
      ("tests/test_fuzz_routing.py", "-k", "empty_layers"),
      "adapters: a turn's rows with empty MoE layers marked for replay"),
    M("M224", "replay_ops/router_replay/adapters/batch.py",
      "    partial = empty.any(dim=1) & ~none\n    if bool(partial.any()):",
      "    partial = empty.any(dim=1) & ~none\n    if False:",
      ("tests/test_fuzz_routing.py", "-k", "empty_layers"),
      "adapters: a token routed in some MoE layers only is replayed"),
    M("M225", "replay_ops/router_replay/adapters/batch.py",
      "        _check_masked_rows(flat, torch.from_numpy(mask), head[\"layer_index\"], who)",
      "        pass",
      ("tests/test_fuzz_routing.py", "-k", "masks_versus"),
      "ReplayBatch.from_bytes: a masked row with an empty MoE layer accepted"),
    M("M226", "replay_ops/router_replay/adapters/batch.py",
      "        _check_masked_rows(flat, mask.reshape(-1), head[\"layer_index\"], who)",
      "        pass",
      ("tests/test_fuzz_routing.py", "-k", "masks_versus"),
      "ReplayBatch.to_bytes: a masked row with an empty MoE layer sent"),
    M("M227", "replay_ops/router_replay/store.py",
      "            if validate:\n                self._check_masked_rows(",
      "            if False:\n                self._check_masked_rows(",
      ("tests/test_fuzz_routing.py", "-k", "masks_versus"),
      "set_routing: an explicit mask True on a row with an empty MoE layer accepted"),
    M("M228", "replay_ops/router_replay/adapters/sglang.py",
      "        if int(i) in seen:",
      "        if False:",
      ("tests/test_untrusted_routing.py", "-k", "openai"),
      "SGLang OpenAI form: two choices with one index both take its routing"),
    M("M229", "replay_ops/router_replay/adapters/sglang.py",
      "        if not _is_int(i) or i < 0:",
      "        if not isinstance(i, (int, float)) or i < 0:",
      ("tests/test_untrusted_routing.py", "-k", "openai"),
      "SGLang OpenAI form: a choice index that is not an integer accepted"),
    M("M230", "replay_ops/router_replay/codec/__init__.py",
      "    continue_last = bool(continue_last) and len(lens) > 0",
      "    continue_last = bool(continue_last)",
      ("tests/test_fuzz_codec.py", "-k", "empty_steps"),
      "codec: a continued append of no sequence miscounts the blob's sequences"),
    # ----------------------------------------------------- one checked hand-off
    M("M300", "replay_ops/router_replay/adapters/batch.py",
      "                and _versions(self.indices, self.mask) == self.versions)",
      "                )",
      ("tests/test_checked_batch.py", "-k", "does_not_survive or write_after"),
      "ReplayBatch: an in-place write keeps the checked mark"),
    M("M301", "replay_ops/router_replay/adapters/batch.py",
      "@dataclass(frozen=True)\nclass ReplayBatch:", "@dataclass\nclass ReplayBatch:",
      ("tests/test_checked_batch.py", "-k", "does_not_survive"),
      "ReplayBatch: fields can be rebound under a checked mark"),
    M("M302", "replay_ops/router_replay/adapters/batch.py",
      "        return self.checked_shape == shape",
      "        return self.checked_shape is not None",
      ("tests/test_checked_batch.py",),
      "ReplayBatch: checked for one shape taken as checked for any"),
    M("M303", "replay_ops/router_replay/replay.py",
      "        other = batch.checked_shape\n        if other is not None:",
      "        other = batch.checked_shape\n        if False:",
      ("tests/test_checked_batch.py", "-k", "another_model"),
      "set_routing: a batch checked for another model shape replayed (its columns fit)"),
    M("M304", "replay_ops/integrations/megatron/layers.py",
      "    if checked is not None and checked != shape:",
      "    if False:",
      ("tests/test_megatron_layers.py", "-k", "another_moe_pattern"),
      "Megatron: a record file of another MoE layer pattern replayed onto the wrong layers"),
    M("M305", "replay_ops/integrations/megatron/layers.py",
      "    rows = torch.where(mask.to(idx.device)[:, None, None], idx, idx.new_full((), -1))",
      "    rows = idx",
      ("tests/test_megatron_layers.py", "-k", "batch_mask"),
      "Megatron: a batch's replay_mask dropped on the way to the routers"),
    M("M306", "replay_ops/integrations/megatron/layers.py",
      "        idx = idx.transpose(0, 1).reshape(-1, *idx.shape[2:])",
      "        idx = idx.reshape(-1, *idx.shape[2:])",
      ("tests/test_megatron_layers.py", "-k", "batch_mask"),
      "Megatron: a padded [B, S] batch given to the routers batch-first"),
    M("M307", "replay_ops/router_replay/files.py",
      "                         moe_layer_ids=shape.moe_layer_ids,",
      "                         moe_layer_ids=self.meta.moe_layer_ids,",
      ("tests/test_checked_batch.py", "tests/test_megatron_layers.py", "-k", "another"),
      "RoutingFile.batch: the file's MoE layer ids not compared with the model's"),
    M("M308", "replay_ops/router_replay/shape.py",
      "        return [1 if i % freq == 0 else 0 for i in range(num_layers)]",
      "        return [1] * num_layers",
      ("tests/test_megatron_layers.py", "-k", "model_shape"),
      "ModelShape.from_megatron: an int moe_layer_freq read as every layer MoE"),
    M("M309", "replay_ops/router_replay/shape.py",
      "        ids += [n + j for j in range(n_mtp)]",
      "        ids += [j for j in range(n_mtp)]",
      ("tests/test_megatron_layers.py", "-k", "model_shape or mtp"),
      "ModelShape.from_megatron: MTP layers alias the first layers"),
    M("M310", "replay_ops/router_replay/shape.py",
      "if isinstance(a, list) and type(b) is int and 0 <= b and len(a) * b <= 1 << 20:",
      "if isinstance(a, list) and type(b) is int:",
      ("tests/test_megatron_layers.py", "-k", "model_shape"),
      "moe_layer_freq text: a repetition unbounded"),
    M("M311", "replay_ops/router_replay/adapters/batch.py",
      "    cols = routing if isinstance(routing, MoEColumns) else \\\n"
      "        moe_columns(model_shape, routing, who, arrived_as)",
      "    cols = moe_columns(model_shape, routing.routing if isinstance(routing, MoEColumns) "
      "else routing, who, arrived_as)",
      ("tests/test_checked_batch.py", "-k", "vllm_payload"),
      "adapters: the layer mapping decided again on a payload's MoE columns"),
    M("M312", "replay_ops/router_replay/replay.py",
      "        if batch.checked_for(self.shape):\n            self._store.set_checked(",
      "        if False:\n            self._store.set_checked(",
      ("tests/test_checked_batch.py", "-k", "vllm_payload"),
      "set_routing: a batch checked for this model checked again"),
    M("M313", "replay_ops/router_replay/adapters/batch.py",
      "    return out if shape is None else _mark_checked(out, shape)",
      "    return out",
      ("tests/test_megatron_layers.py", "-k", "one_scan"),
      "Megatron data path: pad_thd, cp_split and sp_scatter drop the checked mark"),
    M("M314", "replay_ops/integrations/megatron/data.py",
      "        mask = _sp_rows(x.replay_mask, tp, rank, dim, who)",
      "        mask = x.replay_mask",
      ("tests/test_megatron_dist.py",),
      "sp_scatter: a batch's replay mask not split with its rows"),
    M("M315", "replay_ops/router_replay/adapters/verl.py",
      "    hit = first_unrouted(moe, mask.reshape(-1))",
      "    hit = None",
      ("tests/test_checked_batch.py", "-k", "sources_refuse"),
      "verl layout: a row to replay without a route in some MoE layer marked checked"),
    M("M316", "replay_ops/router_replay/files.py",
      "        if bool(partial.any()):\n            t = int(partial.nonzero()[0, 0])",
      "        if False:\n            t = int(partial.nonzero()[0, 0])",
      ("tests/test_checked_batch.py", "-k", "sources_refuse"),
      "RoutingFile.batch: a token routed in some MoE layers only taken for a routed one"),
    M("M317", "replay_ops/router_replay/replay.py",
      "        rec = self._recording(True)",
      "        rec = self._recording(self.config.validate)",
      ("tests/test_checked_batch.py", "-k", "recorded_batch"),
      "recorded_batch: marked checked without a scan (validate=False)"),
    M("M318", "replay_ops/router_replay/adapters/batch.py",
      "        hit = first_unrouted(moe, keep)\n        if hit is not None:\n"
      "            layers = [shape.moe_layer_ids[j] for j in hit[1]]",
      "        hit = None\n        if hit is not None:\n"
      "            layers = [shape.moe_layer_ids[j] for j in hit[1]]",
      ("tests/test_checked_batch.py", "-k", "refuses_what"),
      "ReplayBatch.check: a row to replay with an empty MoE layer accepted"),
    M("M319", "replay_ops/router_replay/adapters/batch.py",
      "        bad = first_bad_route(moe, shape.num_experts, keep)",
      "        bad = None",
      ("tests/test_checked_batch.py", "-k", "refuses_what"),
      "ReplayBatch.check: the value scan skipped"),
    M("M320", "replay_ops/integrations/megatron/layers.py",
      "        if s.layer_id not in ids:",
      "        if False:",
      ("tests/test_megatron_layers.py", "-k", "outside"),
      "Megatron: a router outside the config's MoE layers given a column"),
    M("M330", "replay_ops/integrations/megatron/router.py",
      "        on_logits = not config.moe_router_pre_softmax",
      "        on_logits = True",
      ("tests/test_megatron_select.py", "-k", "presoftmax"),
      "Megatron selection: pre-softmax selects on the logits (group sums of logits)"),
    M("M331", "replay_ops/integrations/megatron/router.py",
      "    return Selection(source=\"scores\", round_scores=True, expert_bias=expert_bias,",
      "    return Selection(source=\"scores\", round_scores=True, expert_bias=None,",
      ("tests/test_megatron_select.py", "-k", "sigmoid-bias"),
      "Megatron selection: the expert bias left out of the in-kernel selection"),
    M("M332", "replay_ops/integrations/megatron/router.py",
      "    gtopk = int(config.moe_router_group_topk or 0)",
      "    gtopk = 0",
      ("tests/test_megatron_select.py", "-k", "groups"),
      "Megatron selection: group-limited top-k dropped"),
    M("M333", "replay_ops/integrations/megatron/router.py",
      "        elif in_kernel:  # \"topk\", and \"error\" (whose flagged rows raise below; masked rows select)\n"
      "            padding = \"select\"",
      "        elif in_kernel:  # \"topk\", and \"error\" (whose flagged rows raise below; masked rows select)\n"
      "            padding = \"empty\"",
      ("tests/test_megatron_select.py", "-k", "flagged_rows"),
      "Megatron router: masked and padding rows not selected inside the gate"),
    M("M334", "replay_ops/integrations/megatron/router.py",
      "        elif in_kernel:  # \"topk\", and \"error\" (whose flagged rows raise below; masked rows select)\n"
      "            padding = \"select\"",
      "        elif in_kernel:  # \"topk\", and \"error\" (whose flagged rows raise below; masked rows select)\n"
      "            padding = \"select\"\n"
      "            fallback = self.own_topk(logits.detach()) if keep is not None else None",
      ("tests/test_megatron_select.py", "-k", "one_op"),
      "Megatron router: a top-k of every row before the gate again (masked rows)"),
    M("M335", "replay_ops/integrations/megatron/router.py",
      "                         agreement=opts.agreement)",
      "                         agreement=False)",
      ("tests/test_megatron_select.py", "-k", "agreement"),
      "Megatron router: ReplayOptions(agreement=True) ignored"),
    M("M336", "replay_ops/integrations/megatron/router.py",
      "        return int((self.last_agreement & self._last_replayed).sum()) / n",
      "        return int(self.last_agreement.sum()) / self.last_agreement.numel()",
      ("tests/test_megatron_select.py", "-k", "agreement"),
      "Megatron router: agreement_fraction counts the rows it selected itself"),
    M("M337", "replay_ops/options.py",
      "                both = [k for k in fields if k in kwargs]",
      "                both = [k for k in fields if k in kwargs\n"
      "                        and kwargs[k] != getattr(DEFAULTS, k)]",
      ("tests/test_options.py", "-k", "explicit_keyword"),
      "gate: an explicit keyword at its default beside options= dropped in silence"),
    M("M338", "replay_ops/router_replay/replay.py",
      "            agree = (agreement & replayed).sum()",
      "            agree = agreement.sum()",
      ("tests/test_router_replay_agreement.py", "-k", "replayed_tokens_only"),
      "RouterReplay.agreement: tokens not replayed counted as agreeing"),
    M("M339", "replay_ops/router_replay/replay.py",
      "                               return_agreement=self.config.agreement",
      "                               return_agreement=False",
      ("tests/test_router_replay_agreement.py",),
      "RouterReplay: config.agreement ignored by route"),
    M("M340", "replay_ops/router_replay/replay.py",
      "        self._replayed = False  # a REPLAY_FORWARD ran since the recording started\n",
      "        self._replayed = False  # a REPLAY_FORWARD ran since the recording started\n"
      "        self._agreement = {}\n",
      ("tests/test_router_replay_agreement.py", "-k", "replayed_tokens_only"),
      "RouterReplay: clear() forgets the agreement counts of the run"),
    M("M341", "replay_ops/demo/report.py",
      "    agree = r.get(\"agreement_per_layer\")",
      "    agree = None",
      ("tests/test_demo.py", "-k", "agreement"),
      "demo report: the per-layer agreement not printed"),
    M("M342", "replay_ops/integrations/megatron/router.py",
      "                       selection=megatron_selection(config, sf, expert_bias), **more)",
      "                       selection=megatron_selection(config, sf), **more)",
      ("tests/test_megatron_select.py", "-k", "gate_semantics or sigmoid-bias"),
      "gate_semantics: the router's expert bias not passed to the selection"),
    M("M343", "replay_ops/router_replay/replay.py",
      "            if self.config.agreement and not opts.return_agreement:",
      "            if False:",
      ("tests/test_router_replay_agreement.py", "-k", "options_as_one_value"),
      "RouterReplay.route(options=): config.agreement ignored"),
    M("M344", "replay_ops/integrations/megatron/router.py",
      "        self._last_replayed = None if dense.agreement is None else dense.row_flags == 0",
      "        self._last_replayed = None if dense.agreement is None else dense.row_flags >= 0",
      ("tests/test_megatron_select.py", "-k", "agreement"),
      "Megatron router: rows selected by the kernel counted as replayed"),
    M("M345", "replay_ops/integrations/megatron/router.py",
      "            padding = \"fallback\" if opts.padding == \"topk\" and fallback is not None else \"empty\"",
      "            padding = \"empty\"",
      ("tests/test_megatron_select.py", "-k", "without_in_kernel"),
      "Megatron router (no in-kernel selection): Megatron's own top-k computed but not used"),

    # ----------------------------------------------------- router replay: padding
    M("M380", "replay_ops/router_replay/replay.py",
      "                               padding=self.config.padding if padding is None else padding,",
      "                               padding=\"empty\" if padding is None else padding,",
      ("tests/test_replay_padding.py",),
      "RouterReplay.route: config.padding ignored (a holed row stays holed)"),
    M("M381", "replay_ops/router_replay/replay.py",
      "            if opts.padding == \"empty\" and self.config.padding != \"empty\":",
      "            if False:",
      ("tests/test_replay_padding.py",),
      "RouterReplay.route: options= at the default padding ignore config.padding"),

    # ----------------------------------------------- the fused gate + permute (gate(hidden=))
    M("M360", "replay_ops/ops.py",
      "    want_hidden = ctx.needs_input_grad[16] and grad_rows is not None",
      "    want_hidden = ctx.needs_input_grad[15] and grad_rows is not None",
      ("tests/test_gate_permute.py",),
      "gate_permute backward: the hidden states' gradient read from the wrong input"),
    M("M361", "replay_ops/backends/torch.py",
      "    return (*out, permute_fwd(hidden, out[5], out[4], num_rows))",
      "    return (*out, permute_fwd(hidden, out[5], out[4], num_rows).flip(0))",
      ("tests/test_gate_permute.py",),
      "torch backend: the fused gate + permute writes the rows in the wrong order"),
    M("M362", "replay_ops/backends/torch.py",
      "            permute_bwd(grad_rows, row_id_map))",
      "            permute_bwd(grad_rows.flip(0), row_id_map))",
      ("tests/test_gate_permute.py",),
      "torch backend: the fused backward sums the wrong rows into the hidden gradient"),
    M("M363", "replay_ops/ops.py",
      "    if fused is not None:\n        return tuple(fused(logits, expert_indices, replay_mask, opts, hidden, num_rows))",
      "    if fused is not None:\n        out = tuple(fused(logits, expert_indices, replay_mask, opts, hidden, num_rows))\n        return (*out[:8], out[8][:, :1].expand_as(out[8]).contiguous())",
      ("tests/test_gate_permute.py",),
      "gate_permute: the fused kernel's rows replaced by their first column"),
    # --------------------------------- the gate backward ops: ids outside [0, E) are no expert
    M("M364", "replay_ops/backends/torch.py",
      "    idx = in_range_or_empty(idx, logits.shape[1])  # an id outside [0, E) is no expert",
      "    pass",
      ("tests/test_selection.py", "-k", "outside_the_row"),
      "torch backend: gate_dense_backward indexes the gradient with an id outside [0, E)"),
    # ------------------------------------ torch backend on CPU: the flagged rows alone
    M("M365", "replay_ops/backends/torch.py",
      '    if x.device.type != "cpu":\n        return torch.where(flagged[:, None], _selected(',
      '    if True:\n        return torch.where(flagged[:, None], _selected(',
      ("tests/test_selection.py", "-k", "ranks_the_flagged"),
      "torch backend on CPU: every row ranked for a few flagged ones"),
    M("M366", "replay_ops/backends/torch.py",
      "        out[rows] = _selected(x[rows], logits_dtype, sf, opts, K)",
      "        out[rows] = _selected(x[rows].flip(0), logits_dtype, sf, opts, K)",
      ("tests/test_selection.py", "-k", "ranks_the_flagged or like_the_reference"),
      "torch backend on CPU: the flagged rows' selections written to the wrong rows"),
    M("M367", "replay_ops/ops.py",
      "    return max(K, sel.group_topk, sel.group_topn(K))",
      "    return K",
      ("tests/test_selection.py", "-k", "selection_lists"),
      "gate ops: the selection's group lists not told to the backends (native CUDA runs "
      "lists past kMaxSelectList)"),
    M("M368", "replay_ops/backends/native.py",
      "    if shape.features and shape.select_list > MAX_TOPK:",
      "    if False:",
      ("tests/test_selection.py", "-k", "pass_the_call_on"),
      "native backend: a CUDA selection with group lists past kMaxSelectList accepted"),
    # ------------------------------------------------------------- gate weights_dtype
    M("M369", "csrc/cpu/gate_cpu.cpp",
      "      for (int64_t k = 0; k < K; ++k) WA[t * K + k] = z[k];",
      "      for (int64_t k = 0; k < K; ++k) WA[t * K + k] = static_cast<scalar_t>(z[k]);",
      ("tests/test_gate.py", "-k", "compute_dtype and native"),
      "native CPU gate: weights_dtype=float32 weights rounded to the logits' dtype"),
    M("M370", "replay_ops/backends/native.py",
      "    return opts.weights_dtype is not None and opts.weights_dtype != logits.dtype",
      "    return False",
      ("tests/test_gate.py", "-k", "compute_dtype and native"),
      "native backend: weights_dtype not passed to the kernels"),
    M("M371", "replay_ops/integrations/hf/block.py",
      "    if spec.weights_fp32 and logits.dtype in (torch.float16, torch.bfloat16):\n"
      "        return torch.float32",
      "    if False:\n        return torch.float32",
      ("tests/test_hf_selection.py", "-k", "weight_dtype"),
      "HF block: a Mixtral block's bf16 logits cast to fp32 for the gate (two casts)"),
    M("M372", "replay_ops/_validate.py",
      "    if weights_dtype != cdt:",
      "    if False:",
      ("tests/test_gate.py", "-k", "compute_dtype and torch"),
      "gate: a weights_dtype other than the logits' or their compute dtype accepted"),

    # ------------------------------------ native CUDA: the selection and agreement features
    M("M350", "replay_ops/backends/native.py",
      "CUDA_FEATURES = True",
      "CUDA_FEATURES = False",
      ("tests/test_selection.py", "tests/test_megatron_select.py", "-k",
       "features_pass_the_call_on or cuda_gate_selects_in_kernel"),
      "native backend: CUDA calls that select or ask for the agreement handed on"),
    M("M351", "replay_ops/backends/native.py",
      "    if shape.features and shape.K > MAX_TOPK:",
      "    if shape.features and shape.K > MAX_TOPK + 1:",
      ("tests/test_selection.py", "tests/test_megatron_select.py", "-k",
       "features_pass_the_call_on or cuda_gate_selects_in_kernel"),
      "native backend: a CUDA selection past the kernels' per-thread lists (K = 33) accepted"),

    # ----------------------------------------------------- HF: logits-only replay
    M("M290", "replay_ops/integrations/hf/families.py",
      "    return Selection.deepseek_v3(expert_bias=gate.e_score_correction_bias,",
      "    return Selection.deepseek_v3(expert_bias=None,",
      ("tests/test_hf_selection.py", "-k", "deepseek"),
      "HF DeepSeek-V3 selection: e_score_correction_bias dropped"),
    M("M291", "replay_ops/integrations/hf/families.py",
      "n_group=int(gate.num_group), topk_group=int(gate.topk_group))",
      "n_group=1, topk_group=int(gate.topk_group))",
      ("tests/test_hf_selection.py", "-k", "deepseek"),
      "HF DeepSeek-V3 selection: group limits dropped"),
    M("M292", "replay_ops/integrations/hf/block.py",
      "    return (action is None or action is ReplayAction.RECORD or patch.own_routing",
      "    return (True or action is ReplayAction.RECORD or patch.own_routing",
      ("tests/test_hf_selection.py", "-k", "no_topk"),
      "HF replay: the router module's own top-k runs in every replayed forward"),
    M("M293", "replay_ops/integrations/hf/block.py",
      "        **({} if spec.selection is None else {\"selection\": spec.selection(gate)}))",
      "        )",
      ("tests/test_hf_selection.py", "-k", "deepseek"),
      "HF replay: the family's selection rule not handed to the gate"),
    M("M294", "replay_ops/integrations/hf/block.py",
      "            patch._agreement[lid] = r.agreement",
      "            pass",
      ("tests/test_hf_selection.py", "-k", "agreement"),
      "HF agreement: the per-layer result not kept on the patch"),
    M("M295", "replay_ops/integrations/hf/block.py",
      "    return logits_fn(gate, hidden_states), None, None",
      "    return type(gate).forward(gate, hidden_states)",
      ("tests/test_hf_selection.py", "-k", "no_topk or router_forward"),
      "HF router forward: the logits-only call runs the router's whole forward"),
    M("M296", "replay_ops/integrations/hf/patch.py",
      "        self.return_agreement = bool(return_agreement)",
      "        self.return_agreement = False",
      ("tests/test_hf_selection.py", "-k", "agreement"),
      "HF agreement: patch_model(return_agreement=True) ignored"),
    M("M297", "replay_ops/integrations/hf/families.py",
      "    elif selection is None:\n        warn(",
      "    elif False:\n        warn(",
      ("tests/test_hf_selection.py", "-k", "registered_family"),
      "register_family(topk=...) without selection: no DeprecationWarning"),
    M("M298", "replay_ops/integrations/hf/block.py",
      "            patch._own[lid] = r.own_indices",
      "            pass",
      ("tests/test_hf_selection.py", "-k", "bitwise"),
      "HF own-routing comparison: the router's own choice not kept"),
    M("M299", "replay_ops/integrations/hf/families.py",
      "        logits = linear_logits\n",
      "        logits = None\n",
      ("tests/test_hf_selection.py", "-k", "registered_family"),
      "register_family: no default logits function (replay runs the router whole)"),
]


def _sandbox(work: Path) -> Path:
    """A copy of the tree laid out as installed, with the built extension."""
    box = work / "tree"
    common = shutil.ignore_patterns(".git", "build", "demo_out", "__pycache__", "*.egg-info",
                                    ".pytest_cache")

    def ignore(folder, names):
        skip = set(common(folder, names))
        if Path(folder).resolve() == (ROOT / "replay_ops").resolve():
            # a checkout may hold the installed place of the kernels (a link or a copy):
            # the sandbox gets its own copy of triton_kernels/ below
            skip.add("triton_kernels")
        return skip

    shutil.copytree(ROOT, box, ignore=ignore)
    shutil.copytree(ROOT / "triton_kernels", box / "replay_ops" / "triton_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return box


def _run(cmd, cwd, timeout, env=None):
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout[-3000:] + p.stderr[-3000:]
    except subprocess.TimeoutExpired:
        return None, "timeout"


def _build(box: Path) -> None:
    rc, out = _run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], box, 1800,
                   dict(os.environ, REPLAY_OPS_CUDA="0", MAX_JOBS=str(os.cpu_count() or 2)))
    if rc != 0:
        raise RuntimeError(f"mutate: the extension did not build:\n{out}")


def _target(box: Path, rel: str) -> Path:
    if rel.startswith("triton_kernels/"):
        return box / "replay_ops" / rel
    return box / rel


def check_mutants(mutants) -> list[str]:
    """The problems of a list of mutants, checked against this checkout before anything
    runs: a duplicate id, a file that does not exist, an `old` text that does not occur
    exactly once in its file, or a `new` text equal to it."""
    problems = []
    seen = set()
    for m in mutants:
        if m.id in seen:
            problems.append(f"{m.id}: the id is used twice")
        seen.add(m.id)
        path = ROOT / m.file
        if not path.is_file():
            problems.append(f"{m.id}: {m.file} does not exist")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            problems.append(f"{m.id}: its original text occurs {n} times in {m.file} "
                            f"(it must occur exactly once): {m.old!r}")
        if m.new == m.old:
            problems.append(f"{m.id}: the mutant changes nothing")
    return problems


def run_mutant(box: Path, m: Mutant, timeout: int) -> tuple[str, float, str]:
    path = _target(box, m.file)
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        return "stale", 0.0, f"the original text occurs {n} times in {m.file}; update the mutant"
    cpp = m.file.startswith("csrc/")
    t0 = time.perf_counter()
    path.write_text(text.replace(m.old, m.new))
    try:
        if cpp:
            _build(box)
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(box))
        rc, out = _run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                        *m.tests], box, timeout, env)
    finally:
        path.write_text(text)
        if cpp:
            _build(box)
    dt = time.perf_counter() - t0
    if rc is None:
        return "killed (timeout)", dt, out
    if rc == 5:
        return "no tests ran", dt, out
    return ("killed" if rc != 0 else "SURVIVED"), dt, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant ids to run")
    ap.add_argument("--python-only", action="store_true",
                    help="every mutant outside csrc/ (no C++ rebuild)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per mutant's tests")
    ap.add_argument("--show", action="store_true",
                    help="print the tests' output for killed mutants too (why they died)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only or ()) - {m.id for m in MUTANTS})
    if unknown:
        ap.error(f"unknown mutant ids: {' '.join(unknown)}")
    chosen = [m for m in MUTANTS if (not args.only or m.id in args.only)
              and not (args.python_only and m.file.startswith("csrc/"))]
    partial = bool(args.only) or args.python_only
    problems = check_mutants(chosen)
    if problems:
        print("mutate: refusing to run; these mutants do not apply to the code as it is "
              "(update their old/new text):", file=sys.stderr)
        for line in problems:
            print("  " + line, file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id}  {m.file:45s} {m.what}")
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="replay_ops_mutate_") as work:
        box = _sandbox(Path(work))
        if any(m.file.startswith("csrc/") for m in chosen) or \
                not list((box / "replay_ops").glob("_C*.so")):
            _build(box)
        rc, out = _run([sys.executable, "-c", "import replay_ops, replay_ops.triton_kernels as t;"
                        " print(replay_ops.__file__, t.__file__)"], box, 120,
                       dict(os.environ, PYTHONPATH=str(box), TRITON_INTERPRET="1"))
        if rc != 0 or str(box) not in out.split()[0] or str(box) not in out.split()[1]:
            raise RuntimeError(f"mutate: the sandbox does not import its own copy: {out}")
        for m in chosen:
            verdict, dt, out = run_mutant(box, m, args.timeout)
            rows.append((m, verdict, dt))
            print(f"{m.id} {verdict:17s} {dt:6.1f} s  {m.what}", flush=True)
            if args.show or verdict in ("SURVIVED", "stale", "no tests ran"):
                print(out, flush=True)
    survived = [m.id for m, v, _ in rows if v != "killed" and not v.startswith("killed")]
    write_results(rows, partial)
    print("wrote", RESULTS)
    return 1 if survived else 0


ROW_HEAD = "| id | file | mutant | result | seconds | tests | run |"


def write_results(rows, partial: bool) -> None:
    """tools/mutation_results.md: one row per mutant of MUTANTS, in its order. A whole run
    writes every row; a partial run replaces the rows of its mutants and keeps the others'
    (a row of a mutant that no run has recorded says so). Text after the table is kept."""
    run = f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC, git {_git_sha()}"
    old_rows, tail = {}, ""
    if partial and RESULTS.exists():
        text = RESULTS.read_text()
        body, sep, tail = text.partition("\n## ")
        tail = sep.lstrip("\n") + tail if sep else ""
        for line in body.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| ") and cells and cells[0] in {m.id for m in MUTANTS}:
                old_rows[cells[0]] = line
    new_rows = {}
    for m, v, dt in rows:
        new_rows[m.id] = (f"| {m.id} | `{m.file}` | {m.what} | {v} | {dt:.0f} | "
                          f"`{' '.join(m.tests)}` | {run} |")
    lines, counts = [], {"killed": 0, "other": [], "none": []}
    for m in MUTANTS:
        line = new_rows.get(m.id) or old_rows.get(m.id)
        if line is None:
            line = f"| {m.id} | `{m.file}` | {m.what} | no result recorded | | `{' '.join(m.tests)}` | |"
        if "| no result recorded |" in line:
            counts["none"].append(m.id)
        elif "| killed" in line:
            counts["killed"] += 1
        else:
            counts["other"].append(m.id)
        lines.append(line)
    head = ["# Mutation testing results", "",
            f"`python tools/mutate.py` (`make mutate`). Last run: {run}, "
            + (f"{len(rows)} mutants (`--only` / `--python-only`; the other rows are from "
               "the runs they name)" if partial else f"all {len(rows)} mutants") + ". "
            f"{len(MUTANTS)} mutants: {counts['killed']} killed"
            + (f", not killed: {', '.join(counts['other'])}" if counts["other"] else "")
            + (f", no result: {', '.join(counts['none'])}" if counts["none"] else "") + ".",
            "", ROW_HEAD, "|---|---|---|---|---|---|---|"]
    out = "\n".join(head + lines) + "\n"
    if tail:
        out += "\n" + tail.rstrip("\n") + "\n"
    tmp = RESULTS.with_name(RESULTS.name + ".tmp")
    tmp.write_text(out)
    tmp.replace(RESULTS)


def _git_sha() -> str:
    rc, out = _run(["git", "rev-parse", "--short=12", "HEAD"], ROOT, 30)
    return out.strip() if rc == 0 else "unknown"


if __name__ == "__main__":
    sys.exit(main())
