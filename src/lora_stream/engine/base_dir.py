"""Where the base store (:mod:`lora_stream.engine.base_store`) keeps its files: a directory private to this user
(``<parent>/lora_stream-<euid>/``, created 0700 and checked with ``lstat``), under ``LORA_STREAM_BASE_DIR``, else
``/dev/shm`` when it has room, else the temporary directory; on a local file system whose ``flock`` the kernel itself
keeps, since liveness is judged by locks (:data:`_LOCAL_FS`; a file system two hosts may share is refused).

Who calls it: the base store, each time it writes or collects. What breaks if it is bypassed: another user could
plant or read a base, or a lock on a shared file system would not exclude another host's writer.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from .reload import LOAD_ERROR_TAG, VLLMLoadError

__all__ = ["BASE_DIR_ENV"]


#: The parent of the directory committed bases are kept in (see the module docstring).
BASE_DIR_ENV = "LORA_STREAM_BASE_DIR"


def _refuse(message: str) -> VLLMLoadError:
    return VLLMLoadError(f"{LOAD_ERROR_TAG} the engine's base file: {message}")


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62  # unknown: the file system's own room decides


def _dir_name() -> str:
    return f"lora_stream-{os.geteuid()}"


def _base_parent(nbytes: int, stem: str) -> str:
    chosen = os.environ.get(BASE_DIR_ENV)
    if chosen:
        return chosen
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm):
            mine = os.path.join(shm, _dir_name())
            # A base another worker published or is writing there stays there, whatever room its own file left:
            # every worker of the host must pick the same directory to share one copy.
            if any(os.path.lexists(os.path.join(mine, stem + s)) for s in (".bin", ".lock")):
                return shm
            # The received tensors are in memory already: the file is the one extra copy (tmpfs pages are memory).
            if shutil.disk_usage(shm).free > nbytes and _mem_available() > nbytes:
                return shm
    except OSError:
        pass
    return tempfile.gettempdir()


def _private_dir(parent: str) -> str:
    """``parent``'s directory for this user (created 0700), checked: a real directory, ours, no access for others.
    Anything else is refused: a symlink or a directory another user made could hand our base to them, or theirs
    to us."""
    path = os.path.join(parent, _dir_name())
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise _refuse(f"cannot create the directory {parent!r}: {exc}") from exc
    _check_local(parent)  # before a file is made there
    try:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    except OSError as exc:
        raise _refuse(f"cannot create the directory {path!r}: {exc}") from exc
    euid = os.geteuid()
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != euid:
        why = f"owned by uid {st.st_uid}"
    elif stat.S_IMODE(st.st_mode) != 0o700:
        why = f"mode {stat.S_IMODE(st.st_mode):04o}"
    if why is not None:
        raise _refuse(
            f"{path!r} is {why}; it must be a directory of uid {euid} with mode 0700. Remove it, or set "
            f"{BASE_DIR_ENV} to another parent directory"
        )
    return path


def _base_dir(nbytes: int, stem: str) -> str:
    """The private directory a base of ``nbytes`` named ``stem`` is kept in (see the module docstring)."""
    return _private_dir(_base_parent(nbytes, stem))


#: File systems whose ``flock`` is the kernel's own, seen by every process of the host (whatever its pid namespace)
#: and by no other host: the store proves liveness by locks (see the module docstring), so it runs only on these.
_LOCAL_FS = {
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0x794C7630: "overlayfs",
    0xCA451A4E: "bcachefs",
}


#: Names for the refusal of some file systems a directory may be shared on by several hosts, where ``flock`` is
#: emulated (NFS: as POSIX locks, which do not conflict within one process), per host, or up to the server.
_SHARED_FS = {
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x517B: "smb",
    0x65735546: "fuse",
    0x00C36400: "ceph",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x01021997: "9p",
    0x5346414F: "afs",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
}


def _fs_type(path: str) -> int | None:
    """``statfs(path).f_type`` (``None``: this platform cannot say)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
        if libc.statfs(os.fsencode(path), buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF  # f_type, the first field (a word)
    except (OSError, AttributeError, ValueError):
        return None


def _check_local(path: str) -> None:
    """Refuse a directory on a file system whose ``flock`` this store cannot rely on (see :data:`_LOCAL_FS`)."""
    kind = _fs_type(path)
    if kind in _LOCAL_FS:
        return
    what = "a file system whose type cannot be read" if kind is None else f"{_SHARED_FS.get(kind, 'a')} file system"
    if kind is not None and kind not in _SHARED_FS:
        what += f" of type {kind:#x}"
    raise _refuse(
        f"{path!r} is on {what}. The base store proves that a writer is alive, and that a base is mapped, by the "
        "flock each holds, which only a local file system is known to honour for every process of the host and no "
        f"other host ({', '.join(sorted(set(_LOCAL_FS.values())))}); set {BASE_DIR_ENV} to a directory on one "
        "(/dev/shm is tmpfs)"
    )
