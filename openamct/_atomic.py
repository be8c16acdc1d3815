"""Crash-safe file replacement: a reader sees the old complete file or the new one, never half."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

logger = logging.getLogger(__name__)

# Every temporary name carries the writer's pid, so a later save can tell the leftovers of a
# killed writer (pid gone) from the files of one still running (which it must not touch).
_STALE = (re.compile(r"\.openamct-(?:export|save|probe)-(?P<pid>\d+)-.*"),  # export/save folders, probes
          re.compile(r"\..+\.(?P<pid>\d+)-[^.]*(?:\.[^.]+)*\.tmp"))  # atomic_path's temp files


def temp_prefix(kind: str) -> str:
    """Prefix of openamct's temporary folders (``kind``: export, save, probe)."""
    return f".openamct-{kind}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, someone else's
        return True
    return True


def clean_stale_temps(folder: str) -> list[str]:
    """Remove the temporary files and folders that killed openamct writers left in ``folder``;
    returns their names. Those of live processes are left alone."""
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for name in entries:
        m = next((p.fullmatch(name) for p in _STALE if p.fullmatch(name)), None)
        if m is None or _alive(int(m.group("pid"))):
            continue
        path = os.path.join(folder, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except OSError:
            continue
        removed.append(name)
    if removed:
        logger.warning("removed %d temporary file(s) that an interrupted openamct save left in %s: %s",
                       len(removed), folder, ", ".join(sorted(removed)[:4]) + (" ..." if len(removed) > 4 else ""))
    return removed


def _fsync_dir(folder: str) -> None:
    # The rename is only durable once the directory entry is on disk.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path in the target's folder; on success fsync it and rename over `path`.

    On any exception the temporary file is removed and `path` is left untouched.
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    # mkstemp creates 0600; give the final file the permissions a plain open() would.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def atomic_write_bytes(path: str, data: bytes | list) -> None:
    """``data``: bytes, or a list of bytes-like pieces written one after another."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for piece in data if isinstance(data, list) else (data,):
            f.write(piece)
        f.flush()
