"""Filesystem primitives for publishing a directory atomically and durably: renames that never replace by accident,
fsyncs of files, directories and trees, and the size and removal of what a killed publish left behind.

Called by :class:`~lora_stream.sinks.checkpoint.SafetensorsSink` on rank 0, which owns the publishing protocol (the
temporary and moved-aside names, the order of the steps, the recovery: see :mod:`lora_stream.sinks.checkpoint`).
What these guarantee:

* :func:`renameat2` is one ``renameat2`` call: with :data:`RENAME_EXCHANGE` two existing names swap in one step, with
  :data:`RENAME_NOREPLACE` the rename fails rather than replace an existing target. It answers ``False``, having done
  nothing, where the call is unavailable (not Linux, an old C library, a filesystem answering ``EINVAL``,
  ``ENOSYS`` or ``EOPNOTSUPP``); :func:`renameat2_enabled` says whether to try it at all (``False`` too under
  :data:`NO_RENAME_EXCHANGE_ENV`).
* :func:`rename_noreplace` does not replace ``dst``: one ``renameat2`` where there is one, else a check that ``dst``
  is absent and then ``os.rename`` (which a concurrent writer could race: one save at a time per target).
* :func:`fsync_tree` fsyncs every regular file, then every directory, the root last; :func:`fsync_dir` one directory
  (after a rename, its parent), ignoring only the errors of filesystems that cannot fsync a directory.
* :func:`tree_size` and :func:`remove_path` never raise for what is gone or unreadable: they are for reports and
  best-effort cleanup.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import shutil
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "NO_RENAME_EXCHANGE_ENV",
    "RENAME_EXCHANGE",
    "RENAME_NOREPLACE",
    "fsync_dir",
    "fsync_tree",
    "remove_path",
    "rename_noreplace",
    "renameat2",
    "renameat2_enabled",
    "tree_size",
]

#: Set (to anything but ``""`` or ``"0"``) to publish without ``renameat2``, as where it is unavailable: the old copy
#: is moved aside, then the new one into place. A test and debug knob, read at every save.
NO_RENAME_EXCHANGE_ENV = "LORA_STREAM_NO_RENAME_EXCHANGE"
_AT_FDCWD = -100
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=1)
def _libc_renameat2() -> Any:
    """libc's ``renameat2`` (glibc 2.28+, musl 1.2.4+), or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def renameat2_enabled() -> bool:
    return os.environ.get(NO_RENAME_EXCHANGE_ENV, "") in ("", "0") and _libc_renameat2() is not None


def renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False (nothing done) where the kernel or the filesystem does not support it."""
    fn = _libc_renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    if not (renameat2_enabled() and renameat2(src, dst, RENAME_NOREPLACE)):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
        os.rename(src, dst)


def _fsync_path(path: Path, *, directory: bool) -> None:
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (and platforms) cannot fsync a directory; its entries are then as durable as they get.
        if not directory or exc.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    _fsync_path(path, directory=True)


def fsync_tree(root: Path, done: Iterable[Path] = ()) -> None:
    """fsync every regular file under ``root`` (but those in ``done``), then every directory, ``root`` last."""
    skip = set(done)
    for here, _dirs, files in os.walk(root, topdown=False):
        for f in files:
            path = Path(here) / f
            if path not in skip and stat.S_ISREG(path.lstat().st_mode):
                _fsync_path(path, directory=False)
        fsync_dir(Path(here))


def tree_size(path: Path) -> int:
    """Bytes held by the files under ``path`` (or the file itself); 0 for what cannot be read."""
    try:
        if not stat.S_ISDIR(path.lstat().st_mode):
            return path.lstat().st_size
        total = 0
        for here, _dirs, files in os.walk(path):
            for f in files:
                try:
                    total += os.lstat(os.path.join(here, f)).st_size
                except OSError:
                    pass
        return total
    except OSError:
        return 0


def remove_path(path: Path) -> str:
    """Remove a file, link or directory tree; returns ``""`` or why it (partly) failed."""
    try:
        if stat.S_ISDIR(path.lstat().st_mode):
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        return str(exc)
    return ""
