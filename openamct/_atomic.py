"""Crash-safe file replacement: a reader sees the old complete file or the new one, never half."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator


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
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=suffix + ".tmp", dir=folder)
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


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
