"""What step 1 of a sync decided (:func:`~lora_stream.sinks.decide.decide`), on every rank alike: the one value each
later step receives (the steps: :mod:`lora_stream.sinks.route`).

Who reads it: step 2's transfer (:meth:`Route.transfer <lora_stream.sinks.route.Route.transfer>` sends its
:attr:`~Decision.source`), step 3's vote, step 4's commit and the sink's memory
(:meth:`SinkMemory.remember <lora_stream.sinks.memory.SinkMemory.remember>`). It lives in a module of its own so that
each of them depends on the decision, not on the step that makes it. What breaks if a later step reads the stream or
the memory again instead: it may see a state the other ranks did not agree on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..changes import Changes
from .source import SyncSource

__all__ = ["Decision"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What step 1 decided, on every rank alike."""

    #: What step 2 sends: every output, the changed ones, or the engine-side merge's inputs (with its recipes).
    source: SyncSource
    #: Tied aliases to offer (``{alias: primary}``).
    aliases: dict[str, str]
    #: The agreed outcome of what changed (``None``: every output goes, no agreement ran).
    changes: Changes | None
    #: An adapter sync's staging (``{"path", "config"}``); ``None``: a merged sync.
    adapter: dict[str, Any] | None
    #: Whether step 3 verifies this sync (the route chooses its probe).
    verifying: bool
    #: ``merge="engine"``: the stream's recipes, and this rank's fingerprints of the adapted steps' bases.
    merge_plan: Any
    base_fps: dict[str, int] | None
    #: Seconds of this step's parts (``fingerprint_s``, ``state_check_s``, ``decide_s``).
    stages: dict[str, Any]
    #: ``elements=True``: this rank's diff (:class:`~lora_stream.elements.ElementDiff`), staged as the baseline
    #: when the sync commits; ``None``: the sink sends no elements.
    element_diff: Any = None

    @property
    def full_because(self) -> str | None:
        """Why every output goes (``None``: a partial sync)."""
        return self.source.full_because if self.source.selection is None else None
