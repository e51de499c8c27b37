"""Atomic file writes: the one writer of record files, the demo's outputs and benchmark
results.

A write goes to a temporary file in the target's directory (named after the target and the
writer's pid), is fsynced, then renamed over the target (`os.replace`), and the directory
is fsynced so the rename is durable. A reader sees the old file or the new one, never a
partial one; a writer that fails removes its temporary file, and one that is killed leaves
it behind for the next writer of the same target to remove (its pid no longer exists). The
new file gets the mode a plain `open()` would give it (0666 & ~umask), or the mode of the
file it replaces.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_target(path) -> Iterator[str]:
    """The path of a temporary file next to `path`; write it inside the block. On leaving
    the block it is fsynced and renamed over `path`; on an exception it is removed."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_stale_temps(d, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-{os.getpid()}-", dir=d)
    os.close(fd)
    try:
        os.chmod(tmp, _mode_for(path))
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename durable
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def atomic_write(path, data: bytes | str) -> None:
    """Write `data` (text is UTF-8 encoded) to `path` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    with atomic_target(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)


def _mode_for(path: str) -> int:
    # mkstemp creates 0600; give the file the mode a plain open() would (0666 & ~umask),
    # or the existing file's mode when it is replaced
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _remove_stale_temps(d: str, base: str) -> None:
    """Temporaries left by writers that were killed (their pid no longer exists)."""
    prefix = f".{base}.tmp-"
    with contextlib.suppress(OSError):
        for name in os.listdir(d):
            if not name.startswith(prefix):
                continue
            try:
                pid = int(name[len(prefix):].split("-", 1)[0])
            except ValueError:
                continue
            if pid != os.getpid() and not _pid_alive(pid):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(d, name))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
