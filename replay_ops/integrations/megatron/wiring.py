"""Installing the replay router in a Megatron-Core model: `replay_spec` (a layer spec before
the model is built) and `install` (a model already built). Both set the router
(`router.ReplayTopKRouter`) and, where it applies, the plan dispatcher
(`dispatcher.ReplayMoELayer`, `dispatcher.use_plan_dispatcher`); this module imports both,
and neither of them imports it.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.router import TopKRouter

from .dispatcher import ReplayMoELayer, use_plan_dispatcher
from .router import (
    ReplayOptions,
    ReplayTopKRouter,
    UnsupportedConfigError,
    check_config,
    replay_router,
)

__all__ = ["install", "replay_spec"]


def replay_spec(spec, options: ReplayOptions | None = None, **kwargs):
    """Set the router of every MoE layer in a Megatron spec (a layer spec, a decoder
    block spec, an MTP block spec, or lists of them) to the replay router, and its layer
    class to `ReplayMoELayer` (Megatron's MoELayer that switches to the plan dispatcher
    wherever it applies, unless `plan_dispatch=False`). The spec is changed in place and
    returned (a new object only where megatron-core >= 0.17 holds the layer as a
    functools.partial at the top). Raises if the spec has no MoE layer."""
    builder = replay_router(options, **kwargs)
    mtp_builder = functools.partial(_as_partial(builder), is_mtp_layer=True)
    found = []
    done: dict = {}

    # Megatron's MTP block spec holds the decoder's own layer spec objects (its
    # `transformer_layer` is the spec it was given), so the MTP routers' builder must not
    # be written into shared objects: below an MTP spec, the objects that are not the MTP
    # block's own are copied before a router is replaced in them (copy on write).
    def walk(obj, in_mtp: bool, parent_inplace: bool):
        if obj is None or isinstance(obj, (str, int, float, bool, type)):
            return obj
        key = (id(obj), in_mtp)
        if key in done:
            return done[key]
        done[key] = obj  # cycles end here
        mtp_here = _is_mtp_spec(obj)
        in_mtp = in_mtp or mtp_here
        container = isinstance(obj, (list, tuple))
        inplace = (not in_mtp) or mtp_here or (container and parent_inplace)
        out = obj
        if isinstance(obj, MoESubmodules):
            router = obj.router
            if router is not TopKRouter and not _is_replay_builder(router):
                raise UnsupportedConfigError(
                    f"replay_spec: an MoE spec uses router {router!r}; only Megatron's "
                    f"TopKRouter is replaced (a custom router would lose its own routing)")
            want = mtp_builder if in_mtp else builder
            if inplace:
                obj.router = want
            else:
                out = dataclasses.replace(obj, router=want)
            found.append(out)
        elif container:
            items = [walk(o, in_mtp, inplace) for o in obj]
            if any(a is not b for a, b in zip(items, obj)):
                if isinstance(obj, list) and inplace:
                    obj[:] = items
                else:
                    out = type(obj)(items) if isinstance(obj, list) else tuple(items)
        elif isinstance(obj, functools.partial):  # megatron-core >= 0.17: partial(MoELayer, ...)
            args = [walk(o, in_mtp, inplace) for o in obj.args]
            kw = {k: walk(v, in_mtp, inplace) for k, v in obj.keywords.items()}
            func = obj.func
            if func is MoELayer and any(isinstance(v, MoESubmodules)
                                        for v in [*args, *kw.values()]):
                func = ReplayMoELayer  # the plan dispatcher where it applies
            if func is not obj.func or any(a is not b for a, b in zip(args, obj.args)) or \
                    any(kw[k] is not v for k, v in obj.keywords.items()):
                if inplace and args == list(obj.args) and func is obj.func:
                    obj.keywords.update(kw)
                else:
                    out = functools.partial(func, *args, **kw)
        else:
            names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) \
                else (["submodules"] if getattr(obj, "submodules", None) is not None else [])
            new = {n: walk(getattr(obj, n), in_mtp, inplace) for n in names}
            changed = {n: v for n, v in new.items() if v is not getattr(obj, n)}
            if getattr(obj, "module", None) is MoELayer and \
                    isinstance(new.get("submodules"), MoESubmodules):
                changed["module"] = ReplayMoELayer  # the plan dispatcher where it applies
            if changed:
                if not inplace:
                    out = copy.copy(obj)
                for n, v in changed.items():
                    object.__setattr__(out, n, v)
        done[key] = out
        return out

    out = walk(spec, False, True)
    if not found:
        raise UnsupportedConfigError("replay_spec: the spec has no MoE layer (no MoESubmodules)")
    return out


def _is_replay_builder(b) -> bool:
    return b is ReplayTopKRouter or (isinstance(b, functools.partial) and b.func is ReplayTopKRouter)


def _as_partial(builder) -> functools.partial:
    return builder if isinstance(builder, functools.partial) else functools.partial(builder)


def _is_mtp_spec(obj) -> bool:
    """A spec (ModuleSpec or submodules dataclass) of Megatron's multi-token prediction
    block or layer: the MoE routers below it are MTP routers."""
    names = [type(obj).__name__]
    module = obj.func if isinstance(obj, functools.partial) else getattr(obj, "module", None)
    if isinstance(module, type):
        names.append(module.__name__)
    return any(n.startswith("MultiTokenPrediction") for n in names)


def _mtp_router_names(chunk) -> set:
    prefixes = [name for name, m in chunk.named_modules()
                if name and type(m).__name__.startswith("MultiTokenPrediction")]
    return {name for name, m in chunk.named_modules()
            if isinstance(m, TopKRouter) and any(name.startswith(p + ".") for p in prefixes)}


def install(model, options: ReplayOptions | None = None, **kwargs) -> list:
    """Turn every Megatron `TopKRouter` of an already built model (a module or a list of
    virtual-pipeline chunks) into a `ReplayTopKRouter`, in place: same parameters, buffers
    and `router_replay` object; with `plan_dispatch` (the default) the all-to-all
    dispatchers switch to the plan dispatcher wherever it applies. Returns the routers. Raises on a router subclass that is
    not Megatron's own (its routing would be lost) and on unsupported configs."""
    if options is None:
        options = ReplayOptions(**kwargs)
    elif kwargs:
        options = dataclasses.replace(options, **kwargs)
    chunks = model if isinstance(model, (list, tuple)) else [model]
    routers = []
    for chunk in chunks:
        mtp = _mtp_router_names(chunk)
        for name, m in chunk.named_modules():
            if isinstance(m, ReplayTopKRouter):
                m.replay_options = options
                m.is_mtp_layer = bool(getattr(m, "is_mtp_layer", False)) or name in mtp
                routers.append(m)
            elif type(m) is TopKRouter:
                check_config(m.config, where=f"install({name})")
                m.__class__ = ReplayTopKRouter
                m.replay_options = options
                m.is_mtp_layer = bool(getattr(m, "is_mtp_layer", False)) or name in mtp
                m.last_plan = None
                m._last_routing_map = None
                routers.append(m)
            elif isinstance(m, TopKRouter):
                raise UnsupportedConfigError(
                    f"install: {name} is a {type(m).__name__}, a TopKRouter subclass that is not "
                    f"Megatron's own; replacing it would drop its routing")
    if not routers:
        raise UnsupportedConfigError("install: the model has no TopKRouter (no MoE layer)")
    if options.plan_dispatch:  # the plan dispatcher wherever it applies
        for chunk in chunks:
            for m in chunk.modules():
                if isinstance(m, MoELayer):
                    use_plan_dispatcher(m)
    return routers
