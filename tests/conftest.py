"""The suite's tiers, and what its modules share.

``slow``: a test that starts a real process or an engine -- trainer ranks (``launch``), a vLLM server, an in-process
vLLM engine, a subprocess -- in its body or in any fixture it uses, or that is marked so. Every other test runs in
this process on tiny models and is the fast tier (``nox -s tests -- -m "not slow"``, docs/development.md). CI runs
both.

``matrix``: a combination of feature, route and architecture that CI's pairwise set already covers pair by pair
(``docs/development.md``, "The matrix"); it runs in the whole product, ``nox -s matrix`` (``pytest --matrix``), and
is deselected -- not skipped -- everywhere else.
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
        funcs = [getattr(item, "function", None)]
        info = getattr(item, "_fixtureinfo", None)
        if info is not None:
            for defs in info.name2fixturedefs.values():
                funcs += [d.func for d in defs]
        if any(f is not None and _starts_something(f) for f in funcs):
            item.add_marker(pytest.mark.slow)
