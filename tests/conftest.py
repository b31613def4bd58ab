"""The suite's tiers, and what its modules share.

``slow``: a test that starts a real process or an engine -- trainer ranks (``launch``), a vLLM server, an in-process
vLLM engine, a subprocess -- in its body or in any fixture it uses, or that is marked so. Every other test runs in
this process on tiny models and is the fast tier (``nox -s tests -- -m "not slow"``, docs/development.md). CI runs
both.

``matrix``: a combination of feature, route and architecture that CI's pairwise set already covers pair by pair
(``docs/development.md``, "The matrix"); it runs in the whole product, ``nox -s matrix`` (``pytest --matrix``), and
is deselected -- not skipped -- everywhere else.

Parallel: CI runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). Tests go to whichever worker
is free, one by one, except where they share what a module starts once: the tests of a module that use one of its
module-scoped fixtures that starts a process or an engine run on one worker, so that it starts once. The modules
whose engines use vLLM's CPU tensor parallelism under ``external_launcher`` run on one worker, one after another
(``_FIXED_SHM``). The heaviest modules go first (``_HEAVY_FIRST``), so that no long one starts last while the other
worker idles.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

#: What makes a test slow when its body, a fixture it uses, or a function of the tests they call, calls it.
_STARTS = re.compile(r"\b(launch|Server|LLM)\(|\bsubprocess\.")
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")
_TESTS = str(Path(__file__).resolve().parent)
#: Each test's and fixture's answer: many tests share fixtures.
_answers: dict[Any, bool] = {}
#: Modules with vLLM engines sliced across trainer ranks (``external_launcher``, tensor parallel on CPU). Such an
#: engine's rendezvous is ``env://``, so vLLM names its shared-memory segments without a port
#: (``-tp:0-[0-1]-cpushm_<rank>`` in ``/dev/shm``): two at once, on two workers, collide ("create shm ... errno: 17").
#: They run one after another, on one worker.
_FIXED_SHM = frozenset({"test_vllm_colocated_dist", "test_vllm_lora", "test_docs"})
#: Modules by their time in the last measured run, longest first (docs/development.md, "The budget"): xdist hands
#: tests out in collection order, so a long one collected last would run alone at the end.
_HEAVY_FIRST = (
    "test_vllm_soak",
    "test_vllm_fleet",
    "test_trl",
    *sorted(_FIXED_SHM),  # one group on one worker, about as long as the modules before it: never the tail
    "test_vllm_server",
    "test_architectures",
)


def _starts_something(func: Any) -> bool:
    """Whether ``func``, or a function of the test modules it calls by name (followed through them), starts a
    process or an engine."""
    if func not in _answers:
        _answers[func] = _reads_as_starting(func, set())
    return _answers[func]


def _reads_as_starting(func: Any, seen: set[Any]) -> bool:
    if func in seen:  # a cycle of calls: what it starts is found on its first visit
        return False
    seen.add(func)
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if _STARTS.search(source):
        return True
    scope = getattr(func, "__globals__", {})
    callees = (scope.get(name) for name in set(_CALL.findall(source)))
    return any(
        inspect.isfunction(f) and f.__code__.co_filename.startswith(_TESTS) and _reads_as_starting(f, seen)
        for f in callees
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--matrix",
        action="store_true",
        help="run the whole product of features, routes and architectures (nox -s matrix), not CI's pairwise set",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts a process or an engine (left out of the fast tier)")
    config.addinivalue_line(
        "markers", "matrix: beyond CI's pairwise set; run by `nox -s matrix` (pytest --matrix), deselected otherwise"
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the tests' ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--matrix"):
        beyond = [item for item in items if item.get_closest_marker("matrix")]
        if beyond:
            config.hook.pytest_deselected(items=beyond)
            items[:] = [item for item in items if not item.get_closest_marker("matrix")]
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.slow)
            continue
        funcs = [getattr(item, "function", None), *(d.func for d in _fixture_defs(item))]
        if any(f is not None and _starts_something(f) for f in funcs):
            item.add_marker(pytest.mark.slow)
    _group_for_workers(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Under ``--dist loadgroup``, xdist reads a test's group from a suffix of its id; where it did not write one
    (pytest 9.2 with pytest-xdist 3.8: noxfile.py pins pytest below), the tests sharing an engine would silently
    start it once per worker, and the tensor-parallel ones collide. Refused instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests marked xdist_group (the first: {lost[0]}): this pytest and "
            "pytest-xdist do not work together; install the test tools noxfile.py pins (TEST_TOOLS)"
        )


def _fixture_defs(item: pytest.Item) -> list[Any]:
    """Every fixture definition ``item`` uses, as pytest resolved them (directly or through other fixtures)."""
    info = getattr(item, "_fixtureinfo", None)
    return [] if info is None else [d for defs in info.name2fixturedefs.values() for d in defs]


def _group_of(item: pytest.Item) -> str | None:
    """The xdist group of ``item``: ``None`` (any worker) unless it must share a worker with other tests."""
    module = item.path.stem
    if module in _FIXED_SHM:
        return "fixed_shm"
    if any(d.scope in ("module", "package", "session") and _starts_something(d.func) for d in _fixture_defs(item)):
        return module
    return None


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Mark each test that must share a worker with its xdist group (ignored without ``-n``), and order the modules
    heaviest first; the order within a module stays pytest's, so module-scoped fixtures still start once per module
    and worker."""
    for item in items:
        group = _group_of(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))

    def rank(item: pytest.Item) -> int:
        module = item.path.stem
        return _HEAVY_FIRST.index(module) if module in _HEAVY_FIRST else len(_HEAVY_FIRST)

    items.sort(key=rank)  # stable: modules keep their order, and their tests theirs
