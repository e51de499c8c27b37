"""The Hugging Face path: a whole `transformers` MoE model's forward + backward under
replay_ops R3 against the same model unpatched (its own routing and experts), in the same
run. Launches and host syncs are counted with launch_counter.py, beside CPU (or GPU) times;
the targets of the replayed HF path are marked met or missed.

    python bench/bench_hf.py --out cpu_2core_hf

Cases (random weights, built locally; --cases picks some):

* `qwen3`: Qwen3-MoE, 2 layers, batch 4 x 512 tokens, hidden 256, 64 experts, top-8,
  expert FFN 128.
* `mixtral`: Mixtral-like, 2 layers, batch 2 x 256 tokens, hidden 1024, 8 experts, top-2,
  expert FFN 512 (smaller than Mixtral's FFN so that a 2-core CPU runs it in seconds).

Providers, each one forward + backward of the whole model (loss: cross-entropy of the next
token; gradients of every parameter):

* `unpatched grouped_mm`: the unpatched model, `config._experts_implementation="grouped_mm"`,
  its own routing.
* `unpatched eager`: the same with "eager" (about 10x slower: timed on its own,
  `--eager-reps` calls, not interleaved with the others).
* `replay_ops R3`: the model patched with `hf.patch_model`, R3 with `validate=False`,
  REPLAY_FORWARD of the model's own routing for the same batch (set once per
  batch with set_routing: timed with the step, its host read counted apart); experts
  implementation "grouped_mm" (the plan path of replay_ops.integrations.hf.block).
* `replay_ops R3 validate`: the same with `validate=True` (the routing checked once when it
  is set; set_routing is inside the timed call).

Targets (replayed fwd+bwd against unpatched grouped_mm fwd+bwd, same run): launches <= 0.6x,
host syncs == 0 with validate=False, time <= 1.0x (bfloat16); one MoE block's fwd+bwd
launches <= 0.35x, with no top-k, sort, softmax or sigmoid of the router logits in the
replayed block's forward (the router computes its logits only; the gate selects the rows
without a route). A block step starts with its parameters' gradients set to None, as the
whole-model step does (`zero_grad(set_to_none=True)`), so that neither side counts the
accumulation into gradients left by the previous call.

`--compiled`: the same two models, each under `torch.compile` (Inductor), replayed
(`fullgraph=True`) against unpatched grouped_mm, whole model and one MoE block, forward +
backward. A dispatch mode cannot watch compiled code, so launches are counted for both in
the code Inductor generates, in the same way: each call statement of the forward's and the
backward's `call()` (a fused kernel Inductor generated, an extern kernel such as a GEMM, or
an op it left as a call: a custom op, replay_ops' and transformers' grouped_mm fallback
alike, counts one). Targets: <= 1.0x for the whole model, <= 0.6x for a MoE block.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this checkout's replay_ops, not an installed one
sys.path.insert(0, str(HERE))
import harness  # noqa: E402
from launch_counter import LaunchCounter, counts, ops_str  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CASES = {
    "qwen3": dict(arch="qwen3_moe", batch=4, seq=512, hidden_size=256, num_experts=64, top_k=8,
                  expert_size=128),
    "mixtral": dict(arch="mixtral", batch=2, seq=256, hidden_size=1024, num_experts=8, top_k=2,
                    expert_size=512),
}
LAUNCH_RATIO = 0.6
BLOCK_LAUNCH_RATIO = 0.35
TIME_RATIO = 1.0
# ops that select or score every row of the router logits (none may run in a replayed
# block's forward); a sigmoid counts when its input has E columns
SELECTING = ("topk", "sort", "argsort", "msort", "kthvalue", "_softmax", "softmax",
             "log_softmax", "_log_softmax")


def build(case: dict, dtype, device, implementation: str):
    from replay_ops.testing import tiny

    model = tiny.tiny_model(case["arch"], seed=0, num_layers=2, hidden_size=case["hidden_size"],
                            num_experts=case["num_experts"], top_k=case["top_k"],
                            expert_size=case["expert_size"], dtype=dtype)
    model.set_experts_implementation(implementation)
    return model.to(device).train()


def fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out


def own_routing(model, ids):
    """[T, L_moe, K] int32: the model's own routing, what its router picks for `ids` (recorded by replay_ops
    RECORD on a patched copy's forward, no gradient)."""
    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction, RouterReplayConfig

    patch = hf.patch_model(model, RouterReplayConfig(mode="R2"))
    try:
        patch.replay.set_action(ReplayAction.RECORD)
        with torch.no_grad():
            model(input_ids=ids)
        return patch.last_routing()
    finally:
        patch.remove()


def make_providers(case, dtype, device):
    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction, RouterReplayConfig

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (case["batch"], case["seq"]), generator=g).to(device)
    unpatched = {impl: build(case, dtype, device, impl) for impl in ("grouped_mm", "eager")}
    routing = own_routing(unpatched["grouped_mm"], ids)
    fns = {
        "unpatched grouped_mm": lambda: fwd_bwd(unpatched["grouped_mm"], ids),
        "unpatched eager": lambda: fwd_bwd(unpatched["eager"], ids),
    }
    for name, validate in (("replay_ops R3", False), ("replay_ops R3 validate", True)):
        model = build(case, dtype, device, "grouped_mm")
        patch = hf.patch_model(model, RouterReplayConfig(mode="R3", validate=validate))
        patch.replay.set_action(ReplayAction.REPLAY_FORWARD)

        def step(model=model, patch=patch):
            patch.replay.set_routing(routing)
            return fwd_bwd(model, ids)

        # counted without set_routing (once per batch, not per layer: counted on its own)
        step.prepare = lambda patch=patch: patch.replay.set_routing(routing)
        step.counted = lambda model=model: fwd_bwd(model, ids)
        fns[name] = step
    blocks = {name: block_step(fns, name, case, dtype, device, unpatched, routing)
              for name in ("unpatched grouped_mm", "replay_ops R3")}
    return fns, blocks


def block_step(fns, name, case, dtype, device, unpatched, routing):
    """One MoE block's forward + backward (the first MoE layer; input [B, S, H] random),
    on the model of provider `name`: what the MoE layers alone launch."""
    from replay_ops.integrations import hf

    if name.startswith("unpatched"):
        model = unpatched["grouped_mm"]
    else:
        model = fns[name].counted.__defaults__[0]
    lay = hf.find_moe_blocks(model)
    lid = lay.moe_layer_ids[0]
    block = lay.blocks[lid]
    g = torch.Generator().manual_seed(1)
    h = torch.randn(case["batch"], case["seq"], case["hidden_size"], generator=g).to(device,
                                                                                      dtype)
    grad = torch.randn(h.shape, generator=g).to(device, dtype)

    def run():
        block.zero_grad(set_to_none=True)
        x = h.detach().requires_grad_(True)
        block(x).backward(grad)

    def forward():
        with torch.no_grad():
            block(h)

    run.prepare = getattr(fns[name], "prepare", None)
    run.forward = forward
    run.num_experts = case["num_experts"]
    return run


def selecting_ops(block_run) -> list[str]:
    """The top-k, sort, softmax and router-sigmoid ops of one forward of a block step
    (`block_step`), as dispatched (a TorchDispatchMode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    E = block_run.num_experts
    found = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            last = first.shape[-1] if first is not None and first.dim() else None
            if name in SELECTING or (name.startswith("sigmoid") and last == E):
                found.append(name)
            return func(*args, **(kwargs or {}))

    if block_run.prepare is not None:
        block_run.prepare()
    with Log():
        block_run.forward()
    return found


def run(args):
    device, env, copy_bw = harness.start_run(args, "bench_hf")
    rows, summary, targets = [], [], []
    for case_name in args.cases:
        case = CASES[case_name]
        for dtype_name in args.dtype:
            fns, blocks = make_providers(case, DTYPES[dtype_name], device)
            for fn in fns.values():
                fn()  # warm up (and check that every provider runs)
            cnt = {n: counts(f) for n, f in fns.items()}
            bcnt = {n: counts(f) for n, f in blocks.items()}
            r3s = fns["replay_ops R3"]
            with LaunchCounter() as c:
                r3s.prepare()
            set_routing_syncs = c.syncs
            # eager is 10x slower: timed on its own, --eager-reps times (not interleaved)
            fast = {n: f for n, f in fns.items() if n != "unpatched eager"}
            times = harness.median_of_runs([
                harness.measure_interleaved(fast, device, warmup=args.warmup, reps=args.reps)
                for _ in range(args.runs)])
            times["unpatched eager"] = harness.measure_interleaved(
                {"unpatched eager": fns["unpatched eager"]}, device, warmup=0,
                reps=args.eager_reps)["unpatched eager"]
            tag = (f"{case_name} ({case['arch']}, {case['batch']}x{case['seq']} tokens, "
                   f"H={case['hidden_size']}, E={case['num_experts']}, K={case['top_k']}, "
                   f"I={case['expert_size']}) {dtype_name}")
            base = times["unpatched grouped_mm"]["ms_median"]
            for n in fns:
                row = {"case": case_name, "dtype": dtype_name, "provider": n,
                       **{k: v for k, v in cnt[n].items() if k not in ("ops", "op_bytes")}, **times[n],
                       "time_vs_unpatched_grouped_mm": times[n]["ms_median"] / base,
                       "launches_vs_unpatched_grouped_mm":
                           cnt[n]["launches"] / cnt["unpatched grouped_mm"]["launches"]}
                row.pop("run_medians", None)
                rows.append(row)
            r3, nat = cnt["replay_ops R3"], cnt["unpatched grouped_mm"]
            rb, nb = bcnt["replay_ops R3"], bcnt["unpatched grouped_mm"]
            n_moe = 2  # MoE layers of the bench models
            lr = r3["launches"] / nat["launches"]
            tr = times["replay_ops R3"]["ms_median"] / base

            def add(name, value, bound, ok, detail):
                targets.append({"case": f"{case_name} {dtype_name}", "target": name,
                                "value": value, "bound": bound, "met": bool(ok),
                                "detail": detail})

            add("R3 model fwd+bwd launches / unpatched grouped_mm", round(lr, 3),
                f"<= {LAUNCH_RATIO}", lr <= LAUNCH_RATIO,
                f"{r3['launches']} vs {nat['launches']}; of these the model outside its MoE "
                f"blocks launches about {nat['launches'] - n_moe * nb['launches']} "
                f"(unpatched total - {n_moe} x unpatched block)")
            add("R3 fwd+bwd host syncs beyond unpatched grouped_mm's (validate=False)",
                r3["syncs"] - nat["syncs"], "== 0", r3["syncs"] == nat["syncs"],
                f"R3 {r3['syncs']}, unpatched grouped_mm {nat['syncs']} (the model's own, "
                f"outside the MoE blocks); set_routing once per batch: {set_routing_syncs}")
            rb, nb = bcnt["replay_ops R3"], bcnt["unpatched grouped_mm"]
            blr = rb["launches"] / nb["launches"]
            add("R3 MoE block fwd+bwd launches / unpatched grouped_mm block", round(blr, 3),
                f"<= {BLOCK_LAUNCH_RATIO}", blr <= BLOCK_LAUNCH_RATIO,
                f"{rb['launches']} vs {nb['launches']}; R3: {ops_str(rb['ops'], 30)}")
            sel_r3 = selecting_ops(blocks["replay_ops R3"])
            sel_nat = selecting_ops(blocks["unpatched grouped_mm"])
            add("R3 MoE block forward: top-k / sort / router softmax ops", len(sel_r3),
                "== 0", not sel_r3,
                f"R3: {', '.join(sel_r3) or 'none'}; unpatched grouped_mm block: "
                f"{', '.join(sel_nat) or 'none'}")
            add("R3 MoE block fwd+bwd host syncs (validate=False)", rb["syncs"], "== 0",
                rb["syncs"] == 0, f"unpatched grouped_mm block {nb['syncs']}")
            clock = "GPU" if device.startswith("cuda") else "CPU"
            if dtype_name == "bfloat16":
                add(f"R3 fwd+bwd {clock} time / unpatched grouped_mm", round(tr, 3),
                    f"<= {TIME_RATIO}", tr <= TIME_RATIO,
                    f"{times['replay_ops R3']['ms_median']:.1f} ms vs {base:.1f} ms")
            summary.append(
                f"{tag}: R3 {r3['launches']} launches, {r3['syncs']} syncs, "
                f"{times['replay_ops R3']['ms_median']:.1f} ms; unpatched grouped_mm "
                f"{nat['launches']} launches, {nat['syncs']} syncs, {base:.1f} ms; unpatched eager "
                f"{cnt['unpatched eager']['launches']} launches, {cnt['unpatched eager']['syncs']} "
                f"syncs, {times['unpatched eager']['ms_median']:.1f} ms")
    harness.finish_run(args, rows, device, env, copy_bw, targets=targets)
    return rows, summary


# ----------------------------------------------------------------------------- compiled
COMPILED_MODEL_RATIO = 1.0
COMPILED_BLOCK_RATIO = 0.6
_CALL = re.compile(r"^\s+(?:[\w, ]+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|"
                   r"torch\.ops\.\w+\.\w+(?:\.\w+)?|aten\.\w+(?:\.\w+)?)\(", re.M)


def inductor_calls(code: str) -> collections.Counter:
    """The call statements of the `call()` function of one module Inductor generated."""
    body = code[code.index("def call("):]
    end = re.search(r"\n\S", body)  # the next top-level statement
    body = body[:end.start()] if end else body
    kinds = collections.Counter()
    for name in _CALL.findall(body):
        kind = ("generated kernel" if name.startswith(("cpp_fused", "triton_")) else
                "extern kernel" if name.startswith("extern_kernels") else name)
        kinds[kind] += 1
    return kinds


def compiled_counts(fn) -> dict:
    """Launches of `fn` (compiled fwd+bwd) in Inductor's code: compiled on the first call."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(fn)
    total = collections.Counter()
    for code in codes:
        if "def call(" in code:
            total.update(inductor_calls(code))
    return {"launches": sum(total.values()), "graphs": len(codes), "ops": dict(total)}


def run_compiled(args):
    from replay_ops.integrations import hf
    from replay_ops.router_replay import ReplayAction, RouterReplayConfig

    device = args.device
    env = harness.env_info(device)
    rows, summary, targets = [], [], []
    for case_name in args.cases:
        case = CASES[case_name]
        for dtype_name in args.dtype:
            dtype = DTYPES[dtype_name]
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, 256, (case["batch"], case["seq"]), generator=g).to(device)
            unpatched = build(case, dtype, device, "grouped_mm")
            routing = own_routing(unpatched, ids)
            replayed = build(case, dtype, device, "grouped_mm")
            patch = hf.patch_model(replayed, RouterReplayConfig(mode="R3", validate=False))
            patch.replay.set_routing(routing)
            patch.replay.set_action(ReplayAction.REPLAY_FORWARD)
            h = torch.randn(case["batch"], case["seq"], case["hidden_size"],
                            generator=g).to(device, dtype)
            cnt = {}
            for name, model, full in (("unpatched grouped_mm", unpatched, False),
                                      ("replay_ops R3", replayed, True)):
                cmodel = torch.compile(model, fullgraph=full)
                block = hf.find_moe_blocks(model).blocks[hf.find_moe_blocks(model).moe_layer_ids[0]]
                cblock = torch.compile(block, fullgraph=full)

                def model_step(cmodel=cmodel, model=model):
                    model.zero_grad(set_to_none=True)
                    cmodel(input_ids=ids, labels=ids).loss.backward()

                def block_step(cblock=cblock):
                    x = h.detach().requires_grad_(True)
                    cblock(x).float().sum().backward()

                cnt[name] = (compiled_counts(model_step), compiled_counts(block_step))
            for i, what in enumerate(("whole model", "MoE block")):
                r3, nat = cnt["replay_ops R3"][i], cnt["unpatched grouped_mm"][i]
                for n in cnt:
                    c = cnt[n][i]
                    rows.append({"case": case_name, "dtype": dtype_name, "what": what,
                                 "provider": f"{n} (compiled)", "launches": c["launches"],
                                 "inductor_modules": c["graphs"],
                                 "launches_vs_unpatched": c["launches"] / nat["launches"],
                                 "calls": ops_str(c["ops"], 12)})
                bound = COMPILED_MODEL_RATIO if i == 0 else COMPILED_BLOCK_RATIO
                ratio = r3["launches"] / nat["launches"]
                targets.append({
                    "case": f"{case_name} {dtype_name}",
                    "target": f"compiled R3 {what} fwd+bwd launches / compiled unpatched "
                              f"grouped_mm", "value": round(ratio, 3), "bound": f"<= {bound}",
                    "met": bool(ratio <= bound),
                    "detail": f"{r3['launches']} vs {nat['launches']}; R3: "
                              f"{ops_str(r3['ops'], 12)}; unpatched: {ops_str(nat['ops'], 12)}"})
            summary.append(
                f"{case_name} {dtype_name} compiled: whole model R3 "
                f"{cnt['replay_ops R3'][0]['launches']} vs unpatched "
                f"{cnt['unpatched grouped_mm'][0]['launches']} launches; MoE block R3 "
                f"{cnt['replay_ops R3'][1]['launches']} vs unpatched "
                f"{cnt['unpatched grouped_mm'][1]['launches']}")
    args.env, args.copy_bw, args.targets = env, harness.copy_bandwidth(device), targets
    return rows, summary


COMPILED_COLS = ["case", "dtype", "what", "provider", "launches", "inductor_modules",
                 "launches_vs_unpatched", "calls"]

COLS = ["case", "dtype", "provider", "launches", "syncs", "bytes", "model_us", "ms_median",
        "ms_p20", "ms_p80", "time_vs_unpatched_grouped_mm", "launches_vs_unpatched_grouped_mm"]
TARGET_COLS = ["case", "target", "value", "bound", "met", "detail"]


def parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["qwen3", "mixtral"])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16"])
    ap.add_argument("--machine", default=None,
                    help="how to describe the machine in the results (e.g. '2-core shared CPU')")
    ap.add_argument("--eager-reps", type=int, default=1,
                    help="timed calls of the (slow) unpatched eager provider, not interleaved")
    ap.add_argument("--compiled", action="store_true",
                    help="the torch.compile case instead (launches in Inductor's code)")
    harness.add_run_args(ap, reps=5, warmup=1, runs=2)
    return ap


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--compiled" in argv:
        return harness.cli_main(parser, run_compiled, COMPILED_COLS, argv,
                                target_cols=TARGET_COLS, machine=True)
    return harness.cli_main(parser, run, COLS, argv, target_cols=TARGET_COLS, machine=True)


if __name__ == "__main__":
    main()
