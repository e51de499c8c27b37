"""Kernel launches, host syncs and bytes of a piece of PyTorch code, counted on any device
(the CPU included) under a `TorchDispatchMode`.

    from launch_counter import LaunchCounter

    with LaunchCounter() as c:
        probs, routing_map = router.routing(logits)
    print(c.launches, c.syncs, c.bytes, c.summary())

What counts (a model of a GPU run, not a measurement of one):

* A launch: every ATen op that is not a view (`OpOverload.is_view`), not a metadata-only
  op (detach, alias, set_, ...) and not an allocation (empty, empty_like, new_empty,
  empty_strided: the caching allocator launches nothing). `zeros`, `ones`, `full`, `fill_`
  and `zero_` are launches (a memset or fill kernel). An op that only reads device memory
  to the host (`_local_scalar_dense`, behind `.item()`, `bool()`, `int()`) is a sync, not a
  launch.
* replay_ops' ops: the public `replay::*` ops are Python functions registered as custom
  ops; the counter descends into them and counts what they run. Each internal native op
  (`replay_native::*`, the C++/CUDA kernels) counts as one launch. On a GPU the native
  gate is one launch (a cooperative launch; three launches where the device cannot launch
  cooperative kernels) and every other native op one.
* A host sync: the ops whose result the host must read (`_local_scalar_dense`,
  `nonzero`, `masked_select`, `unique`, `repeat_interleave`, `equal`, indexing with a bool
  mask), and the Python-level reads that do not dispatch (`Tensor.tolist`, `.numpy`,
  `.cpu`).
* Bytes: for each launch, the bytes of every tensor argument (read) plus the bytes of every
  tensor result (written). A tensor's bytes are its element size times the product of its
  sizes over the dimensions with a non-zero stride (an expanded tensor is read once).
  Ops that only write (fills, `zeros`) count their result alone; `copy_` counts source and
  destination once each. At 3 TB/s and 4 us per launch, `model_us` turns the counts into
  an H100-like time.

Backward ops are counted on the CPU and on a GPU: on a GPU autograd runs the backward on its
own device thread, and PyTorch carries the dispatch-mode stack there (bench_megatron.py
refuses a count whose backward added no launch, in case a version does not).
"""
from __future__ import annotations

import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from replay_ops.testing.checks import HOST_READ_OPS

# ATen ops that read device memory to the host.
SYNC_OPS = HOST_READ_OPS
# Allocation and metadata ops: no kernel runs.
NO_KERNEL = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
             "detach", "alias", "lift_fresh", "set_", "resize_", "_local_scalar_dense",
             "_to_copy_meta", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "is_same_size", "_has_compatible_shallow_copy_type",
             # a Python number made a 0-dim CPU tensor (torch.where(c, x, 0.0)): no kernel
             "scalar_tensor")
# Ops that write their result without reading an input tensor's values.
WRITE_ONLY = ("zeros", "zeros_like", "ones", "ones_like", "full", "full_like", "fill_",
              "zero_", "new_zeros", "new_ones", "new_full", "arange")
# Namespaces of replay_ops: the public Python ops are descended into, the native ones are
# leaf kernels.
DESCEND = ("replay",)

# The H100-like cost model of the docs: 4 us per launch, 3 TB/s (bytes read + written).
LAUNCH_US = 4.0
BYTES_PER_US = 3.0e6


def tensor_bytes(t: torch.Tensor) -> int:
    """Element size times the product of the sizes over dimensions with a non-zero stride."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class LaunchCounter(TorchDispatchMode):
    """Counts launches, host syncs and bytes inside a `with` block (see the module doc).

    `.launches`, `.syncs`, `.bytes`; `.ops` is a Counter of the launches by op name,
    `.sync_events` lists the syncs in order."""

    def __init__(self):
        super().__init__()
        self.launches = 0
        self.bytes = 0
        self.ops: collections.Counter = collections.Counter()
        self.op_bytes: collections.Counter = collections.Counter()
        self.sync_events: list[str] = []
        self._patched: list = []

    @property
    def syncs(self) -> int:
        return len(self.sync_events)

    def model_us(self) -> float:
        return self.launches * LAUNCH_US + self.bytes / BYTES_PER_US

    def summary(self) -> str:
        ops = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in sorted(self.ops.items()))
        return (f"{self.launches} launches, {self.syncs} syncs, {self.bytes / 1e6:.2f} MB: "
                f"{ops}" + (f"; syncs: {self.sync_events}" if self.sync_events else ""))

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        name = func.overloadpacket.__name__
        if ns in DESCEND:
            # A Python op registered with torch.library: run its CPU/CUDA kernel with this
            # mode on again, so the ops it runs are counted (the op itself launches nothing).
            impl = _python_impl(func)
            if impl is not None:
                with self:
                    return impl(*args, **kwargs)
        if ns == "aten" and (name in SYNC_OPS or (name in ("index", "index_put", "index_put_")
                                                   and _bool_index(args))):
            self.sync_events.append(f"aten.{name}")
        out = func(*args, **kwargs)
        if ns == "aten" and (func.is_view or name in NO_KERNEL):
            return out
        self.launches += 1
        key = f"{ns}.{name}" if ns != "aten" else name
        self.ops[key] += 1
        nbytes = self._op_bytes(name, args, kwargs, out)
        self.bytes += nbytes
        self.op_bytes[key] += nbytes
        return out

    @staticmethod
    def _op_bytes(name, args, kwargs, out) -> int:
        outs = sum(tensor_bytes(t) for t in _tensors(out))
        if name in WRITE_ONLY:
            return outs
        ins = _tensors((args, kwargs))
        if name == "copy_":  # destination written once, source read once
            return sum(tensor_bytes(t) for t in ins)
        return outs + sum(tensor_bytes(t) for t in ins)

    # ------------------------------------------------------------------ python-level reads
    _depth = 0

    def __enter__(self):
        self._depth += 1
        if not self._patched:
            for meth in ("tolist", "numpy", "cpu"):
                orig = getattr(torch.Tensor, meth)

                def wrapper(t, *a, _orig=orig, _meth=meth, **kw):
                    if not self._in_read:
                        self.sync_events.append(f"Tensor.{_meth}")
                    with self._reading():
                        return _orig(t, *a, **kw)

                self._patched.append((meth, orig))
                setattr(torch.Tensor, meth, wrapper)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:  # the outermost block (the mode re-enters itself per replay op)
            for meth, orig in self._patched:
                setattr(torch.Tensor, meth, orig)
            self._patched = []
        return out

    _in_read = False

    @contextlib.contextmanager
    def _reading(self):
        prev, self._in_read = self._in_read, True
        try:
            yield
        finally:
            self._in_read = prev


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _python_impl(func):
    """The Python function behind a `torch.library.custom_op` (None for a C++ op)."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(f"{func.namespace}::{func._opname}")
    return None if opdef is None else opdef._init_fn


def count(fn, *args, **kwargs) -> tuple[LaunchCounter, object]:
    """(the counter, fn's result) for one call of fn."""
    with LaunchCounter() as c:
        out = fn(*args, **kwargs)
    return c, out


def counts(fn) -> dict:
    """One call of fn counted: launches, host syncs, bytes, the modelled time, and the ops
    with their counts and bytes. A provider with a `prepare` attribute has it run first,
    uncounted; one with a `counted` attribute has that part counted instead of the whole."""
    prepare = getattr(fn, "prepare", None)
    if prepare is not None:
        prepare()
    with LaunchCounter() as c:
        getattr(fn, "counted", fn)()
    return {"launches": c.launches, "syncs": c.syncs, "bytes": c.bytes,
            "model_us": round(c.model_us(), 2), "ops": dict(c.ops), "op_bytes": dict(c.op_bytes)}


def ops_str(ops: dict, n: int | None = None) -> str:
    """The ops most launched first (then by name), `name xN` when launched more than once;
    the first n of them, or all."""
    ranked = sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    return ", ".join(f"{k} x{v}" if v > 1 else k for k, v in ranked)
