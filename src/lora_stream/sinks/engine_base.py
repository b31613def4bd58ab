"""Trainer side of the merge in the engine, shared by every sink that offers it: which base the engines hold from
this sink, and when it must travel again (:mod:`lora_stream.engine_merge`).

A sink with ``merge="engine"`` keeps one :class:`EngineBaseRecord`. In its pre-flight it builds the stream's
recipes (:meth:`plan`, refusing what the engine cannot merge) and this rank's fingerprints of the bases under
adapters (:meth:`EngineMergePlan.base_fingerprints`); :meth:`reason` says why this rank needs the base sent again
(the sink passes it to :func:`~lora_stream.changes.agree_on_changes` as ``force_full``, so every rank decides
alike); after the sync, :meth:`remember` records what a committed full sync sent, or forgets everything after a
failure. The sink sends an :class:`~lora_stream.sinks.source.EngineMergeSource` built with :attr:`sent`.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from ..changes import SyncedSources
from ..engine_merge import EngineMergePlan
from ..stream import ParamStream

__all__ = ["EngineBaseRecord"]


class EngineBaseRecord:
    """What this rank knows of the base its engines hold from this sink's engine-side merges."""

    def __init__(self) -> None:
        self._plans: weakref.WeakKeyDictionary[ParamStream, EngineMergePlan] = weakref.WeakKeyDictionary()
        #: The whole-tensor fingerprint of every base tensor the last committed full sync sent (``None``: none).
        self.sent: dict[str, int] | None = None
        #: This rank's shard fingerprints of the adapted steps' bases at that sync.
        self.synced: dict[str, int] | None = None
        #: The sources that were trained inputs when the engines' base was sent, and those of the current plan.
        self._trainable_sent: frozenset[str] | None = None
        self._trainable_now: frozenset[str] = frozenset()

    def plan(self, stream: ParamStream) -> EngineMergePlan:
        """``stream``'s recipes (built once per stream and plan, and again when a source's ``requires_grad``
        changed; refuses what the engine cannot merge exactly). When the sources that are trained inputs differ
        from those at the full sync that sent the engines' base (a weight frozen or unfrozen since, with this
        stream or a new one), the next sync sends the base again (:meth:`reason`): a weight frozen since is in no
        engine's base, and the recipes' split into base and trained inputs is another."""
        found = self._plans.get(stream)
        if found is None or found.digest != stream.plan_digest or found.trainable_changed():
            found = EngineMergePlan(stream)
            self._plans[stream] = found
        self._trainable_now = frozenset(s.source for s in found.inputs.values() if s.trainable)
        return found

    @property
    def stale_because(self) -> str | None:
        """Why the base the engines hold does not fit the current plan (``None``: it does)."""
        if self._trainable_sent is None or self._trainable_sent == self._trainable_now:
            return None
        changed = sorted(self._trainable_sent ^ self._trainable_now)
        shown = ", ".join(repr(s) for s in changed[:3]) + (" ..." if len(changed) > 3 else "")
        return f"requires_grad changed for {shown} since the engine's base was sent: the base is sent again"

    def reason(
        self,
        base_fps: dict[str, int] | None,
        fingerprints: Sequence[int | None] | None,
        last: SyncedSources | None,
    ) -> str | None:
        """Why this rank needs the base sent again with every output (``None``: the engines hold it)."""
        if self.sent is None:
            return "the engines hold no base from this sink's engine-side merges yet"
        if self.stale_because is not None:
            return self.stale_because
        if base_fps is None:
            return "this gatherer cannot fingerprint its shards, so the engine's base is sent at every sync"
        if base_fps != self.synced:
            return "a frozen base weight under an adapter changed on this rank: the engine's base is sent again"
        fps = fingerprints or []
        if last is not None and any(fp is not None and fp != old for fp, old in zip(fps, last.fingerprints)):
            return "a frozen weight changed on this rank: the engine's base is sent again"
        return None

    def remember(self, committed: bool, source: Any, base_fps: dict[str, int] | None) -> None:
        """After a sync: a committed full one leaves its base in the engines; a failure leaves nothing known."""
        if not committed or source is None:
            self.forget()
        elif source.selection is None:
            self.sent = dict(source.base_fp)
            self.synced = base_fps
            self._trainable_sent = self._trainable_now

    def forget(self) -> None:
        self.sent = self.synced = self._trainable_sent = None
