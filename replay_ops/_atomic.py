"""Atomic file writes: the one writer of record files, the demo's outputs and benchmark
results.

A write goes to a temporary file in the target's directory (named after the target, the
writer's host and its pid: `.<target>.tmp-<host>-<pid>-<random>`), is fsynced, then renamed
over the target (`os.replace`), and the directory is fsynced so the rename is durable. A
reader sees the old file or the new one, never a partial one; a writer that fails removes
its temporary file, and one that is killed leaves it behind for the next writer of the same
target to remove: a temporary of this host whose pid no longer exists here, or any
temporary (another host's, or one named without a host by an older writer) untouched for
`STALE_SECONDS`. A pid says nothing about a process on another host of a shared
filesystem, so another host's in-progress write is never removed for it. The new file gets
the mode a plain `open()` would give it (0666 & ~umask), or the mode of the file it
replaces. A write through a symbolic link replaces the file the link points to, not the
link.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
import stat
import tempfile
import time
from typing import Iterator

# a temporary file of another host (or of unknown host) is removed only when it has not
# been written to for this long
STALE_SECONDS = 6 * 3600


def _host() -> str:
    """This host's name as it appears in temporary file names (no '-': the separator)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "unknown"


@contextlib.contextmanager
def atomic_target(path) -> Iterator[str]:
    """The path of a temporary file next to `path`; write it inside the block. On leaving
    the block it is fsynced and renamed over `path`; on an exception it is removed. A
    symbolic link at `path` is followed (resolved once): the file it points to is replaced
    and the link stays a link."""
    path = os.path.realpath(os.fspath(path))
    d = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    _remove_stale_temps(d, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.tmp-{_host()}-{os.getpid()}-", dir=d)
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
    """Temporaries left by writers that were killed: this host's whose pid no longer
    exists, and any left untouched for STALE_SECONDS (another host's, or named without a
    host)."""
    prefix = f".{base}.tmp-"
    host, now = _host(), time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(d):
            if not name.startswith(prefix):
                continue
            parts = name[len(prefix):].rsplit("-", 2)  # [host, pid, random]
            path = os.path.join(d, name)
            if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
                pid = int(parts[1])
                stale = pid != os.getpid() and not _pid_alive(pid)
            else:
                try:
                    stale = now - os.stat(path).st_mtime > STALE_SECONDS
                except OSError:
                    continue
            if stale:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError as e:
        return e.errno == errno.EPERM
    return True
