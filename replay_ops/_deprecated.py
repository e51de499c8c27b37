"""Names kept for one release after a rename, deprecated one way.

Every deprecated name warns through `warn`, which attributes the DeprecationWarning to the
caller's line: the first frame outside replay_ops (and outside Python's import machinery).
Python's default filters show a DeprecationWarning only where it is attributed to the code
being run (`__main__`); a warning attributed to replay_ops' own files would be hidden from
the user whose code needs the change.

The kinds of deprecated name, each with its helper:

    module attribute   __getattr__ = deprecated_names(__name__, {old: (new, object)})
    keyword argument   @renamed_keyword(old, new, who), or resolve_renamed(...) inline
    attribute          old = deprecated_property("new", "Class.old")
    function           old = deprecated_function(new_fn, "module.old", "module.new")
    module             deprecated_module("old.module", "new.module") in the old module's body

tests/test_deprecations.py triggers every deprecated name and checks where its warning points.
"""
from __future__ import annotations

import functools
import sys
import warnings

_PACKAGE = __name__.split(".")[0]


def _outside(frame) -> bool:
    """Whether a frame is the caller's: neither the package nor Python's import machinery
    (importlib, its frozen bootstrap included)."""
    name = frame.f_globals.get("__name__", "") or ""
    return not any(name == top or name.startswith(top + ".") for top in (_PACKAGE, "importlib"))


def warn(message: str) -> None:
    """Warn (DeprecationWarning) at the caller's line: the first frame outside the package."""
    frame = sys._getframe(1)
    while frame is not None and not _outside(frame):
        frame = frame.f_back
    if frame is None:  # only the package on the stack (e.g. a deprecated name used inside it)
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        return
    g = frame.f_globals
    warnings.warn_explicit(message, DeprecationWarning, frame.f_code.co_filename,
                           frame.f_lineno, module=g.get("__name__", "<unknown>"),
                           registry=g.setdefault("__warningregistry__", {}))


def deprecated_names(module: str, renamed: dict):
    """A module `__getattr__` for `renamed` {old name: (new name, the object)}."""

    def __getattr__(name: str):
        if name in renamed:
            new, value = renamed[name]
            warn(f"{module}.{name} is deprecated; use {new}")
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def resolve_renamed(who: str, old: str, new: str, old_value, new_value, default=None):
    """The value of an argument renamed from `old` to `new`, for a function that still takes
    `old=` (None when not given): `old=` warns, and both at once must agree."""
    if old_value is None:
        return default if new_value is None else new_value
    warn(f"{who}({old}=...) is deprecated; use {new}=")
    if new_value is not None and new_value != old_value:
        raise ValueError(f"{who}: {new}={new_value!r} and {old}={old_value!r} disagree")
    return old_value


def renamed_keyword(old: str, new: str, who: str):
    """A decorator for a function whose argument `old` is now `new`: `old=` still works for
    one release, with a DeprecationWarning naming the new name (both at once is refused)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{who}: got both {old}= (deprecated) and {new}=")
                warn(f"{who}: the argument {old}= is deprecated; use {new}=")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate


def deprecated_property(new: str, old_qualname: str) -> property:
    """A read-only attribute `old_qualname` ("Class.old") that returns `self.<new>` and warns."""
    cls = old_qualname.rsplit(".", 1)[0]

    def get(self):
        warn(f"{old_qualname} is deprecated; use {cls}.{new}")
        return getattr(self, new)

    get.__doc__ = f"Deprecated name of `{new}` (one release)."
    return property(get)


def deprecated_function(fn, old: str, new: str, note: str = ""):
    """`fn` under its old name `old`, warning with its new name `new` at each call."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        warn(f"{old} is deprecated; use {new}{note}")
        return fn(*args, **kwargs)

    wrapper.__doc__ = f"Deprecated alias of `{new}` (one release)."
    return wrapper


def deprecated_module(old: str, new: str) -> None:
    """Called in the body of the module `old`, now `new`: warns when it is first imported."""
    warn(f"{old} is deprecated; import {new} instead")
