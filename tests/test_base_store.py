"""The host file an engine-side merge keeps its base in (:func:`lora_stream.engine.base_store.shared_base`): mapped
read-only, named by a digest of its bytes and checked against it, private to its user, written once per host, and
never handed to vLLM's loader (which may write into what it is given).

Fast: small tensors in this process, a private ``LORA_STREAM_BASE_DIR``; forked children where a test needs a
second process (a write that must fault, a second user)."""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import lora, private_base_dir, tiny_llama

from lora_stream import ParamStream
from lora_stream.engine import base_dir as d
from lora_stream.engine import base_store as m
from lora_stream.engine.base_dir import BASE_DIR_ENV
from lora_stream.engine.base_store import shared_base
from lora_stream.engine.merger import EngineMerger
from lora_stream.engine.reload import VLLMLoadError
from lora_stream.engine_merge import EngineMergePlan
from lora_stream.fingerprint import fingerprint
from lora_stream.stream_pass import InputRequest

NOBODY = 65534


def _base(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(33, 17, generator=g),
        "h": torch.randn(5, 3, generator=g).to(torch.bfloat16),
        "s": torch.tensor(3.5),
        "e": torch.empty(0, 4),
        "m": torch.tensor([True, False, True]),
    }


def _clone(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in base.items()}


def _share(base: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """:func:`shared_base` as :meth:`EngineMerger.commit` calls it (with the fingerprints taken on arrival)."""
    return shared_base(base, {k: fingerprint(t) for k, t in base.items()})


def _assert_equal(views: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> None:
    assert sorted(views) == sorted(base)
    for k, t in base.items():
        assert views[k].dtype == t.dtype and views[k].shape == t.shape, k
        assert torch.equal(views[k], t), k


def _maps(path: str) -> list[tuple[int, int, str]]:
    """This process's mappings of ``path``: (start, end, permissions)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].strip() == path:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                out.append((lo, hi, fields[1]))
    return out


def _in_map(t: torch.Tensor, path: str) -> bool:
    return any(lo <= t.data_ptr() < hi for lo, hi, _ in _maps(path))


@pytest.fixture
def parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private ``LORA_STREAM_BASE_DIR``; the names this process published there are forgotten afterwards."""
    yield from private_base_dir(tmp_path, monkeypatch, "parent")


def _private(parent: Path) -> Path:
    return parent / f"lora_stream-{os.geteuid()}"


def test_the_views_are_a_read_only_map_of_one_private_file(parent: Path) -> None:
    base = _base()
    views, path = _share(_clone(base))
    _assert_equal(views, base)
    maps = _maps(path)
    assert maps and all(perms == "r--s" for _, _, perms in maps), maps
    assert all(_in_map(views[k], path) for k in ("w", "h", "s", "m"))
    assert Path(path).parent == _private(parent)
    assert stat.S_IMODE(os.lstat(_private(parent)).st_mode) == 0o700
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    # A second worker given the same base maps the same file.
    again, path2 = _share(_clone(base))
    assert path2 == path
    _assert_equal(again, base)
    assert os.listdir(_private(parent)) == [os.path.basename(path)]
    # Writing into a view faults (in a child: the fault kills the process that writes).
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        faulthandler.disable()
        try:
            views["w"].fill_(0.0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGSEGV, signal.SIGBUS), status
    _assert_equal(views, base)


def _recipe(name: str, key: str, t: torch.Tensor, aliases: list[str] | None = None) -> dict[str, Any]:
    dtype = str(t.dtype).removeprefix("torch.")
    target = {"kind": "param", "key": key, "dtype": dtype, "shape": list(t.shape), "source": name}
    return {
        "targets": [target],
        "outputs": [[name, dtype, list(t.shape)]],
        "aliases": {name: aliases} if aliases else {},
        "convert": None,
    }


def test_an_output_that_is_the_base_reaches_the_loader_as_a_copy(parent: Path) -> None:
    """vLLM's gpt-oss loader zeroes ``w2_bias`` on TP ranks > 0: a loader that writes into an output must change
    neither the base every worker maps nor the one this worker is about to keep, nor what a rollback recomputes."""
    bias = torch.randn(8)
    recipe = _recipe("w2_bias", "i0", bias, aliases=["tied_bias"])
    merger = EngineMerger()
    full = merger.begin({"recipes": [recipe], "frozen": ["i0"]}, False)
    received = bias.clone()
    out = full.feed([("i0", received)])
    assert [n for n, _ in out] == ["w2_bias", "tied_bias"]
    assert out[0][1] is out[1][1]  # an alias is the same tensor, copied once
    assert out[0][1].untyped_storage().data_ptr() != received.untyped_storage().data_ptr()
    out[0][1].zero_()  # the loader
    assert torch.equal(received, bias)
    merger.prepare(full)  # at the end of the load, before the vote
    merger.commit(full)
    path = merger.base_file
    assert path is not None
    assert torch.equal(merger.base["i0"], bias)
    assert _in_map(merger.base["i0"], path)  # the merge reads the map itself: no copy there

    info = {"recipes": [recipe], "frozen": ["i0"], "base_fp": dict(merger.base_fp)}
    partial = merger.begin(info, True)
    loaded = partial.feed([]) + partial.rest()  # every input is in the base: computed at once
    restore = merger.restorer(["w2_bias", "tied_bias"])
    assert restore is not None
    for pairs in (loaded, restore()):
        assert [n for n, _ in pairs] == ["w2_bias", "tied_bias"]
        assert all(torch.equal(t, bias) and not _in_map(t, path) for _, t in pairs)
        for _, t in pairs:
            t.zero_()  # the loader: would fault on the read-only map
        assert torch.equal(merger.base["i0"], bias)
    assert all(torch.equal(t, bias) for _, t in restore())


def test_no_output_of_a_real_plan_reaches_the_loader_as_a_view_of_an_input(parent: Path) -> None:
    """Through the public path (a peft model's recipes through JSON): a full update, then a partial one and its
    rollback. ``modules_to_save`` makes a step whose output is a trained input itself, which this worker keeps to
    recompute rollbacks."""
    pm = lora(tiny_llama(), target_modules=["q_proj"], modules_to_save=["lm_head"])
    stream = ParamStream(pm, group_by="layer")
    plan = EngineMergePlan(stream)
    recipes = json.loads(json.dumps(plan.recipes))
    frozen = [k for k, s in plan.inputs.items() if not s.trainable]
    merger = EngineMerger()
    full = merger.begin({"recipes": recipes, "frozen": frozen}, False)
    everything = {i: [plan.inputs[k] for k in plan.reads[i]] for i in range(len(plan.recipes))}
    received: list[torch.Tensor] = []
    outputs: list[tuple[str, torch.Tensor]] = []
    with stream.iter_inputs(InputRequest(frozenset(everything), everything)) as batches:
        for keys, tensors in batches:
            pairs = [(k, t.clone()) for k, t in zip(keys, tensors, strict=True)]
            received += [t for _, t in pairs]
            outputs += full.feed(pairs)
    outputs += full.rest()
    ptrs = {t.untyped_storage().data_ptr() for t in received}
    assert outputs and not any(t.untyped_storage().data_ptr() in ptrs for _, t in outputs if t.numel())
    for _, t in outputs:
        t.zero_()  # a loader that writes: the base and the kept inputs stay the trainer's
    merger.prepare(full)  # at the end of the load, before the vote
    merger.commit(full)
    path = merger.base_file
    assert path is not None
    steps = [i for i in range(len(plan.recipes)) if plan.reads_trainable(i)]
    passed = [i for i in steps if any(t["kind"] == "param" for t in recipes[i]["targets"])]
    assert passed  # lm_head: the trained copy itself
    names = [o[0] for i in steps for o in recipes[i]["outputs"]]
    base_fp = {k: merger.base_fp[k] for i in steps for k in plan.frozen(i)}
    info = {"recipes": [recipes[i] for i in steps], "frozen": frozen, "base_fp": base_fp}
    partial = merger.begin(info, True)
    trainable = {k: merger.inputs[k].clone() for i in steps for k in plan.trainable(i)}
    loaded = partial.feed(list(trainable.items())) + partial.rest()
    restore = merger.restorer(names)
    assert restore is not None
    kept = {t.untyped_storage().data_ptr() for t in [*merger.inputs.values(), *trainable.values()]}
    expected = {n: t.clone() for ns, ts in stream.iter_groups() for n, t in zip(ns, ts, strict=True)}
    for pairs in (loaded, restore()):
        assert sorted(n for n, _ in pairs) == sorted(names)
        for n, t in pairs:
            assert torch.equal(t, expected[n]), n
            assert not _in_map(t, path) and t.untyped_storage().data_ptr() not in kept, n
        for _, t in pairs:
            t.zero_()
    assert all(torch.equal(t, expected[n]) for n, t in restore())


def _published(base: dict[str, torch.Tensor]) -> tuple[str, int]:
    """Where ``base`` is published and its size, with nothing left under that name."""
    views, path = _share(_clone(base))
    del views
    size = os.path.getsize(path)
    os.unlink(path)
    m._OWNED.discard(path)
    return path, size


def test_a_truncated_file_is_written_again_never_extended_with_zeros(parent: Path) -> None:
    base = _base()
    views, path = _share(_clone(base))
    del views
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    again, path2 = _share(_clone(base))
    assert path2 == path and os.path.getsize(path) == size
    _assert_equal(again, base)


def test_a_file_of_foreign_bytes_under_the_name_is_written_again(parent: Path) -> None:
    base = _base()
    path, size = _published(base)
    # Other bytes of the right size under the name (a torn write, a bit flip, anything but this base).
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.write(fd, os.urandom(size))
    os.close(fd)
    foreign = os.lstat(path).st_ino
    got, path2 = _share(_clone(base))
    assert path2 == path and os.lstat(path).st_ino != foreign
    _assert_equal(got, base)


def test_a_symlink_under_the_name_is_never_followed(parent: Path, tmp_path: Path) -> None:
    base = _base()
    path, _ = _published(base)
    elsewhere = tmp_path / "elsewhere.bin"
    decoy = _base(seed=2)
    _, other = _share(_clone(decoy))
    shutil.copyfile(other, elsewhere)  # the right size, another base's bytes
    os.symlink(elsewhere, path)
    before = elsewhere.read_bytes()
    got, path2 = _share(_clone(base))
    assert path2 == path and stat.S_ISREG(os.lstat(path).st_mode)
    _assert_equal(got, base)
    assert elsewhere.read_bytes() == before


def test_a_file_that_vanishes_between_check_and_map_never_yields_zeros(
    parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _base()
    views, path = _share(_clone(base))
    del views
    real_open, real_exists = os.open, os.path.exists
    fired: list[str] = []

    def vanish() -> None:
        if not fired and os.path.lexists(path):
            fired.append(path)
            os.unlink(path)  # another server removed the name

    def racing_open(p: Any, flags: int, *args: Any, **kw: Any) -> int:
        if os.fspath(p) == path and not flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            vanish()
        return real_open(p, flags, *args, **kw)

    def racing_exists(p: Any) -> bool:
        seen = real_exists(p)
        if os.fspath(p) == path and seen:
            vanish()
        return seen

    monkeypatch.setattr(os, "open", racing_open)
    monkeypatch.setattr(os.path, "exists", racing_exists)
    got, path2 = _share(_clone(base))
    monkeypatch.undo()
    assert fired and path2 == path
    _assert_equal(got, base)
    assert os.path.getsize(path) > 0


def test_the_directory_must_be_ours_and_private(parent: Path, tmp_path: Path) -> None:
    base = _base()
    private = _private(parent)
    private.mkdir(mode=0o755)
    os.chmod(private, 0o755)
    with pytest.raises(VLLMLoadError, match=f"{private}.*mode 0755"):
        _share(_clone(base))
    os.chmod(private, 0o700)
    if os.geteuid() == 0:
        os.chown(private, NOBODY, NOBODY)
        with pytest.raises(VLLMLoadError, match=f"{private}.*owned by uid {NOBODY}"):
            _share(_clone(base))
        os.chown(private, 0, 0)
    private.rmdir()
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    private.symlink_to(target)
    with pytest.raises(VLLMLoadError, match=f"{private}.*symbolic link"):
        _share(_clone(base))
    assert list(target.iterdir()) == []
    private.unlink()
    views, _ = _share(_clone(base))
    _assert_equal(views, base)


def _require_root() -> None:
    if os.geteuid() != 0:
        if os.environ.get("LORA_STREAM_REQUIRE_ALL") == "1":
            pytest.fail("required in CI: the second-user test runs as root (it becomes another user)")
        pytest.skip("needs root to become another user")


def test_a_second_user_keeps_its_own_file_and_cannot_read_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_root()
    # A parent the other user can reach, world-writable and sticky like /dev/shm (pytest's tmp_path is 0700).
    top = tempfile.mkdtemp(prefix="lora_stream-test-")
    try:
        os.chmod(top, 0o755)
        shm = os.path.join(top, "shm")
        os.mkdir(shm)
        os.chmod(shm, 0o1777)
        monkeypatch.setenv(BASE_DIR_ENV, shm)
        base = _base()
        views, ours = _share(_clone(base))
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            result: dict[str, Any] = {}
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                theirs_views, theirs = _share(_clone(base))
                result["path"] = theirs
                result["equal"] = all(torch.equal(theirs_views[k], t) for k, t in base.items())
                try:
                    with open(ours, "rb") as f:
                        f.read(1)
                    result["read_ours"] = "read"
                except PermissionError:
                    result["read_ours"] = "PermissionError"
            except BaseException as exc:
                result["error"] = repr(exc)
            finally:
                os.write(write, json.dumps(result).encode())
                os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            result = json.loads(f.read())
        os.waitpid(pid, 0)
        assert "error" not in result, result
        assert result["equal"] and result["read_ours"] == "PermissionError", result
        assert result["path"] == os.path.join(shm, f"lora_stream-{NOBODY}", os.path.basename(ours))
        st = os.lstat(result["path"])
        assert st.st_uid == NOBODY and stat.S_IMODE(st.st_mode) == 0o600
        _assert_equal(views, base)
    finally:
        m._OWNED.discard(os.path.join(top, "shm", f"lora_stream-{os.geteuid()}"))
        for path in list(m._OWNED):
            if path.startswith(top):
                m._OWNED.discard(path)
        shutil.rmtree(top, ignore_errors=True)


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


_HOLDER = """
import fcntl, os, sys
fds = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    fds.append(fd)
print("held", flush=True)
sys.stdin.read()
"""


class _Holder:
    """Another process (in the tests' eyes: a writer or a server the collector cannot see, in another pid namespace
    or on the far side of a container) holding the shared lock on ``paths`` until :meth:`close`."""

    def __init__(self, *paths: Path | str) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, *map(str, paths)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "held"

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _file(p: Path, age_s: float = 0.0) -> Path:
    p.write_bytes(b"x" * 100)
    os.chmod(p, 0o600)
    if age_s:
        old = time.time() - age_s
        os.utime(p, (old, old))
    return p


def _ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def test_the_collector_keeps_what_a_lock_holds_whatever_the_name_or_the_pid_says(parent: Path) -> None:
    """Liveness is the lock the owner holds, never a pid, a pid namespace or ``/proc/*/maps``: a writer whose file's
    name names a dead pid, or another host's or container's pid namespace, but which is alive (it holds its lock),
    keeps its file; a base that a server the collector cannot see maps (it holds the base's lock) keeps its name,
    however old; a writer that died (its lock went with it) loses its file at once, even one whose name names a
    living pid."""
    views, path = _share(_base())
    private = _private(parent)
    stem = os.path.basename(path).removesuffix(".bin")
    token = "0123456789abcdef"
    # Names in the format of the releases that judged by pid: <stem>.<pid>.<pid namespace>.<token>.tmp.
    dead_name_live_writer = _file(private / f"{stem}.{_dead_pid()}.{_ns()}.{token}.tmp")
    foreign_ns_live_writer = _file(private / f"{stem}.1.{_ns() + 1}.{token}.tmp", age_s=3600)
    mapped_elsewhere = _file(private / f"{m._FILE_PREFIX}{'3' * 64}.bin", age_s=3600)
    live_name_dead_writer = _file(private / f"{stem}.{os.getpid()}.{_ns()}.{token}.tmp")
    unheld_young_base = _file(private / f"{m._FILE_PREFIX}{'2' * 64}.bin")
    free_lock = _file(private / f"{m._FILE_PREFIX}{'0' * 64}.lock")
    held_lock = _file(private / f"{m._FILE_PREFIX}{'1' * 64}.lock")
    old = time.time() - 3600
    os.utime(path, (old, old))  # old, but mapped here
    holder = _Holder(dead_name_live_writer, foreign_ns_live_writer, mapped_elsewhere)
    import fcntl

    fd = os.open(held_lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        m._collect(str(private))
        assert dead_name_live_writer.exists() and foreign_ns_live_writer.exists() and mapped_elsewhere.exists()
        assert held_lock.exists() and os.path.exists(path)
        assert not live_name_dead_writer.exists() and not unheld_young_base.exists() and not free_lock.exists()
    finally:
        holder.close()
        os.close(fd)
    # The holder is gone, and with it its locks: what it held is collected now.
    m._collect(str(private))
    assert not dead_name_live_writer.exists() and not foreign_ns_live_writer.exists()
    assert not mapped_elsewhere.exists() and not held_lock.exists()
    assert os.path.exists(path)  # still mapped here
    del views
    import gc

    gc.collect()
    m._collect(str(private))
    assert not os.path.exists(path)  # this process let go of it too


def test_a_writer_mid_write_and_a_mapped_base_survive_a_full_sync_elsewhere(
    parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the public path: while another worker writes its base (its temporary file locked, its pid
    meaningless here), a full sync of another base collects the directory and leaves that file alone; the writer
    then publishes and every worker maps what it wrote."""
    base = _base()
    private = _private(parent)
    real_link = os.link
    seen: list[bool] = []

    def link(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        # Between the write and the publication: another worker's full sync (another base) runs its collector.
        if not seen:
            seen.append(os.path.exists(src))
            _share(_base(seed=5))
            seen.append(os.path.exists(src))
        real_link(src, dst, *args, **kw)

    monkeypatch.setattr(os, "link", link)
    views, _ = _share(_clone(base))
    monkeypatch.undo()
    assert seen == [True, True], seen
    _assert_equal(views, base)
    assert sorted(p.suffix for p in private.iterdir()) == [".bin", ".bin"]


def test_the_map_holds_the_lock_until_its_last_view_dies_and_a_dropped_base_loses_its_name(parent: Path) -> None:
    import fcntl
    import gc

    def free(path: str) -> bool:
        fd = os.open(path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)

    views, path = _share(_base())
    one = views["w"]
    del views
    gc.collect()
    assert not free(path)  # a view lives: the file is mapped
    del one
    gc.collect()
    assert free(path)
    # An update that prepared a base and was rolled back lets go of it: its name goes when nobody else maps it.
    recipe = _recipe("w", "i0", torch.randn(4))
    merger = EngineMerger()
    update = merger.begin({"recipes": [recipe], "frozen": ["i0"]}, False)
    update.feed([("i0", torch.randn(4))])
    merger.prepare(update)
    assert update.prepared is not None
    prepared = update.prepared[1]
    assert os.path.exists(prepared) and not free(prepared)
    merger.drop(update)
    gc.collect()
    assert not os.path.exists(prepared) and merger.base_file is None


def test_the_store_refuses_a_file_system_whose_locks_it_cannot_rely_on(
    parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert d._fs_type(str(parent)) in d._LOCAL_FS  # the tests' own directory is a local one
    for kind, name in ((0x6969, "nfs"), (0xFF534D42, "cifs"), (0x65735546, "fuse"), (0x12345678, "0x12345678")):
        monkeypatch.setattr(d, "_fs_type", lambda path, kind=kind: kind)
        with pytest.raises(VLLMLoadError, match=rf"{parent}.*{name}.*{BASE_DIR_ENV}"):
            _share(_base())
    monkeypatch.setattr(d, "_fs_type", lambda path: None)
    with pytest.raises(VLLMLoadError, match="cannot be read"):
        _share(_base())
    assert list(parent.iterdir()) == []  # refused before anything was made there


def _unshare_pid() -> list[str]:
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a pid namespace of the same user needs root here (a user namespace would change the uid)")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    try:
        ok = subprocess.run([*cmd, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    if not ok:
        pytest.skip("unshare --pid --mount-proc is not permitted here")
    return cmd


_OTHER_NS = """
import fcntl, json, os, sys, torch
from lora_stream.engine import base_dir as d
from lora_stream.engine import base_store as m
views, path = m.shared_base({"x": torch.arange(1000.0)})
# A writer mid-write, as every writer is: its file locked (named as the releases that judged by pid named it).
ns = os.stat("/proc/self/ns/pid").st_ino
tmp = os.path.join(os.path.dirname(path), f"{m._FILE_PREFIX}{'a' * 64}.{os.getpid()}.{ns}.0123456789abcdef.tmp")
fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
fcntl.flock(fd, fcntl.LOCK_SH)
print(json.dumps({"path": path, "tmp": tmp, "pid": os.getpid(), "ns": ns}), flush=True)
for line in sys.stdin:
    m._collect(os.path.dirname(path))  # a full sync in the container: its collector
    print("collected", flush=True)
"""


def test_two_pid_namespaces_share_one_store(parent: Path) -> None:
    """A server in its own pid namespace and ``/proc`` (a container sharing ``/dev/shm``) and one on the host, in
    one directory: neither's collector removes what the other maps or is writing, however old, and each one's
    files go once it is gone."""
    import subprocess
    import sys

    cmd = _unshare_pid()
    env = {**os.environ, BASE_DIR_ENV: str(parent)}
    child = subprocess.Popen(
        [*cmd, sys.executable, "-c", _OTHER_NS], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        theirs = json.loads(child.stdout.readline())
        assert theirs["pid"] == 1 and theirs["ns"] != _ns(), theirs  # another pid namespace: we are invisible there
        old = time.time() - 3600
        for p in (theirs["path"], theirs["tmp"]):
            os.utime(p, (old, old))
        views, ours = _share(_base())  # the host's full sync collects first
        assert os.path.exists(theirs["path"]) and os.path.exists(theirs["tmp"])
        os.utime(ours, (old, old))
        child.stdin.write("collect\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "collected"
        assert os.path.exists(ours)  # mapped here, by a process the container cannot see
        _assert_equal(views, _base())
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    m._collect(str(_private(parent)))
    assert not os.path.exists(theirs["path"]) and not os.path.exists(theirs["tmp"])
    assert os.path.exists(ours)


def test_workers_publishing_one_base_at_once_write_it_once_and_all_verify_it(
    parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB
    workers = 4
    private = _private(parent)
    links: list[str] = []
    verified: list[str] = []
    real_link, real_pwrite = os.link, os.pwrite
    real_verify = getattr(m, "_digest_of_map", None)  # (None before the base was verified at all)

    def link(src: Any, dst: Any, *args: Any, **kw: Any) -> None:
        links.append(os.fspath(dst))
        real_link(src, dst, *args, **kw)

    def slow_pwrite(fd: int, data: Any, offset: int) -> int:
        time.sleep(0.02)  # a long write: every other worker arrives while it runs
        return real_pwrite(fd, data, offset)

    def verify(*args: Any) -> str:
        assert real_verify is not None
        digest = real_verify(*args)
        verified.append(digest)
        return str(digest)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    monkeypatch.setattr(m, "_digest_of_map", verify, raising=False)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if private.is_dir():
                peak[0] = max(peak[0], sum(1 for p in os.listdir(private) if p.endswith(".tmp")))
            time.sleep(0.001)

    start = threading.Barrier(workers)
    results: list[tuple[dict[str, torch.Tensor], str] | BaseException] = [ValueError()] * workers

    def worker(i: int) -> None:
        start.wait()
        try:
            results[i] = _share(_clone(base))
        except BaseException as exc:
            results[i] = exc

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    sampler.join()
    paths = set()
    for r in results:
        assert not isinstance(r, BaseException), r
        _assert_equal(r[0], base)
        paths.add(r[1])
    assert len(paths) == 1 and len(links) == 1, (paths, links)
    assert [p.name for p in private.iterdir()] == [os.path.basename(paths.pop())]
    assert len(verified) == workers and len(set(verified)) == 1
    assert peak[0] <= 1, peak


def test_bytes_that_never_match_their_name_are_refused_with_the_reason(
    parent: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(m, "_digest_of_map", lambda *args: "f" * 64)  # as if every file read back differently
    with pytest.raises(VLLMLoadError, match=r"bytes hash to f{64}"):
        _share(_base())
    assert not list(_private(parent).glob("*.bin")) and not list(_private(parent).glob("*.tmp"))


def test_the_default_directory_needs_room_for_one_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The received tensors are in memory already: ``/dev/shm`` needs room for the file alone (one extra copy)."""
    monkeypatch.delenv(BASE_DIR_ENV, raising=False)
    if not os.path.isdir("/dev/shm"):
        if os.environ.get("LORA_STREAM_REQUIRE_ALL") == "1":
            pytest.fail("required in CI: the default base directory is /dev/shm, which this machine lacks")
        pytest.skip("no /dev/shm here")
    gib = 1 << 30
    stem = f"{m._FILE_PREFIX}{'e' * 64}"  # a base nobody published
    usage = shutil.disk_usage("/dev/shm")
    monkeypatch.setattr(d, "_mem_available", lambda: 4 * gib)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=int(1.5 * gib)))
    assert d._base_parent(gib, stem) == "/dev/shm"
    assert d._base_parent(2 * gib, stem) == tempfile.gettempdir()
    monkeypatch.setattr(d, "_mem_available", lambda: gib // 2)
    assert d._base_parent(gib, stem) == tempfile.gettempdir()


def test_a_commit_that_replaces_the_base_lets_go_of_the_previous_file_after_answering(parent: Path) -> None:
    """The commit swaps references; the previous base's map is dropped and its name removed on a thread of their
    own (nobody else maps it here), so the commit's answer waits for neither."""
    import threading

    recipe = _recipe("w", "i0", torch.randn(4))
    merger = EngineMerger()
    paths = []
    for seed in (1, 2):
        update = merger.begin({"recipes": [recipe], "frozen": ["i0"]}, False)
        update.feed([("i0", torch.randn(4, generator=torch.Generator().manual_seed(seed)))])
        merger.prepare(update)
        merger.commit(update)
        paths.append(merger.base_file)
    for t in threading.enumerate():
        if t.name == "lora_stream-let-go":
            t.join(timeout=30)
    first, second = paths
    assert first != second and not os.path.exists(first) and os.path.exists(second)
