"""Every deprecated name warns once, with its new name, at the caller's line.

Python's default filters show a DeprecationWarning only where it is attributed to the code
being run; one attributed to replay_ops' own files is hidden from the user who must change
their code. Each case below is a one-line lambda in this file: its warning must point at
that line. The cases cover every kind of deprecated name (module attribute, through a
package's own `__getattr__` too; keyword argument; attribute; function; module), and every
deprecated name of the package (the inventory test below keeps the table complete)."""
from __future__ import annotations

import ast
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import replay_ops
from replay_ops.integrations import hf
from replay_ops.integrations.hf import block as hf_block_mod
from replay_ops.integrations.hf import patch as hf_patch
from replay_ops.integrations.megatron import data as md
from replay_ops.router_replay import ModelShape, adapters, codec
from replay_ops.router_replay.adapters import batch as adapters_batch

SHAPE = ModelShape(8, 2, (0, 1), 2)
ROUTED = [torch.tensor([[[0, 1], [2, 3]]] * 3)]
META = [{"routed_experts": adapters.encode_sglang(ROUTED[0])}]
LENS = [8, 8]


def _routes():
    return [torch.tensor([[[0, 1], [2, 3]]] * n) for n in LENS]


def _packed():
    return md.pack_megatron_thd(_routes(), LENS, align=4)


def _block_routing():
    z = torch.zeros(2, 2)
    return hf_block_mod.BlockRouting(z, z, z, z, z.long(), None, False)


def _unload(name):
    sys.modules.pop(name, None)
    return name


def _megatron():
    from replay_ops.integrations import megatron
    return megatron


def _router_slot():
    with warnings.catch_warnings():  # megatron-core's own warnings when it is first imported
        warnings.simplefilter("ignore")
        from replay_ops.integrations.megatron.layers import RouterSlot
    return RouterSlot(None, "r", 2, False, None, 0)


def _replay_router():
    """A ReplayTopKRouter without its module state: enough for its own top-k."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from replay_ops.integrations.megatron.router import ReplayTopKRouter
    r = ReplayTopKRouter.__new__(ReplayTopKRouter)
    cfg = types.SimpleNamespace(moe_router_pre_softmax=False, moe_router_group_topk=None)
    r.__dict__.update(config=cfg, score_function="softmax", topk=2, expert_bias=None)
    return r


# (id, the call that warns: a lambda on one line, the line its warning must point at)
CASES = [
    # module attributes
    ("router_replay.ModelLayout", lambda: replay_ops.router_replay.ModelLayout),
    ("adapters.ModelLayout", lambda: adapters.ModelLayout),
    ("adapters.batch.ModelLayout", lambda: adapters_batch.ModelLayout),
    ("hf.MoELayout", lambda: hf.MoELayout),
    ("hf.moe_layout", lambda: hf.moe_layout),
    ("hf.patch.MoELayout", lambda: hf_patch.MoELayout),
    ("megatron.PackedRouting", lambda: _megatron().PackedRouting),
    ("megatron.CP_LAYOUTS", lambda: _megatron().CP_LAYOUTS),
    ("megatron.data.PackedRouting", lambda: md.PackedRouting),
    ("megatron.data.CP_LAYOUTS", lambda: md.CP_LAYOUTS),
    # keyword arguments
    ("vllm_batch(layout_kind=)", lambda: adapters.vllm_batch(ROUTED, [2], [2], SHAPE, layout_kind="thd")),
    ("sglang_batch(layout_kind=)", lambda: adapters.sglang_batch(META, [4], [2], SHAPE, layout_kind="thd")),
    ("vllm_batch(layout=)", lambda: adapters.vllm_batch(ROUTED, [2], [2], layout=SHAPE, packing="thd")),
    ("vllm_sequences(layout=)", lambda: adapters.vllm_sequences(ROUTED, [2], [2], layout=SHAPE)),
    ("sglang_batch(layout=)", lambda: adapters.sglang_batch(META, [4], [2], layout=SHAPE, packing="thd")),
    ("sglang_sequences(layout=)", lambda: adapters.sglang_sequences(META, [4], layout=SHAPE)),
    ("MultiTurnRouting(layout=)", lambda: adapters.MultiTurnRouting(layout=SHAPE)),
    ("cp_split(layout=)", lambda: md.cp_split(_packed(), 2, 0, layout="contiguous")),
    ("cp_partition_index(layout=)", lambda: md.cp_partition_index([0, 8], 2, 1, layout="zigzag")),
    # attributes
    ("MultiTurnRouting.layout", lambda: adapters.MultiTurnRouting(SHAPE).layout),
    ("ReplayBatch.cp_layout", lambda: md.cp_split(_packed(), 2, 0, "contiguous").cp_layout),
    ("ChunkInfo.layout", lambda: codec.info(codec.encode(ROUTED[0], num_experts=8)).chunks[0].layout),
    ("ReplayPatch.layout", lambda: hf_patch.ReplayPatch.layout.fget(types.SimpleNamespace(moe=1))),
    ("BlockRouting.native_weights", lambda: _block_routing().native_weights),
    ("BlockRouting.native_indices", lambda: _block_routing().native_indices),
    # functions
    ("megatron.pack_thd", lambda: _megatron().pack_thd(_routes(), LENS, align=4)),
    ("hf.native_topk", lambda: hf.native_topk("mixtral", types.SimpleNamespace(top_k=2), torch.randn(3, 8))),
    ("RouterSlot.column", lambda: _router_slot().column("moe", [2], 3)),
    ("ReplayTopKRouter.native_topk", lambda: _replay_router().native_topk(torch.randn(3, 8))),
    # modules
    ("integrations.hf_block", lambda: __import__(_unload("replay_ops.integrations.hf_block"))),
    ("distributed.hf", lambda: __import__(_unload("replay_ops.distributed.hf"))),
    ("router_replay.adapters.layout", lambda: __import__(_unload("replay_ops.router_replay.adapters.layout"))),
]


@pytest.mark.parametrize("who, call", CASES, ids=[c[0] for c in CASES])
def test_the_warning_points_at_the_callers_line(who, call):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        call()
    dep = [w for w in got if issubclass(w.category, DeprecationWarning)
           and "deprecated" in str(w.message)]
    assert len(dep) == 1, (who, [str(w.message) for w in dep])
    w = dep[0]
    assert (Path(w.filename).resolve(), w.lineno) == (Path(__file__).resolve(),
                                                      call.__code__.co_firstlineno), \
        (who, str(w.message), w.filename, w.lineno)
    assert "use" in str(w.message) or "import" in str(w.message), str(w.message)


def test_default_filters_show_the_warning_to_a_script():
    """Run as a script under Python's default filters, the user sees the warning."""
    import subprocess

    code = "import replay_ops.router_replay as rr\nrr.ModelLayout\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in __import__("os").environ.items()
                                           if k != "PYTHONWARNINGS"})
    assert out.returncode == 0, out.stderr
    assert "<string>:2: DeprecationWarning: replay_ops.router_replay.ModelLayout is " \
           "deprecated; use ModelShape" in out.stderr, out.stderr


def test_every_deprecation_goes_through_the_one_helper():
    """No file of the package warns DeprecationWarning itself: each deprecated name uses
    replay_ops._deprecated, which points the warning at the caller."""
    root = Path(replay_ops.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_deprecated.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Name) and node.id == "DeprecationWarning":
                bad.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    assert bad == []


def _deprecated_names_in_package() -> set[str]:
    """The old names the package deprecates, read from its uses of replay_ops._deprecated."""
    root = Path(replay_ops.__file__).parent
    names = set()
    for path in sorted(root.rglob("*.py")):
        if path.name == "_deprecated.py":
            continue
        tree = ast.parse(path.read_text(), str(path))
        dicts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Dict)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                    getattr(node.value.func, "id", None) in ("deprecated_property",
                                                             "deprecated_function"):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            args = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if node.func.id == "deprecated_names":
                table = node.args[1]
                if isinstance(table, ast.Name):
                    table = dicts[table.id]
                elif isinstance(table, ast.Attribute):  # another module's table (re-export)
                    continue
                names.update(k.value for k in table.keys)
            elif node.func.id == "deprecated_module":
                names.add(args[0])
            elif node.func.id == "renamed_keyword":
                names.add(f"{args[0]}=")
            elif node.func.id == "resolve_renamed":  # (who, old, new, ...)
                names.add(f"{node.args[1].value}=")
    return names


def test_the_table_names_every_deprecated_name():
    """Each name the package deprecates has a case above, so a new one cannot skip the check."""
    ids = " ".join(c[0] for c in CASES)
    missing = []
    for name in sorted(_deprecated_names_in_package()):
        short = name.removeprefix("replay_ops.")
        if short not in ids and f".{name}" not in ids and f"{name})" not in ids:
            missing.append(name)
    assert missing == []
