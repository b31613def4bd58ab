"""The base store of the merge in the engine (:mod:`lora_stream.engine.merger`): one host copy of a committed base, in
a file every worker of the host maps (:func:`shared_base`), private, named by its bytes, checked before use, written
once per host, read-only and collected by locks; where such a file may live is :mod:`lora_stream.engine.base_dir`'s.

Who calls it: :class:`~lora_stream.engine.merger.EngineMerger`, when a full update's load finishes (before the vote),
and when a commit replaces a base or a rollback drops a prepared one. What breaks if it is bypassed: every worker
keeps a copy of its own, or maps bytes nobody checked.

A committed base is written once into a file every worker of the host maps
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
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import logging
import mmap
import os
import secrets
import stat
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .base_dir import _base_dir, _refuse

logger = logging.getLogger("lora_stream")

__all__ = ["shared_base"]


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


#: One tensor in the file: its key, dtype, shape, offset and bytes.
_Entry = tuple[str, torch.dtype, tuple[int, ...], int, int]


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
