"""Units: names that must travel together into an engine.

An engine module that reads two checkpoint names (vLLM's fused ``qkv_proj`` reads ``q_proj``, ``k_proj`` and
``v_proj``) must receive all of them in one update or none: a partial update that brings one of them reloads the
module from what arrived and what it kept, and what it kept may be stale. The engine's load map, the workers' reports,
the sender's merge of servers and the trainer's agreement on what to send all need the same closure, so it lives here,
in a module that imports neither vLLM nor torch (the trainer imports it without an engine installed).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

__all__ = ["Partition", "merge_units"]

K = TypeVar("K", bound=Hashable)


class Partition(Generic[K]):
    """Disjoint sets of keys, joined by :meth:`join`; a key never joined is alone."""

    def __init__(self) -> None:
        self._parent: dict[K, K] = {}

    def find(self, x: K) -> K:
        """The representative of ``x``'s set (the same for every key of one set)."""
        parent = self._parent
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(self, keys: Iterable[K]) -> None:
        """Put every key of ``keys`` in one set (with every key already joined to any of them)."""
        it = iter(keys)
        first = next(it, None)
        if first is None:
            return
        root = self.find(first)
        for k in it:
            other = self.find(k)
            if other != root:
                self._parent[other] = root

    def sets(self) -> list[list[K]]:
        """Every set with more than one key, each in the order its keys were first seen."""
        out: dict[K, list[K]] = {}
        for k in self._parent:
            out.setdefault(self.find(k), []).append(k)
        return [s for s in out.values() if len(s) > 1]


def merge_units(a: list[list[str]] | None, b: list[list[str]] | None) -> list[list[str]] | None:
    """Two workers' (or two servers') units as one: names joined by either travel together. ``None`` (unknown)
    wins: nothing may be left out where one side cannot tell."""
    if a is None or b is None:
        return None
    p: Partition[str] = Partition()
    for unit in (*a, *b):
        p.join(unit)
    return sorted(sorted(s) for s in p.sets())
