"""The safetensors checkpoint sink in one process: layout, values, config, dtypes, atomicity -- a kill at every
publish step, with renameat2 and without -- leftovers, failures (the 2-rank cases are in test_checkpoint_dist.py)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import (
    VLLM_ENV,
    assert_matches,
    assert_vllm_serves,
    lora,
    oracle,
    perturb_adapters,
    tiny_llama,
    vllm_generate,
)
from launch import TESTS

from lora_stream import ParamStream, SafetensorsSink, StreamAbortedError, save_merged
from lora_stream.errors import CheckpointError
from lora_stream.sinks.durable_files import NO_RENAME_EXCHANGE_ENV

#: The shard size of the kill tests: several shards, so a checkpoint has an index and many files.
SHARD = 20_000
OLD_FILE = b"a regular file, not a checkpoint"


def _load(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}


@pytest.mark.parametrize(
    ("tie", "saved"), [(False, None), (True, None), (True, ["lm_head"])], ids=["untied", "tied", "tied+saved-lm_head"]
)
def test_saved_checkpoint_loads_as_the_merged_model(tmp_path: Path, tie: bool, saved: list[str] | None) -> None:
    from safetensors import safe_open

    pm = lora(tiny_llama(tie=tie), target_modules="all-linear", modules_to_save=saved, use_dora=tie)
    out = tmp_path / "merged"
    record = save_merged(pm, out, max_shard_size=20_000)
    ref = oracle(pm)
    loaded = _load(out)
    assert_matches(((n, loaded[n]) for n in ref), ref)
    assert set(loaded) == set(ref)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (tie and not saved)
    assert config["dtype"] == "float32"
    # Several shards, an index mapping every name to its file, the right total, every shard readable.
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    names, total = set(), 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            assert f.metadata()["format"] == "pt" and json.loads(f.metadata()["merged_adapters"]) == ["default"]
            for name in f.keys():
                assert index["weight_map"][name] == shard
                t = f.get_tensor(name)
                names.add(name)
                total += t.numel() * t.element_size()
    assert names == set(ref) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == total == record.bytes
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary directories left behind"


def test_one_shard_is_model_safetensors_and_bf16_is_recorded(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    save_merged(pm, tmp_path / "m", dtype=torch.bfloat16)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _load(tmp_path / "m")
    ref = oracle(pm)
    assert_matches(((n, loaded[n]) for n in ref), ref, tol=4e-3)


def test_an_existing_directory_is_refused_unless_overwrite_and_then_replaced(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"], seed=1)
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(CheckpointError, match="overwrite=True"):
        save_merged(pm, out)
    assert (out / "keep.txt").read_text() == "old"
    save_merged(pm, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_a_failure_mid_write_leaves_the_previous_directory_intact(tmp_path: Path) -> None:
    pm = lora(tiny_llama(), target_modules="all-linear", seed=2)
    out = tmp_path / "m"
    save_merged(pm, out, max_shard_size=20_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    sink = SafetensorsSink(out, max_shard_size=20_000, overwrite=True)
    written = []

    def disk_full(name: str) -> None:
        written.append(name)
        if len(written) == 5:
            raise OSError(28, "No space left on device (injected)")

    sink.on_tensor = disk_full
    with pytest.raises(OSError, match="injected"):
        sink.sync(ParamStream(lora(tiny_llama(seed=3), target_modules="all-linear")))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"], "the temporary directory was not removed"


def test_a_killed_save_leaves_the_previous_directory_intact_and_the_next_save_works(tmp_path: Path) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old checkpoint")
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "workers" / "checkpoint_kill.py"), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    line = ""
    while time.monotonic() < deadline and "WRITING" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
    assert "WRITING" in line, proc.communicate()[0][-3000:]
    os.kill(proc.pid, signal.SIGKILL)  # in the middle of writing the shards
    proc.wait()
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"old checkpoint"
    [left] = _hidden(tmp_path)  # the killed save's temporary directory
    size = _du(left)
    pm = lora(tiny_llama(), target_modules=["q_proj"], seed=4)
    with _warnings() as warned:
        save_merged(pm, out, overwrite=True)
    assert_matches(((n, t) for n, t in _load(out).items()), oracle(pm))
    assert _hidden(tmp_path) == [], "the killed save's temporary directory was not removed by the next save"
    [line] = warned
    assert left.name in line and f"{size:,} bytes" in line, line


# -- publishing: a kill at every step, leftovers, fsync ---------------------------------------------------------------
def _hidden(parent: Path) -> list[Path]:
    return sorted(p for p in parent.iterdir() if p.name.startswith("."))


def _du(path: Path) -> int:
    if not path.is_dir():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory, read with safetensors; fails unless it is whole (every shard loads, and
    the index names exactly the tensors the shards hold)."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return load_file(directory / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(directory / shard)
        assert all(weight_map[n] == shard for n in part), shard
        tensors.update(part)
    assert set(tensors) == set(weight_map)
    return tensors


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The WARNING (and worse) lines logged on the ``lora_stream`` logger inside the block."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("lora_stream")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _exchange_works(where: Path) -> bool:
    """Whether this filesystem swaps two names with renameat2(RENAME_EXCHANGE) (probed independently of the sink)."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform.startswith("linux") else None
    if fn is None:
        return False
    a, b = where / "probe-a", where / "probe-b"
    a.mkdir()
    b.write_bytes(b"b")
    ok = fn(-100, bytes(a), -100, bytes(b), 2) == 0 and b.is_dir() and a.is_file()
    shutil.rmtree(b) if b.is_dir() else b.unlink()
    a.unlink() if a.is_file() else a.rmdir()
    return ok


class _Killer:
    """tests/workers/checkpoint_publish_kill.py: saves the "new" model over a target and SIGKILLs itself at a publish
    step, in a fresh child per request (forked from a single-threaded worker that imported torch once)."""

    def __init__(self, ref: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS / "workers" / "checkpoint_publish_kill.py"), str(ref)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])},
        )
        self.output: list[str] = []
        self._expect("READY", 240)

    def _expect(self, prefix: str, timeout: float) -> str:
        assert self.proc.stdout is not None
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith(prefix):
                    return line
        finally:
            timer.cancel()
        raise AssertionError("the kill worker ended:\n" + "".join(self.output[-60:]))

    def save_killed_at(self, out: Path, step: str, *, fallback: bool) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"out": str(out), "step": step, "fallback": fallback}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._expect("RESULT ", 60)[len("RESULT ") :])
        assert result["signal"] == signal.SIGKILL, (result, "".join(self.output[-60:]))

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def publish(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The shared setup of the publish tests: the "old" checkpoint (saved here), the "new" one (saved by the kill
    worker, which saves the same model when it is killed), their tensors, the worker, and whether renameat2's
    exchange works on this filesystem."""
    ref = tmp_path_factory.mktemp("publish")
    old_pm = lora(tiny_llama(seed=11), target_modules="all-linear", seed=12)
    save_merged(old_pm, ref / "old", max_shard_size=SHARD, progress=False)
    killer = _Killer(ref / "new")
    try:
        ns = SimpleNamespace(
            old_pm=old_pm,
            old_dir=ref / "old",
            old=_tensors(ref / "old"),
            new=_tensors(ref / "new"),
            killer=killer,
            exchange=_exchange_works(ref),
        )
        assert len(list((ref / "old").glob("model-*.safetensors"))) > 3
        assert not _same(ns.old, ns.new)
        yield ns
    finally:
        killer.close()


def _holds(path: Path, what: str | None, publish: SimpleNamespace) -> bool:
    """Whether ``path`` holds ``what``: None (nothing), "new" / "old" (that whole checkpoint), "file" (OLD_FILE)."""
    if what is None:
        return not os.path.lexists(path)
    if what == "file":
        return path.is_file() and path.read_bytes() == OLD_FILE
    return path.is_dir() and _same(_tensors(path), publish.new if what == "new" else publish.old)


def _after_kill(target: str, mode: str, step: str) -> tuple[str | None, dict[str, str]]:
    """What a save killed at ``step`` leaves: the target's content, and each leftover's (by kind: tmp / old)."""
    old = {"dir": "old", "file": "file", "fresh": None}[target]
    if step == "synced":
        return old, {"tmp": "new"}
    if old is None:
        return "new", {}
    if step == "renamed" and mode == "fallback":
        return None, {"old": old, "tmp": "new"}  # between the fallback's two renames
    return "new", {"tmp" if mode == "exchange" else "old": old}


KILLS = [("dir", mode, step) for mode in ("exchange", "fallback") for step in ("synced", "renamed", "published")]
KILLS += [("file", "exchange", "renamed"), ("file", "fallback", "renamed")]
KILLS += [("fresh", "exchange", "synced"), ("fresh", "fallback", "renamed")]


@pytest.mark.parametrize(("target", "mode", "step"), KILLS, ids=["-".join(k) for k in KILLS])
def test_a_kill_at_any_publish_step_leaves_a_whole_checkpoint_and_the_next_save_recovers(
    tmp_path: Path, publish: SimpleNamespace, target: str, mode: str, step: str
) -> None:
    if mode == "exchange" and not publish.exchange:
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    out = tmp_path / "m"
    if target == "dir":
        shutil.copytree(publish.old_dir, out)
    elif target == "file":
        out.write_bytes(OLD_FILE)
    publish.killer.save_killed_at(out, step, fallback=mode == "fallback")

    # What the kill left: under the target name a whole checkpoint (old or new), except between the fallback's
    # renames; beside it exactly the expected leftovers, each whole.
    want, want_left = _after_kill(target, mode, step)
    assert _holds(out, want, publish), f"after a kill at {step!r} ({mode}) the target does not hold {want}"
    left = {p.name.rsplit(".", 1)[1].split("-")[0]: p for p in _hidden(tmp_path)}
    assert sorted(left) == sorted(want_left) and len(left) == len(_hidden(tmp_path)), _hidden(tmp_path)
    for kind, what in want_left.items():
        assert _holds(left[kind], what, publish), f"the leftover {left[kind].name} does not hold {what}"
    sizes = {kind: _du(p) for kind, p in left.items()}

    # The next save recovers before anything else: at its own first publish step the target holds the old
    # checkpoint again if the kill left it moved aside, and the only hidden entry is its own temporary directory.
    recovered = want if want is not None else want_left.get("old")
    seen: dict[str, Any] = {}

    def check(name: str) -> None:
        if name == "synced":
            seen["target"] = _holds(out, recovered, publish)
            seen["hidden"] = [p.name for p in _hidden(tmp_path)]

    sink = SafetensorsSink(out, max_shard_size=SHARD, overwrite=True, progress=False)
    sink.on_publish = check
    with _warnings() as warned:
        sink.sync(ParamStream(publish.old_pm))
    assert seen["target"], f"the next save did not find {recovered} under the target name"
    assert len(seen["hidden"]) == 1 and seen["hidden"][0].startswith(".m.tmp-"), seen["hidden"]
    assert _holds(out, "old", publish) and _hidden(tmp_path) == []
    if not want_left:
        assert warned == []
        return
    [line] = warned
    assert all(p.name in line for p in left.values()), line
    if want is None and "old" in want_left:
        assert f"moved {left['old'].name} ({sizes['old']:,} bytes) back" in line, line
        assert f"({sizes['tmp']:,} bytes)" in line, line
    else:
        assert f"({sum(sizes.values()):,} bytes)" in line, line


def test_publish_fsyncs_every_file_and_directory_before_renaming_and_the_parent_after(
    tmp_path: Path, publish: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name what is fsynced")
    events: list[tuple[str, str]] = []
    fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    out = tmp_path / "m"
    shutil.copytree(publish.old_dir, out)
    written: list[str] = []

    def step(name: str) -> None:
        events.append(("step", name))
        if name == "synced":
            [tmp] = _hidden(tmp_path)
            written.extend(os.path.realpath(p) for p in [*tmp.rglob("*"), tmp])

    sink = SafetensorsSink(out, max_shard_size=SHARD, overwrite=True, progress=False)
    sink.on_publish = step
    sink.sync(ParamStream(publish.old_pm))
    assert [e for e in events if e[0] == "step"] == [("step", s) for s in ("synced", "renamed", "published")]
    synced = [path for kind, path in events[: events.index(("step", "synced"))] if kind == "fsync"]
    files, tmp = written[:-1], written[-1]
    assert len(files) > 5 and set(written) <= set(synced), set(written) - set(synced)
    assert synced.index(tmp) > max(synced.index(f) for f in files), "the directory was fsynced before its files"
    between = events[events.index(("step", "renamed")) : events.index(("step", "published"))]
    assert ("fsync", os.path.realpath(tmp_path)) in between, "the parent directory was not fsynced after the rename"


@pytest.mark.parametrize("mode", ["exchange", "fallback"])
def test_a_regular_file_target_is_refused_or_replaced_without_leftovers(
    tmp_path: Path, publish: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    if mode == "fallback":
        monkeypatch.setenv(NO_RENAME_EXCHANGE_ENV, "1")
    out = tmp_path / "m"
    out.write_bytes(OLD_FILE)
    with pytest.raises(CheckpointError, match=r"m exists.*; pass overwrite=True"):
        save_merged(publish.old_pm, out, max_shard_size=SHARD, progress=False)
    assert _holds(out, "file", publish)
    seen: list[bool] = []
    sink = SafetensorsSink(out, max_shard_size=SHARD, overwrite=True, progress=False)
    sink.on_publish = lambda name: seen.append(_holds(out, "file", publish) or _holds(out, "old", publish))
    sink.sync(ParamStream(publish.old_pm))
    assert _holds(out, "old", publish) and _hidden(tmp_path) == [], _hidden(tmp_path)
    # With renameat2 the name holds the file or the new checkpoint at every step; the fallback's window is the one
    # between its renames.
    assert seen == ([True, True, True] if mode == "exchange" else [True, False, True])


def test_only_exact_leftover_names_are_touched(tmp_path: Path, publish: SimpleNamespace) -> None:
    out = tmp_path / "m"
    shutil.copytree(publish.old_dir, out)
    decoys = [
        ".m.tmp-0123456789a",  # 11 hex digits
        ".m.tmp-0123456789abc",  # 13
        ".m.old-0123456789AB",  # upper case
        ".m.tmp-0123456789ag",
        ".m.tmp-0123456789ab.bak",
        ".m.new-0123456789ab",
        ".mm.tmp-0123456789ab",
        ".m.x.tmp-0123456789ab",
        "m.tmp-0123456789ab",
        ".m.tmp-",
    ]
    for name in decoys:
        (tmp_path / name).write_bytes(b"keep")
    (tmp_path / ".m.tmp-0123456789ab").mkdir()
    (tmp_path / ".m.tmp-0123456789ab" / "model-00001-of-00009.safetensors").write_bytes(b"x" * 100)
    (tmp_path / ".m.old-abcdefabcdef").write_bytes(b"y" * 50)
    with _warnings() as warned:
        save_merged(publish.old_pm, out, max_shard_size=SHARD, overwrite=True, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*decoys, "m"])
    assert all((tmp_path / name).read_bytes() == b"keep" for name in decoys)
    [line] = warned
    assert "removed 2 of 2 leftover(s) (150 bytes): .m.old-abcdefabcdef, .m.tmp-0123456789ab" in line, line


def test_only_a_whole_old_copy_is_moved_back(tmp_path: Path, publish: SimpleNamespace) -> None:
    # The target is missing; of two old copies the newer one is cut short (its removal was interrupted, say).
    out = tmp_path / "m"
    whole, cut = tmp_path / ".m.old-aaaaaaaaaaaa", tmp_path / ".m.old-bbbbbbbbbbbb"
    shutil.copytree(publish.old_dir, whole)
    time.sleep(0.01)
    shutil.copytree(publish.old_dir, cut)
    shard = sorted(cut.glob("model-*.safetensors"))[2]
    shard.write_bytes(shard.read_bytes()[:-10])
    with _warnings() as warned, pytest.raises(CheckpointError, match="exists; pass overwrite=True"):
        save_merged(publish.old_pm, out, max_shard_size=SHARD, progress=False)  # refused: the old one is back
    assert _holds(out, "old", publish) and _hidden(tmp_path) == []
    [line] = warned
    assert f"moved {whole.name} " in line and f"leftover(s) ({_du(publish.old_dir) - 10:,} bytes): {cut.name}" in line


def _failing_gather(stream: ParamStream, monkeypatch: pytest.MonkeyPatch, at: int = 3) -> None:
    """Make the stream's ``at``-th gather raise."""
    gather, calls = stream.gatherer.gather, []

    def failing(params: Any) -> Any:
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("the stream failed (injected)")
        return gather(params)

    monkeypatch.setattr(stream.gatherer, "gather", failing)


@pytest.mark.parametrize("where", ["agreement", "stream", "between-renames"])
def test_the_temporary_directory_is_removed_on_every_failure(
    tmp_path: Path, publish: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    from lora_stream.coordination import Coordinator

    out = tmp_path / "m"
    shutil.copytree(publish.old_dir, out)
    stream = ParamStream(publish.old_pm, group_by="module")
    sink = SafetensorsSink(out, max_shard_size=SHARD, overwrite=True, progress=False)
    if where == "agreement":  # another rank refused before writing: this one learns it in the agreement

        def agree(self: Coordinator, ok: bool, what: str, reason: str = "") -> None:
            if what.startswith("in the pre-flight"):
                raise StreamAbortedError(f"rank 0: stopped {what}: rank 1: (injected)", failed_ranks=(1,))

        monkeypatch.setattr(Coordinator, "agree", agree)
        error: type[BaseException] = StreamAbortedError
    elif where == "stream":
        _failing_gather(stream, monkeypatch)
        error = RuntimeError
    else:  # an interrupt between the fallback's two renames: the old copy goes back under the target name

        def interrupt(name: str) -> None:
            if name == "renamed":
                raise KeyboardInterrupt("(injected)")

        monkeypatch.setenv(NO_RENAME_EXCHANGE_ENV, "1")
        sink.on_publish = interrupt
        error = KeyboardInterrupt
    with pytest.raises(error, match="injected"):
        sink.sync(stream)
    assert _holds(out, "old", publish)
    assert _hidden(tmp_path) == [], "the temporary directory was left behind"


@contextlib.contextmanager
def _unprivileged() -> Iterator[None]:
    """Run the block with file permissions enforced: as root (whom chmod does not stop), as user nobody."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(65534)
    except PermissionError:
        pytest.skip("cannot drop root's privileges here")
    try:
        yield
    finally:
        os.seteuid(0)


def test_an_unwritable_parent_is_refused_before_anything_is_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = lora(tiny_llama(), target_modules=["q_proj"])
    stream = ParamStream(pm)
    _failing_gather(stream, monkeypatch, at=1)  # the first gather fails: none may happen
    base = Path(tempfile.mkdtemp())  # traversable by nobody, unlike pytest's tmp_path
    try:
        base.chmod(0o755)
        (base / "ro").mkdir(mode=0o555)
        target = base / "ro" / "m"
        with _unprivileged(), pytest.raises(CheckpointError) as err:
            SafetensorsSink(target, progress=False).sync(stream)
        assert str(target.parent) in str(err.value) and "must be writable" in str(err.value), err.value
        assert list((base / "ro").iterdir()) == []
        (base / "file").write_bytes(b"")
        with pytest.raises(CheckpointError, match=r"its parent .*file is not a directory"):
            SafetensorsSink(base / "file" / "m", progress=False).sync(stream)
    finally:
        shutil.rmtree(base)


# -- dtypes --------------------------------------------------------------------------------------------------------
def test_every_dtype_safetensors_stores_gets_safetensors_own_header(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from lora_stream.sinks.safetensors_shards import plan_shards
    from lora_stream.stream_pass import ParamMeta

    candidates = [getattr(torch, n, None) for n in dir(torch) if not n.startswith("_")]
    stored = []
    for dtype in sorted({d for d in candidates if isinstance(d, torch.dtype)}, key=str):
        try:
            raw = torch.arange(2 * 4 * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
            raw = (raw % 2 if dtype == torch.bool else raw).reshape(2, -1)
            tensor = raw.view(dtype)
        except Exception:
            continue  # not a dtype of ordinary tensors (quantized, sub-byte)
        try:
            save_file({"x": tensor}, tmp_path / "theirs.safetensors")
        except Exception:
            continue  # safetensors does not store it either
        stored.append(dtype)
        theirs = (tmp_path / "theirs.safetensors").read_bytes()
        (n,) = torch.tensor(list(theirs[:8]), dtype=torch.uint8).view(torch.int64).tolist()
        plan, _ = plan_shards([ParamMeta("x", dtype, tuple(tensor.shape))], 10**9, {"format": "pt"})
        ours = plan.headers[0]
        assert json.loads(ours[8:])["x"] == json.loads(theirs[8 : 8 + n])["x"], dtype
        (tmp_path / "ours.safetensors").write_bytes(ours + raw.numpy().tobytes())
        back = load_file(tmp_path / "ours.safetensors")["x"]
        assert back.dtype == dtype and torch.equal(back.view(torch.uint8), tensor.view(torch.uint8)), dtype
    assert {torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.bfloat16} <= set(stored), stored


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_a_float8_checkpoint_round_trips(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import load_file

    pm = lora(tiny_llama(), target_modules=["q_proj", "down_proj"])
    save_merged(pm, tmp_path / "m", dtype=dtype, progress=False)
    loaded = load_file(tmp_path / "m" / "model.safetensors")
    ref = oracle(pm)
    assert set(loaded) == set(ref)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    for name, want in ref.items():
        got = loaded[name]
        assert got.dtype == dtype and got.shape == want.shape, name
        # Rounded once from the float32 merge: the same bytes as peft's merge rounded to float8, but for a value
        # within float32 noise of a rounding boundary.
        differ = (got.view(torch.uint8) != want.to(dtype).view(torch.uint8)).float().mean().item()
        assert differ < 0.01, f"{name}: {differ:.1%} of the values differ"


def test_vllm_serves_the_saved_checkpoint_like_transformers(tmp_path: Path) -> None:
    from helpers import vllm_engine, vllm_llama
    from transformers import AutoModelForCausalLM

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    pm = lora(vllm_llama(tie=True), target_modules="all-linear", lora_alpha=32)
    out = tmp_path / "merged"
    save_merged(pm, out, max_shard_size="200KB")
    llm = vllm_engine(str(out))
    assert_vllm_serves(vllm_generate(llm), AutoModelForCausalLM.from_pretrained(out))


def test_an_adapter_stream_is_saved_in_peft_layout_and_loads_back_as_the_trainers_adapter(tmp_path: Path) -> None:
    """``SafetensorsSink.sync(AdapterStream(m))`` writes what peft's ``save_pretrained`` writes for an adapter, and
    ``PeftModel.from_pretrained`` on a fresh base gives the trainer's forward: rsLoRA and a rank pattern make the
    scalings differ per module (folded into ``lora_B``, the config says 1); the factors are perturbed off peft's
    zero ``lora_B``. ``max_shard_size`` does not split it: peft loads one file."""
    from peft import PeftModel
    from safetensors import safe_open

    from lora_stream import AdapterStream

    kw = dict(target_modules=["q_proj", "v_proj", "down_proj"], r=4, lora_alpha=16, use_rslora=True)
    pm = lora(tiny_llama(seed=1), rank_pattern={"down_proj": 2}, **kw)
    perturb_adapters(pm)
    out = tmp_path / "adapter"
    stream = AdapterStream(pm)
    record = SafetensorsSink(out, max_shard_size=1000, progress=False).sync(stream, version="a1")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text()) == stream.adapter_config()
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(m.name for m in stream.metadata())
        assert f.metadata() == {"format": "pt", "version": "a1"}
    assert record.tensors == len(stream.metadata())

    loaded = PeftModel.from_pretrained(tiny_llama(seed=1), out).eval()
    pm.eval()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = pm(ids).logits, loaded(ids).logits
        plain = tiny_llama(seed=1)(ids).logits
    assert not torch.allclose(want, plain, atol=1e-3), "the adapter should change the forward"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
