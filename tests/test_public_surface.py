"""The public surface: ``lora_stream.__all__`` is what a user calls or catches, and nothing else; what left the top
level lives in its own module; every dotted ``lora_stream.*`` path the docs and the docstrings write imports; a sink
given something that is not an engine says so."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import itertools
import re
import types
from pathlib import Path
from typing import Any

import pytest

import lora_stream

ROOT = Path(__file__).resolve().parent.parent

#: The public surface, sorted. A change here is a change of the API: update docs/api.md and the changelog with it.
PUBLIC = [
    "AdapterLoadError",
    "AdapterStream",
    "AdapterSyncRecord",
    "CheckpointMismatchError",
    "Fsdp1Gatherer",
    "Fsdp2Gatherer",
    "LoraStreamError",
    "ParamStream",
    "PlainGatherer",
    "SafetensorsSink",
    "ServerError",
    "StreamAbortedError",
    "SyncRecord",
    "UnsupportedAdapterError",
    "UnsupportedModelError",
    "VLLMColocatedSink",
    "VLLMLoRASink",
    "VLLMLoadError",
    "VLLMServerSink",
    "Verification",
    "VerificationError",
    "ZeroThreeGatherer",
    "register_wrapper",
    "save_merged",
    "stream_merged_params",
]

#: What left the top level, and where it is imported from now.
MOVED = {
    "Changes": "lora_stream.changes",
    "CheckpointError": "lora_stream.errors",
    "CheckpointFormatError": "lora_stream.checkpoint_format",
    "Coordinator": "lora_stream.coordination",
    "DEFAULT_BUDGET_BYTES": "lora_stream.grouping",
    "DEFAULT_MERGE_BLOCK_BYTES": "lora_stream.merge",
    "EngineState": "lora_stream.changes",
    "FAULT_POINTS": "lora_stream.testing",
    "Gatherer": "lora_stream.gatherers",
    "GroupBy": "lora_stream.grouping",
    "Layout": "lora_stream.checkpoint_format",
    "LeaseExpiredError": "lora_stream.sinks",
    "NameCollisionError": "lora_stream.errors",
    "ParamMeta": "lora_stream.stream",
    "PassState": "lora_stream.stream",
    "PrefixCacheError": "lora_stream.sinks",
    "RenameError": "lora_stream.errors",
    "ReplicaError": "lora_stream.errors",
    "ReplicaExcludedWarning": "lora_stream.errors",
    "Renames": "lora_stream.names",
    "Selection": "lora_stream.stream",
    "Sink": "lora_stream.sinks",
    "StreamPass": "lora_stream.stream",
    "StalePlanError": "lora_stream.errors",
    "StreamStats": "lora_stream.stream",
    "SyncedSources": "lora_stream.changes",
    "Transaction": "lora_stream.transaction",
    "TransferError": "lora_stream.errors",
    "VerifyPolicy": "lora_stream.sinks.verify",
    "agree_on_changes": "lora_stream.changes",
    "auto_gatherer": "lora_stream.gatherers",
    "set_fault_hook": "lora_stream.testing",
}


def test_all_is_the_public_surface() -> None:
    assert len(PUBLIC) <= 25, "a surface people can hold: at most 25 names (rarely caught errors: lora_stream.errors)"
    assert lora_stream.__all__ == PUBLIC, "lora_stream.__all__ changed: update PUBLIC, docs/api.md and the changelog"
    for name in PUBLIC:
        assert getattr(lora_stream, name) is not None, name
    namespace: dict[str, Any] = {}
    exec("from lora_stream import *", namespace)
    assert sorted(n for n in namespace if not n.startswith("__")) == PUBLIC


def test_internals_left_the_top_level_for_their_own_modules() -> None:
    for name, module in MOVED.items():
        assert not hasattr(lora_stream, name), f"lora_stream.{name} is back at the top level; import it from {module}"
        assert getattr(importlib.import_module(module), name) is not None, f"{module}.{name}"
    # ``lora_stream.fingerprint`` is the module now (the function is ``lora_stream.fingerprint.fingerprint``).
    assert isinstance(lora_stream.fingerprint, types.ModuleType)


def test_the_test_hooks_are_in_lora_stream_testing() -> None:
    import lora_stream.testing as testing
    import lora_stream.transaction as transaction

    assert testing.set_fault_hook is transaction.set_fault_hook
    assert testing.FAULT_POINTS is transaction.FAULT_POINTS
    assert testing.fault_point is transaction.fault_point
    seen: list[str] = []
    previous = testing.set_fault_hook(seen.append)
    try:
        transaction.fault_point("prepare")
    finally:
        testing.set_fault_hook(previous)
    assert seen == ["prepare"]


# -- every documented dotted path imports --------------------------------------------------------------------------
#: ``lora_stream.a.b.C`` as prose, code, ``:class:`~lora_stream.X``` or ``::: lora_stream.X`` write it; not a file
#: path (``src/lora_stream/...``) or a distribution name (``lora_stream.egg-info``).
DOTTED = re.compile(r"(?<![\w/.-])lora_stream(?:\.[A-Za-z_]\w*)+(?![\w-])")


def _documented_paths() -> dict[str, set[str]]:
    """Every dotted path in docs/**/*.md, README.md and the package's docstrings, with where it is written."""
    texts: dict[str, str] = {}
    for page in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]:
        texts[str(page.relative_to(ROOT))] = page.read_text()
    for source in sorted((ROOT / "src" / "lora_stream").rglob("*.py")):
        tree = ast.parse(source.read_text())
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
        nodes += [n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef)]
        docs = [ast.get_docstring(n, clean=False) for n in nodes]
        # Attribute docstrings (a string literal right after an assignment, as mkdocstrings renders them).
        for body in (n.body for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef))):
            for first, second in itertools.pairwise(body):
                if isinstance(first, (ast.Assign, ast.AnnAssign)) and isinstance(second, ast.Expr):
                    if isinstance(second.value, ast.Constant) and isinstance(second.value.value, str):
                        docs.append(second.value.value)
        texts[str(source.relative_to(ROOT))] = "\n".join(d for d in docs if d)
    found: dict[str, set[str]] = {}
    for where, text in texts.items():
        for path in DOTTED.findall(text):
            found.setdefault(path, set()).add(where)
    return found


def _defined_in(module: str, name: str) -> bool:
    """Whether ``module``'s source defines ``name`` at its top level (for a module that needs an optional
    dependency this environment lacks: verl)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    tree = ast.parse(Path(spec.origin).read_text())
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
            (a.asname or a.name.split(".")[0]) == name for a in node.names
        ):
            return True
    return False


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except ModuleNotFoundError:  # a parent is not a package (``lora_stream.ParamStream.x``)
        return False


def resolve(path: str) -> None:
    """Import the longest module prefix of ``path``, then read the rest as attributes; raises if any part is
    missing."""
    parts = path.split(".")
    i = max(k for k in range(1, len(parts) + 1) if _is_module(".".join(parts[:k])))
    module = ".".join(parts[:i])
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "lora_stream":
            raise
        # Needs an optional dependency: the module exists; its attribute is checked in its source.
        assert i == len(parts) or _defined_in(module, parts[i]), f"{module} defines no {parts[i]}"
        return
    for attr in parts[i:]:
        obj = getattr(obj, attr)


def test_every_documented_dotted_path_imports() -> None:
    paths = _documented_paths()
    assert len(paths) > 50, "the docs lost their paths, or the pattern no longer finds them"
    broken = {}
    for path, where in sorted(paths.items()):
        try:
            resolve(path)
        except (ImportError, AttributeError, AssertionError) as exc:
            broken[path] = f"{sorted(where)}: {exc}"
    assert not broken, "dotted paths written in the docs that do not import:\n" + "\n".join(
        f"  {p}  ({why})" for p, why in broken.items()
    )


def test_the_path_check_catches_a_wrong_path() -> None:
    for wrong in ("lora_stream.sinks.ReloadBracket", "lora_stream.vllm_lease.UpdateLease", "lora_stream.Transaction"):
        with pytest.raises((ImportError, AttributeError)):
            resolve(wrong)
    resolve("lora_stream.engine.reload.ReloadBracket")
    resolve("lora_stream.engine.lease.UpdateLease")


# -- a sink given something that is not an engine --------------------------------------------------------------------
@pytest.mark.parametrize("sink", ["VLLMColocatedSink", "VLLMLoRASink"])
@pytest.mark.parametrize("llm", ["x", "http://localhost:8000", None, 3])
def test_a_vllm_sink_given_no_engine_is_a_type_error_naming_the_parameter(sink: str, llm: object) -> None:
    """Before anything else (no vLLM needed): not an ``AttributeError`` from inside the sink."""
    cls = getattr(lora_stream, sink)
    with pytest.raises(TypeError, match=rf"{sink}'s llm must be a vllm\.LLM") as caught:
        cls(llm)
    assert type(llm).__name__ in str(caught.value)
    if isinstance(llm, str):
        assert "VLLMServerSink" in str(caught.value), "a string is likely a server's URL"
