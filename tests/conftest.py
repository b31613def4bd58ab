"""The suite's tiers, and what its modules share.

``slow``: a test that starts a real process or an engine -- trainer ranks (``launch``), a vLLM server, an in-process
vLLM engine, a subprocess -- in its body or in any fixture it uses, or that is marked so. Every other test runs in
this process on tiny models and is the fast tier (``nox -s tests -- -m "not slow"``, docs/development.md). CI runs
both.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

#: What makes a test slow when its body, a fixture it uses, or a function of the tests they call, calls it.
_STARTS = re.compile(r"\b(launch|Server|LLM)\(|\bsubprocess\.")
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")


def _starts_something(func: Any, seen: set[Any] | None = None) -> bool:
    """Whether ``func``, or a function of the test modules it calls by name (followed through them), starts a
    process or an engine."""
    seen = set() if seen is None else seen
    if func in seen:
        return False
    seen.add(func)
    try:
        source = inspect.getsource(func)
    except (OSError, TypeError):
        return False
    if _STARTS.search(source):
        return True
    scope = getattr(func, "__globals__", {})
    for name in set(_CALL.findall(source)):
        callee = scope.get(name)
        if inspect.isfunction(callee) and _is_test_code(callee) and _starts_something(callee, seen):
            return True
    return False


def _is_test_code(func: Any) -> bool:
    return str(getattr(func, "__code__", None) and func.__code__.co_filename).startswith(_TESTS)


_TESTS = str(__import__("pathlib").Path(__file__).resolve().parent)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts a process or an engine (left out of the fast tier)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
