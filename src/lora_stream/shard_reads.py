"""Step 1's read of a stream's local shards, once per sync: the fingerprint of every frozen step
(:mod:`lora_stream.step_reads`) and, for element syncs, the diff of every trainable step that can go as elements
(:mod:`lora_stream.elements`).

Who calls it: step 1 of a sync that may be partial (:mod:`lora_stream.sinks.decide`), on every rank, inside the
transaction's pre-flight. What breaks if it is bypassed: a shard read twice, once to prove it and once to send it,
could change between the reads; read apart, the two reads would each walk the plan again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .elements import ElementBaseline, ElementRead, read_elements
from .step_reads import fingerprints

__all__ = ["StepReads", "read_steps"]


@dataclass(frozen=True)
class StepReads:
    """What step 1 read of a stream's local shards (:func:`read_steps`), each shard once."""

    #: Per step, in stream order, :meth:`ParamStream.fingerprints <lora_stream.ParamStream.fingerprints>`.
    fingerprints: list[int | None]
    #: The element read of the trainable steps (``None``: the sink sends no elements this sync).
    elements: ElementRead | None
    #: Seconds spent fingerprinting the frozen steps.
    fingerprint_s: float


def read_steps(stream: Any, baseline: ElementBaseline | None) -> StepReads:
    """Every local shard a sync that may be partial needs, read once: with a ``baseline`` (a sink built with
    ``elements=True``), the trainable steps' element diff against it (:func:`~lora_stream.elements.read_elements`);
    then the frozen steps' fingerprints. The two read disjoint shards: the fingerprints skip every step with a
    trainable source, and only such a step can go as elements."""
    read = read_elements(stream, baseline) if baseline is not None else None
    t = time.perf_counter()
    fps = fingerprints(stream._steps, stream.gatherer)
    return StepReads(fps, read, time.perf_counter() - t)
