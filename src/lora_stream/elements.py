"""Trainer side of an element sync: each rank finds, in its own shard, the elements that changed since the last
committed sync, and only those travel -- never gathered, never merged.

Who calls it: step 1 of a sync (:mod:`lora_stream.sinks.decide`), on every rank, when the sink was built with
``elements=True``. What it covers, per step of the stream's plan (:meth:`ParamStream.steps`):

* **Eligible**: one trainable parameter in, one output out, no merge and no checkpoint conversion (the output is
  the parameter, cast to the served dtype: a per-element identity), and a gatherer that can say which flat range of
  the parameter this rank holds (:func:`shard_of`, the gatherer's ``flat_range``): ZeRO-3's partition
  (``ds_tensor``), FSDP2's ``Shard(0)`` local shard, or the whole tensor where nothing is sharded (one process,
  DDP). Everything else -- a LoRA merge, a fused expert conversion, a quantized base, a persistent ZeRO-3
  parameter, a frozen one (which the fingerprints skip whole already) -- goes as before, and
  :attr:`ElementRead.why` says why.
* **The baseline** (:class:`ElementBaseline`): this rank's shard of every eligible output, cast to the served dtype,
  as the engines hold it since the last committed sync -- where the shard lives (on a GPU trainer, its device),
  ``1/N`` of the model under ZeRO-3 and FSDP2. The diff advances it in place (no second copy; the old values of
  the changed elements are kept until the sync ends), and it counts again only when the sync commits
  (:meth:`ElementBaseline.commit`: nothing that can fail after the vote); until then, and after any failed sync,
  nothing is known.
* **The diff** (:func:`read_elements`, one pass over the plan's steps; :func:`diff_shard`, one pass over a shard,
  a chunk at a time, on its device): each chunk cast, compared with the baseline *bit for bit* and fingerprinted
  while at hand; the changed elements, encoded (:mod:`lora_stream.element_codec`: only they leave the device), and
  the fingerprint of the whole new shard, which the engine checks against what it rebuilt (every sync proves the
  engine loads what a full sync would have loaded).
* **The exchange** (:func:`exchange`): the ranks feeding engines need every rank's changes; the encoded changes
  (not the tensors) are all-gathered over the stream's process group.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .element_codec import Encoded
from .element_diff import Segment, diff_segment, diff_shard
from .gatherers.base import FlatRange

__all__ = [
    "check_elements_option",
    "ElementBaseline",
    "ElementDiff",
    "Segment",
    "ElementRead",
    "StepReads",
    "diff_shard",
    "exchange",
    "read_elements",
    "shard_of",
]


@dataclass(frozen=True)
class StepReads:
    """What step 1 read of a stream's local shards (:meth:`ParamStream.read_steps
    <lora_stream.ParamStream.read_steps>`), each shard once."""

    #: Per step, in stream order, :meth:`ParamStream.fingerprints <lora_stream.ParamStream.fingerprints>`.
    fingerprints: list[int | None]
    #: The element read of the trainable steps (``None``: the sink sends no elements this sync).
    elements: ElementRead | None
    #: Seconds spent fingerprinting the frozen steps.
    fingerprint_s: float


def check_elements_option(elements: bool, skip_unchanged: bool, merge: str) -> bool:
    """The sinks' ``elements`` option, checked at construction (the same rule for every sink)."""
    if not isinstance(elements, bool):
        raise TypeError(f"elements must be True or False, got {elements!r}")
    if elements and not skip_unchanged:
        raise ValueError(
            "elements=True sends only what changed against what the engines provably hold; it needs skip_unchanged=True"
        )
    if elements and merge != "trainer":
        raise ValueError(
            "elements=True sends the merged outputs' changed elements; merge='engine' sends merge inputs instead "
            "(a LoRA's factors already are its few changed bytes): use one or the other"
        )
    return elements


def shard_of(gatherer: Any, param: Any, numel: int) -> FlatRange | str:
    """This rank's flat range of ``param`` (``numel`` elements whole) under ``gatherer`` (its ``flat_range``), or why
    it has none that an element sync can use. A gatherer of its own without ``flat_range`` cannot say: its outputs
    go whole."""
    flat_range = getattr(gatherer, "flat_range", None)
    if flat_range is None:
        name = getattr(gatherer, "name", type(gatherer).__name__)
        return f"the {name} gatherer does not say which elements of a parameter this rank holds (no flat_range)"
    answer: FlatRange | str = flat_range(param, numel)
    return answer


def _shard_if_eligible(step: Any, gatherer: Any) -> FlatRange | str:
    """This rank's shard of ``step``'s one parameter if the step can go as elements, or why not (the same on every
    rank: it reads the plan and the parameter's placement only)."""
    if len(step.inputs) != 1 or len(step.outputs) != 1 or step.convert is not None:
        return "a checkpoint conversion that is not one tensor as is (fused or split)"
    t = step.inputs[0]
    if t.merge is not None:
        return "a merged LoRA output (or a buffer): computed from gathered tensors"
    if not getattr(t.param, "requires_grad", True):  # no merge: the step reads its own parameter only
        return "frozen (skipped whole when unchanged)"
    if getattr(t.param, "quant_state", None) is not None or not t.dtype.is_floating_point:
        return "a quantized parameter"
    numel = math.prod(int(d) for d in step.outputs[0].shape)
    if math.prod(int(d) for d in gatherer.full_shape(t.param)) != numel:
        return "an output whose element count differs from its parameter's"
    return shard_of(gatherer, t.param, numel)


@dataclass
class ElementDiff:
    """This rank's diff of every eligible step against its baseline (``changed[i]``: any element of step ``i``
    changed here, or there was no baseline), its segments, and the new shards (the baseline once committed)."""

    changed: dict[int, bool]
    segments: dict[int, Segment]
    new: dict[int, torch.Tensor]
    #: Bytes of the baseline this rank keeps (the new shards), and of the diff's segments.
    baseline_bytes: int = 0
    seconds: float = 0.0
    #: Why the other steps cannot go as elements: reason -> how many (what the record shows).
    whole_because: dict[str, int] = field(default_factory=dict)


@dataclass
class ElementBaseline:
    """This rank's shards of the eligible outputs as the engines hold them since the last committed sync.

    A read (:func:`read_elements`) advances the shards in place: it takes them (:meth:`open`), and from then on
    nothing is valid until the sync commits (:meth:`stage`, :meth:`commit`). What the read overwrote is kept, the
    old values of exactly the changed elements, so that a sync failing before any engine was touched puts the shards
    back bit for bit (:meth:`restore`); a sync failing later leaves none (:meth:`forget`)."""

    #: The stream plan the shards follow (:attr:`ParamStream.plan_digest`); ``None``: nothing committed.
    plan: str | None = None
    shards: dict[int, torch.Tensor] = field(default_factory=dict)
    #: The next baseline, from this sync's diff; installed by :meth:`commit`.
    pending: tuple[str, dict[int, torch.Tensor]] | None = None
    #: While a read's sync is open: the plan and shards it took, and (shard, index, old values) of each write.
    _undo: tuple[str | None, dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] | None = (
        field(default=None, repr=False)
    )

    @property
    def nbytes(self) -> int:
        """Bytes of the shards held (where each shard lives: on a GPU trainer, its device)."""
        return sum(t.numel() * t.element_size() for t in self.shards.values())

    def valid_for(self, plan: str) -> bool:
        return self.plan is not None and self.plan == plan

    def open(self, plan: str) -> tuple[dict[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
        """A read begins: the shards it compares with and advances in place (none unless they follow ``plan``), and
        the journal where it notes each write (``(shard, index, old values)``). Nothing is valid from here until
        :meth:`commit`, or :meth:`restore`."""
        valid = self.valid_for(plan)
        held = self.shards if valid else {}
        journal: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._undo = (self.plan, self.shards, journal) if valid else None
        self.plan, self.shards, self.pending = None, {}, None
        return held, journal

    def restore(self) -> None:
        """The read's sync failed before any engine was touched: the shards it took, as they were (the old values
        written back), valid again. Nothing to do without an open read."""
        if self._undo is not None:
            plan, shards, writes = self._undo
            for shard, index, old in reversed(writes):
                shard.index_copy_(0, index, old)
            self.plan, self.shards, self.pending, self._undo = plan, shards, None, None

    @contextmanager
    def restored_on_failure(self) -> Iterator[None]:
        """Around step 1 (no engine touched yet): an exception restores what a read advanced (:meth:`restore`)."""
        try:
            yield
        except BaseException:
            self.restore()
            raise

    def stage(self, plan: str, new: dict[int, torch.Tensor]) -> None:
        """Before the vote: what :meth:`commit` will install."""
        self.pending = (plan, new)

    def commit(self) -> None:
        """After every rank voted to commit: the staged shards are the baseline (a reference swap)."""
        if self.pending is not None:
            self.plan, self.shards = self.pending
        self.pending = self._undo = None

    def forget(self) -> None:
        """A failed sync, or a sync not sent as elements: nothing is known (the next element sync sends every
        element of every eligible output once more)."""
        self.plan, self.shards, self.pending, self._undo = None, {}, None, None


#: An element sync sends elements only while their encoded bytes stay at most this fraction of the element steps'
#: whole bytes on every rank; past it, the whole tensors cost about the same and need no exchange between ranks.
ELEMENT_BUDGET = 0.5


@dataclass
class ElementRead:
    """What step 1 reads of the stream for an element sync, once (:func:`read_elements`): the rest of the decision
    (the agreement, the exchange, the engines' copies) takes this, and never goes back to the stream."""

    #: This rank's diff of the eligible steps; its ``whole_because`` says why the others go whole.
    diff: ElementDiff
    #: For every step, ``None`` if it can go as elements, or why not (the same on every rank).
    why: dict[int, str | None]
    #: Why this rank cannot send elements this sync (``None``: it can).
    refused: str | None
    #: The output names the engines keep a copy of, for the next element sync: every element step's.
    shadow: list[str]
    #: How many steps the stream's plan has.
    steps: int
    #: What the exchange runs over: the stream's process group, whether it is sharded, and how long a rank waits.
    group: Any
    collective: bool
    timeout_s: float

    def exchange(self, needed: frozenset[int] | None) -> dict[int, list[Segment]]:
        """Every rank's segments of the element steps this sync sends (of ``needed``; ``None``: every step), on
        every rank: :func:`exchange` over the stream's group."""
        steps = sorted(i for i in self.diff.segments if needed is None or i in needed)
        return exchange(self.group, self.collective, self.diff.segments, steps, self.timeout_s)


def read_elements(stream: Any, baseline: ElementBaseline) -> ElementRead:
    """One pass over the steps of ``stream``'s plan: which can go as elements, and for each of those this rank's
    diff against ``baseline`` (compared only if it follows this stream's plan); then whether this rank can send
    them, and what the exchange needs of the stream. Reads each eligible local shard once, on its device
    (:func:`diff_shard`); the baseline is advanced in place, and is not valid again until this sync commits."""
    import time

    t0 = time.perf_counter()
    usable = baseline.valid_for(stream.plan_digest)
    # The read advances the baseline's shards in place: from here on nothing is valid until this sync commits, and
    # what each write replaced is kept for a failure before any engine was touched (ElementBaseline.restore).
    held, undo = baseline.open(stream.plan_digest)
    gatherer = stream.gatherer
    why: dict[int, str | None] = {}
    outputs: list[str] = []
    diff = ElementDiff({}, {}, {})
    for i, step in enumerate(stream._steps):
        out = step.outputs[0]
        outputs.append(out.name)
        shard = _shard_if_eligible(step, gatherer)
        if isinstance(shard, str):
            why[i] = shard
            diff.whole_because[shard] = diff.whole_because.get(shard, 0) + 1
            continue
        why[i] = None
        old = held.get(i)
        segment, new, changed = diff_segment(shard.values, shard.offset, out.dtype, old, undo)
        diff.changed[i] = changed or old is None
        diff.segments[i] = segment
        diff.new[i] = new
        diff.baseline_bytes += new.numel() * new.element_size()
    diff.seconds = time.perf_counter() - t0
    return ElementRead(
        diff,
        why,
        _refusal(diff, usable),
        [outputs[i] for i in diff.segments],
        len(outputs),
        gatherer.process_group,
        bool(gatherer.collective),
        stream.agreement_timeout.total_seconds(),
    )


def _refusal(diff: ElementDiff, baseline_valid: bool) -> str | None:
    """Why this rank cannot send elements this sync (``None``: it can)."""
    if not baseline_valid:
        return "no element baseline of the engines' version on this rank yet (the last sync was full or failed)"
    if not diff.segments:
        return "no output can travel as elements (see docs: element syncs)"
    whole = sum(s.hi - s.lo for s in diff.segments.values())
    sent = sum(s.encoded.blob.numel() for s in diff.segments.values())
    itemsize = max(1, max(s.encoded.dtype.itemsize for s in diff.segments.values()))
    if sent > ELEMENT_BUDGET * whole * itemsize:
        return f"too many elements changed: {sent / max(1, whole * itemsize):.0%} of the bytes as elements"
    return None


def _frame(segments: dict[int, Segment]) -> torch.Tensor:
    """This rank's segments as one ``uint8`` tensor: an 8-byte header length, a JSON header, the blobs (no pickle)."""
    import json

    head = [
        [
            i,
            s.lo,
            s.hi,
            s.fp,
            s.encoded.encoding,
            s.encoded.count,
            s.encoded.numel,
            str(s.encoded.dtype)[6:],
            int(s.encoded.blob.numel()),
        ]
        for i, s in segments.items()
    ]
    raw = json.dumps(head).encode()
    parts = [
        torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8),
        torch.frombuffer(bytearray(raw), dtype=torch.uint8),
    ]
    parts += [s.encoded.blob.reshape(-1).to(torch.uint8) for s in segments.values()]
    return torch.cat(parts)


def _unframe(frame: torch.Tensor) -> dict[int, Segment]:
    import json

    n = int(frame[:8].clone().view(torch.int64).item())
    at = 8 + n
    out: dict[int, Segment] = {}
    for i, lo, hi, fp, encoding, count, numel, dtype, size in json.loads(bytes(frame[8:at].tolist()).decode()):
        out[int(i)] = Segment(
            lo, hi, Encoded(encoding, count, numel, getattr(torch, dtype), frame[at : at + size].clone()), fp
        )
        at += size
    return out


def exchange(
    group: Any, collective: bool, segments: dict[int, Segment], steps: Sequence[int], timeout: float = 300.0
) -> dict[int, list[Segment]]:
    """Every rank's segments of ``steps`` (ascending by range), on every rank: two all-gathers over ``group`` (the
    sizes, then the encoded changes, never the tensors) when the stream is sharded (``collective``); this rank's own
    otherwise (each rank holds every element). Each waits ``timeout`` seconds at most, then raises: every rank
    reaches it right after an agreement they all completed, so a rank missing from it has failed."""
    from .errors import StreamAbortedError

    mine = {i: segments[i] for i in steps}
    if not collective or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {i: [s] for i, s in mine.items()}
    world = dist.get_world_size(group)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    frame = _frame(mine).to(device)

    def gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        outs = [torch.empty_like(t) for _ in range(world)]
        try:
            work = dist.all_gather(outs, t, group=group, async_op=True)
            done = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except Exception as exc:
            raise StreamAbortedError(f"the exchange of changed elements ({what}) failed: {exc}") from exc
        if done is False:
            raise StreamAbortedError(f"the exchange of changed elements ({what}) timed out after {timeout:.0f} s")
        return outs

    sizes = gather(torch.tensor([frame.numel()], dtype=torch.int64, device=device), "sizes")
    longest = max(int(x.item()) for x in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: frame.numel()] = frame
    frames = gather(padded, "changes")
    out: dict[int, list[Segment]] = {i: [] for i in steps}
    for size, theirs in zip(sizes, frames):
        for i, seg in _unframe(theirs[: int(size.item())].cpu()).items():
            out[i].append(seg)
    for segs in out.values():
        segs.sort(key=lambda s: s.lo)
    return out
