"""Names kept for one release after a rename: a module's `__getattr__` that returns the new
object under the old name and warns (DeprecationWarning) with the new name."""
from __future__ import annotations

import warnings


def deprecated_names(module: str, renamed: dict):
    """A module `__getattr__` for `renamed` {old name: (new name, the object)}."""

    def __getattr__(name: str):
        if name in renamed:
            new, value = renamed[name]
            warnings.warn(f"{module}.{name} is deprecated; use {new}", DeprecationWarning,
                          stacklevel=2)
            return value
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def renamed_keyword(old: str, new: str, who: str):
    """A decorator for a function whose argument `old` is now `new`: `old=` still works for
    one release, with a DeprecationWarning naming the new name (both at once is refused)."""
    import functools

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{who}: got both {old}= (deprecated) and {new}=")
                warnings.warn(f"{who}: the argument {old}= is deprecated; use {new}=",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return wrapper

    return decorate
