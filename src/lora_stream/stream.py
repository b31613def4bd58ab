"""``ParamStream``: a model as a stream of ``(hf_name, merged_tensor)`` pairs, one group at a time.

A pass's types are :mod:`lora_stream.stream_pass`'s; what a step reads, :mod:`lora_stream.step_reads`'s.
"""

from __future__ import annotations

import datetime
import time
import weakref
from collections.abc import Generator
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .buffers import HeapTrimmer, OutputPool, ProcessMemory, Scratch
from .checkpoint_format import Layout
from .coordination import Coordinator
from .core import Step, Unit
from .elements import ElementBaseline, StepReads, read_elements
from .errors import LoraStreamError, StreamAbortedError
from .gatherers import Gatherer, auto_gatherer
from .gatherers.base import nbytes
from .grouping import DEFAULT_BUDGET_BYTES, Group, GroupBy, partition
from .lockstep import FLAG_CAPACITY, Lockstep, Status, describe_error
from .merge import DEFAULT_MERGE_BLOCK_BYTES, FullTensor
from .names import NameNormalizer, Renames
from .plan import Target, plan_model
from .step_reads import _params_read, fingerprints
from .stream_pass import InputRequest, ParamMeta, PassRecord, PassState, Selection, StreamPass, StreamStats
from .witness import PlanWitness

__all__ = ["ParamStream"]

#: A pass trims the heap only once the process has grown by this many times its largest group (the gather buffer
#: and one group's outputs are expected; freed memory beyond that is what trimming is for), so growth stays near
#: 3x the largest group without paying ``malloc_trim`` and the page faults after it on every sync.
_TRIM_BOUND_GROUPS = 1.5


#: Where the resident set cannot be read: trim once this many gathered bytes have been released.
_TRIM_EVERY_BYTES = 64 * 1024 * 1024


class ParamStream:
    """A model's weights as ``(hf_name, tensor)`` pairs, LoRA merged out of place, produced one group at a time.

    ``ParamStream(model)`` plans the stream (names, merges, groups) from the model's structure and whole shapes;
    nothing is gathered, read or communicated until it is iterated. Each ``iter(stream)`` is a fresh pass.

    The contract (each point is tested):

    1. **Names and layouts are the checkpoint's**: exactly the keys and tensors ``save_pretrained`` writes for
       ``merge_and_unload()``, through transformers' own reversible weight conversions (MoE experts one tensor per
       expert, GPT-NeoX's ``embed_out``, ...), applied one conversion at a time within a group. Without
       conversions these are the keys of ``merge_and_unload().state_dict()``; ``layout="memory"`` yields
       ``named_parameters()`` names and layouts instead. Wrapper segments (PEFT's ``base_model.model``, ``base_layer``,
       ``modules_to_save.<adapter>``, ``original_module``, DDP's ``module``, ``_orig_mod``,
       ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``) are dropped by structure, never by substring
       replacement; the adapter names are read from the model. ``renames`` run last.
    2. **Values** equal peft's ``merge_and_unload()`` of the active adapters, computed in float32 and rounded once to
       ``dtype`` (default: each base parameter's own dtype). With adapters disabled the base weights come out, as
       the model computes its forward.
    3. **Coverage**: every parameter of the merged model exactly once; a tied weight once, under the name
       ``named_parameters()`` gives it. Persistent buffers the checkpoint holds are yielded too, in their own
       dtype (none with ``layout="memory"``). Adapter weights are not yielded.
    4. **The model is never written to**: merged tensors are fresh; parameters and peft's ``merged`` flags are
       bitwise unchanged after any number of passes.
    5. **Order** is the model's registration order, so a decoder layer's tensors arrive together; the tensors one
       checkpoint conversion writes come together, and never straddle two groups.
    6. **Memory**: at most one group is gathered at a time, and within it one merged tensor is computed at a time
       (``iter_groups()`` holds the group's outputs together). A parameter that needs no merge and no cast is
       yielded without a copy. A yielded tensor may alias the trainer's storage or a gathered buffer: treat it as
       read-only and as valid until the stream moves past its group; clone it to keep it.
    7. **Early stop** (``break``, an exception in the consumer, ``close()``) leaves the model untouched and releases
       everything the pass held. Under a sharded gatherer the other ranks raise
       :class:`~lora_stream.StreamAbortedError` naming the rank, at the latest one group later -- once the pass
       has ended: iterate inside ``with`` (:class:`StreamPass`) so that it ends when the exception leaves the block,
       even if a traceback keeps the iterator alive.
    8. ``metadata()`` describes the whole stream without materializing or communicating anything and agrees with
       iteration element for element; ``groups()`` / ``iter_groups()`` expose the groups. Together these satisfy
       vLLM's ``WeightSource`` contract structurally; its groups are vLLM's ``layerwise_groups`` (what
       ``sharded_rdt`` requires) under ``group_by="layer"``, the default (``tests/test_weight_source.py``, docs
       "vLLM's own weight-transfer engines").

    Args:
        model: the trainer's model: a ``PeftModel``, a plain ``nn.Module``, or either wrapped (DDP, DeepSpeed
            engine, ``torch.compile``, activation checkpointing, FSDP).
        dtype: output dtype of every tensor (``None``: each base parameter's own dtype).
        gatherer: how groups are made whole; chosen from the model when ``None``.
        group_by: ``"layer"`` (default: one decoder layer per group, what vLLM's layerwise reload needs; what
            comes before the layers, the embeddings, and after them, the norm and ``lm_head``, a group each),
            ``"budget"`` (consecutive modules up to ``budget_bytes``: fewer, larger groups) or ``"module"``.
        budget_bytes: byte budget of a ``"budget"`` group, counted as whole bytes of the parameters gathered for it
            (base and adapter weights). A single module larger than the budget forms a group of its own.
        renames: a mapping of anchored name prefixes, or a callable, applied to every final name.
        merge_block_bytes: largest float32 block a merge holds at once.
        timeout: seconds a rank waits at a group boundary for its peers before raising (sharded gatherers only).
        reuse_outputs: hand the previous group's output tensors out again for the next group (same shape and
            dtype). Saves an allocation per merged tensor; only for consumers that keep no reference to a tensor
            past its group (a sink that copies, e.g. vLLM's ``load_weights``; not one that stores the tensors).
        release_memory: return memory freed inside the process to the OS (glibc ``malloc_trim``; a no-op
            elsewhere) once the pass has grown the resident set by more than 1.5x its largest group, so freed
            gather buffers and outputs do not pile up across groups (checked after each group).
        measure_rss: record the process's resident-set peak during each pass in ``last_stats`` (Linux; resets
            the process's ``VmHWM``).
        layout: ``"checkpoint"`` (default: names, layouts and persistent buffers as ``save_pretrained`` writes
            them, what inference engines load) or ``"memory"`` (``named_parameters()`` as transformers holds them).
        prefetch: start gathering the next group as soon as the current one is whole, so the gather overlaps the
            merge and the consumer (gatherers that support it: ZeRO-3's direct path). Holds two groups at once;
            ``last_stats.peak_gathered_bytes`` counts both.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        UnsupportedAdapterError, UnsupportedModelError, NameCollisionError, RenameError, CheckpointFormatError:
            from planning, before anything is produced; the model is left as it was.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype | None = None,
        gatherer: Gatherer | None = None,
        group_by: GroupBy = "layer",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        renames: Renames = None,
        merge_block_bytes: int = DEFAULT_MERGE_BLOCK_BYTES,
        timeout: float = 300.0,
        reuse_outputs: bool = False,
        release_memory: bool = True,
        measure_rss: bool = False,
        layout: Layout = "checkpoint",
        prefetch: bool = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ParamStream needs a torch.nn.Module, got {type(model).__name__}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype or None, got {dtype!r}")
        if merge_block_bytes <= 0:
            raise ValueError(f"merge_block_bytes must be positive, got {merge_block_bytes}")
        self.model = model
        self.gatherer: Gatherer = gatherer if gatherer is not None else auto_gatherer(model)
        g = self.gatherer
        #: What the plan read from the model; every pass checks it again (:meth:`check_plan`).
        self._witness = PlanWitness()
        units, self._aliases = self._plan(model, dtype, renames, merge_block_bytes, layout)
        self.layout: Layout = layout
        self._groups = partition(units, group_by, budget_bytes, g.gather_bytes)
        self._meta = [ParamMeta(o.name, o.dtype, o.shape) for grp in self._groups for o in grp.outputs]
        #: Every step in stream order (a selection's indices refer to it).
        self._steps: list[Step] = [step for grp in self._groups for step in grp.steps]
        # What ranks compare in every status exchange: fixed by the plan, so computed once. The adapter state the
        # plan read is part of it: ranks set to different adapters must not serve a mix.
        self._digest = (
            ";".join(f"{m.name}:{m.dtype}:{m.shape}" for m in self._meta)
            + f"|{self.groups()!r}|{self._witness.digest()}"
        )
        self.group_by = group_by
        self.budget_bytes = budget_bytes
        self.timeout = datetime.timedelta(seconds=timeout)
        self._agreement_timeout: datetime.timedelta | None = None
        self.reuse_outputs = reuse_outputs
        self.release_memory = release_memory
        self.measure_rss = measure_rss
        self.prefetch = prefetch
        self.last_stats = StreamStats()
        self._last_pass: weakref.ref[StreamPass[object]] | None = None
        self._passes: weakref.WeakSet[StreamPass[object]] = weakref.WeakSet()

    def _plan(
        self, model: nn.Module, dtype: torch.dtype | None, renames: Renames, block_bytes: int, layout: Layout
    ) -> tuple[list[Unit], dict[str, str]]:
        """The stream's gather units, in order, and its tied aliases (what a subclass streams instead)."""
        return plan_model(
            model,
            gatherer=self.gatherer,
            dtype=dtype,
            normalizer=NameNormalizer(renames),
            block_bytes=block_bytes,
            layout=layout,
            witness=self._witness,
        )

    @property
    def plan_digest(self) -> str:
        """What every rank's plan must equal (names, dtypes, shapes, groups and the adapter state read): what the
        status exchanges compare, and what a record of this stream's fingerprints is valid for."""
        return self._digest

    def plan_changes(self) -> list[str]:
        """What changed in the model since this stream was planned (empty: nothing): another active adapter,
        adapters disabled or merged in place, a new scaling, a module or parameter replaced or reshaped. Reads
        attributes only; no tensor data, no communication (about 1 us per planned module)."""
        return self._witness.changes()

    def check_plan(self) -> None:
        """Raise :class:`~lora_stream.errors.StalePlanError` if the model changed since this stream was planned
        (:meth:`plan_changes`). Every pass runs it before its first gather, and every sink in its pre-flight, so
        a reused stream never yields a stale merge; the ranks learn of it through their status exchange."""
        self._witness.check(self._where())

    # -- the WeightSource channels ----------------------------------------------------------------------------------
    def metadata(self, selection: Selection | None = None) -> list[ParamMeta]:
        """``(name, dtype, shape)`` of every tensor iteration yields (over ``selection``, when given), in the same
        order. No communication.

        vLLM's engines size receive buffers and packing from this and then trust iteration to match; the match is
        checked at every yield (a mismatch raises rather than corrupting a buffer).
        """
        if selection is None:
            return list(self._meta)
        return [ParamMeta(o.name, o.dtype, o.shape) for grp in self._select(selection) for o in grp.outputs]

    def groups(self, selection: Selection | None = None) -> list[list[str]]:
        """The names of each group, in order: the unit of gathering and of ``iter_groups()`` (over ``selection``:
        only the groups and names it produces)."""
        groups = self._groups if selection is None else self._select(selection)
        return [[o.name for o in grp.outputs] for grp in groups]

    def steps(self) -> list[list[str]]:
        """The output names of each step of the plan, in stream order: what a :class:`Selection` selects (a step's
        outputs are produced together: one checkpoint conversion)."""
        return [[o.name for o in step.outputs] for step in self._steps]

    def takes_selection(self) -> bool:
        """Whether :meth:`iter_groups` takes a :class:`Selection` (a subclass that overrides it without one always
        sends everything, and a sync of it is never partial)."""
        import inspect

        try:
            return "selection" in inspect.signature(self.iter_groups).parameters
        except (TypeError, ValueError):
            return False

    def step_bytes(self) -> list[int]:
        """The bytes of each step's outputs, in stream order."""
        return [sum(nbytes(torch.Size(o.shape), o.dtype) for o in step.outputs) for step in self._steps]

    def fingerprints(self) -> list[int | None]:
        """For each step, in stream order, a fingerprint of this rank's own bytes of every source it reads
        (:func:`lora_stream.fingerprint.fingerprint` of each local shard), or ``None`` where the step must be sent
        at every sync: a source is trainable (``requires_grad``), quantized, or the gatherer cannot say
        (``local_shard``). No communication; reads the local shards of every step with no trainable source once (a
        step with one is not read: it is sent anyway)."""
        return fingerprints(self._steps, self.gatherer)

    def read_steps(self, baseline: ElementBaseline | None = None) -> StepReads:
        """Step 1's one read of this rank's local shards, for a sync that may be partial (no communication): with a
        ``baseline`` (a sink built with ``elements=True``), the trainable steps' element diff against it
        (:func:`~lora_stream.elements.read_elements`); then :meth:`fingerprints`. The two read disjoint shards: the
        fingerprints skip every step with a trainable source, and only such a step can go as elements. Read apart,
        a shard could change between the proof and the send, and each read would walk the plan again."""
        read = read_elements(self, baseline) if baseline is not None else None
        t = time.perf_counter()
        fps = self.fingerprints()
        return StepReads(fps, read, time.perf_counter() - t)

    def _select(self, selection: Selection) -> list[Group]:
        """The groups a pass over ``selection`` gathers: each with its selected steps only, reading only what they
        read; groups with none left out."""
        keep = selection.steps
        out: list[Group] = []
        index = 0
        g = self.gatherer
        for grp in self._groups:
            units: list[Unit] = []
            reads: set[int] = set()
            for unit in grp.units:
                steps = []
                for step in unit.steps:
                    if index in keep:
                        steps.append(step)
                        for t in step.inputs:
                            reads.update(id(p) for p in _params_read(t))
                    index += 1
                if steps:
                    units.append(Unit(unit.module, [t for s in steps for t in s.inputs], [], steps))
            if units:
                params = [p for p in grp.params if id(p) in reads]
                out.append(Group(units, params, g.gather_bytes(params) if params else 0))
        return out

    def _select_inputs(self, request: InputRequest) -> tuple[list[Group], list[list[Any]], list[int]]:
        """The groups an input pass gathers, each with only the parameters it sends; what each sends; and each one's
        index among the plan's groups."""
        out: list[Group] = []
        sends: list[list[Any]] = []
        origin: list[int] = []
        index = 0
        seen: set[str] = set()
        g = self.gatherer
        for j, grp in enumerate(self._groups):
            specs: list[Any] = []
            for _ in grp.steps:
                if index in request.steps:
                    for spec in request.sends.get(index, ()):
                        if spec.key not in seen:
                            seen.add(spec.key)
                            specs.append(spec)
                index += 1
            if specs:
                refs = {id(s.ref) for s in specs if s.ref is not None}
                params = [p for p in grp.params if id(p) in refs]
                out.append(Group(grp.units, params, g.gather_bytes(params) if params else 0))
                sends.append(specs)
                origin.append(j)
        return out, sends, origin

    def held_names(self) -> None:
        """Every rank produces every tensor (vLLM's ``WeightSource.held_names``: ``None`` means all)."""
        return None

    def tied_aliases(self) -> dict[str, str]:
        """Names the stream does not yield because their weight is tied to one it does: ``{alias: name}``.

        E.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings. A sink whose engine keeps the
        two apart sends the tensor under both names.
        """
        return dict(self._aliases)

    @property
    def group_gathered_bytes(self) -> list[int]:
        """Whole bytes of the parameters each group gathers (base and adapter weights)."""
        return [grp.gathered_bytes for grp in self._groups]

    def __len__(self) -> int:
        return len(self._meta)

    def __iter__(self) -> StreamPass[tuple[str, torch.Tensor]]:
        """A fresh pass yielding ``(name, tensor)``; every rank of a sharded model must iterate it in lockstep.

        Use it as ``with iter(stream) as it:`` (or ``with stream:``) so that an exception in the loop body ends the
        pass for every rank at once; see :class:`StreamPass`.
        """
        return self._open(batched=False)  # type: ignore[return-value]

    def iter_groups(self, selection: Selection | None = None) -> StreamPass[tuple[list[str], list[torch.Tensor]]]:
        """A fresh pass yielding one ``(names, tensors)`` batch per group of ``groups(selection)`` (see
        :class:`StreamPass`); with ``selection``, only its steps' outputs (every rank passes the same one)."""
        return self._open(batched=True, selection=selection)  # type: ignore[return-value]

    def iter_inputs(self, request: InputRequest) -> StreamPass[tuple[list[str], list[torch.Tensor]]]:
        """A fresh pass yielding, per group that has any, ``(keys, tensors)``: the whole merge inputs ``request``
        names (a merge's trainable factors, and the base where the engine lacks it), not merged outputs. Only
        those are gathered; groups with nothing to send are not gathered at all. Otherwise a pass like
        :meth:`iter_groups` (lockstep, early stop, the record)."""
        return self._open(batched=True, inputs=request)  # type: ignore[return-value]

    def _open(
        self, batched: bool, selection: Selection | None = None, inputs: InputRequest | None = None
    ) -> StreamPass[object]:
        def produce(record: PassRecord) -> Generator[object, None, None]:
            return self._produce(batched, record, selection, inputs)

        p: StreamPass[object] = StreamPass(produce)
        # Weakly: a pass abandoned by its consumer must still be collected, which is what ends it for the peers.
        self._last_pass = weakref.ref(p)
        self.last_stats = p.stats
        self._passes.add(p)
        return p

    @property
    def last_pass(self) -> StreamPass[object] | None:
        """The latest pass opened on this stream while someone still holds it (``None`` otherwise), with its
        ``state`` and ``stats``. The stream holds its passes weakly."""
        return self._last_pass() if self._last_pass is not None else None

    @property
    def coordinator(self) -> Coordinator:
        """The agreement between the ranks that iterate this stream, for sinks that must decide together outside a
        pass (rank 0 found the server down, say). A no-op when the gatherer does not communicate."""
        g = self.gatherer
        return Coordinator(g.process_group, self._digest, self.agreement_timeout, active=g.collective)

    @property
    def agreement_timeout(self) -> datetime.timedelta:
        """How long a rank waits for its peers at each exchange of a pass and at each agreement of a sync: the
        stream's ``timeout``, or longer while a sink's sync needs it (:meth:`Transaction.waiting`)."""
        return self._agreement_timeout or self.timeout

    def agree(self, ok: bool, what: str) -> None:
        """``self.coordinator.agree(ok, what)`` (kept for callers of 0.1)."""
        self.coordinator.agree(ok, what)

    # -- lifetime ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every pass still open on this stream and release what it holds (peers are told, see point 7).

        ``with ParamStream(...) as stream:`` calls this when the block exits, exception or not."""
        for p in list(self._passes):
            p.close()
        release = getattr(self.gatherer, "release", None)
        if release is not None:
            release()  # buffers a gatherer keeps between passes (keep_bytes)

    def __enter__(self) -> ParamStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- production -------------------------------------------------------------------------------------------------
    def _lockstep(self) -> Lockstep | None:
        g = self.gatherer
        if not g.collective or not dist.is_available() or not dist.is_initialized():
            return None
        if dist.get_world_size(g.process_group) == 1:  # type: ignore[arg-type]
            return None
        return Lockstep(g.process_group, self._digest, self.agreement_timeout)

    def _materialize(self, t: Target, full: FullTensor, stats: StreamStats, scratch: Scratch) -> torch.Tensor:
        if t.merge is None:
            out = full(t.param)
            if out.dtype != t.dtype:
                out = scratch.empty(out.shape, t.dtype, out.device).copy_(out)
                stats.computed += 1
            elif getattr(self.gatherer, "reuses_buffers", False):
                # The gather buffer holds the next group once this one is done; a consumer that keeps the tensor
                # (vLLM's layerwise reload keeps a layer's weights until the layer is complete) must not see it
                # change. Merged tensors are fresh already.
                out = scratch.empty(out.shape, t.dtype, out.device).copy_(out)
        else:
            stats.peak_temp_bytes = max(stats.peak_temp_bytes, t.merge.peak_temp_bytes(self.gatherer.full_shape))
            out = t.merge.compute(full, t.dtype, scratch)
            stats.computed += 1
        if out.shape != t.shape or out.dtype != t.dtype:
            raise LoraStreamError(
                f"{self._where()}parameter {t.source!r} came out as {tuple(out.shape)} {out.dtype}, but metadata() "
                f"promised {tuple(t.shape)} {t.dtype}; the {self.gatherer.name} gatherer did not make it whole"
            )
        return out

    def _input_tensor(self, spec: Any, full: FullTensor, stats: StreamStats) -> torch.Tensor:
        """One merge input as it travels: whole, in its own dtype, never a view of a buffer the next group reuses."""
        out: torch.Tensor
        if spec.buffer is not None:
            out = spec.buffer.module._buffers[spec.buffer.attr]
        else:
            out = full(spec.ref)
            if getattr(self.gatherer, "reuses_buffers", False):
                out = out.clone()
        if tuple(out.shape) != spec.shape or out.dtype != spec.dtype:
            raise LoraStreamError(
                f"{self._where()}merge input {spec.source!r} came out as {tuple(out.shape)} {out.dtype}, but the plan "
                f"promised {spec.shape} {spec.dtype}; the {self.gatherer.name} gatherer did not make it whole"
            )
        stats.tensors += 1
        stats.bytes += out.numel() * out.element_size()
        return out

    def _produce_step(self, step: Step, full: FullTensor, stats: StreamStats, scratch: Scratch) -> list[torch.Tensor]:
        """The outputs of one step: its targets merged, then converted to the checkpoint's layout."""
        tensors = [self._materialize(t, full, stats, scratch) for t in step.inputs]
        if step.convert is not None:
            tensors = step.convert(tensors)
        for o, out in zip(step.outputs, tensors, strict=True):
            if tuple(out.shape) != o.shape or out.dtype != o.dtype:
                raise LoraStreamError(
                    f"{self._where()}{o.name!r} came out as {tuple(out.shape)} {out.dtype}, but metadata() promised "
                    f"{o.shape} {o.dtype}"
                )
            stats.tensors += 1
            stats.bytes += out.numel() * out.element_size()
        return tensors

    def _where(self) -> str:
        if dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}: "
        return ""

    def _produce(
        self,
        batched: bool,
        handle: PassRecord,
        selection: Selection | None = None,
        inputs: InputRequest | None = None,
    ) -> Generator[object, None, None]:
        stats = handle.stats
        handle.state = PassState.RUNNING
        lock = self._lockstep()
        sends: list[list[Any]] = []
        if inputs is not None:
            selection = Selection(inputs.steps)
            groups, sends, _ = self._select_inputs(inputs)
        else:
            groups = self._groups if selection is None else self._select(selection)
        if selection is not None:
            sizes = self.step_bytes()
            left = [i for i in range(len(self._steps)) if i not in selection.steps]
            stats.skipped_tensors = sum(len(self._steps[i].outputs) for i in left)
            stats.skipped_bytes = sum(sizes[i] for i in left)
        n = len(groups)
        status = Status.OK
        outputs = OutputPool() if self.reuse_outputs else None
        scratch = Scratch(outputs)
        rss = ProcessMemory()
        if self.measure_rss:
            rss.begin()
            stats.rss_start_bytes = rss.start
        start = time.perf_counter()
        largest = max((grp.gathered_bytes for grp in groups), default=0)
        trimmer = HeapTrimmer(int(_TRIM_BOUND_GROUPS * largest), _TRIM_EVERY_BYTES) if self.release_memory else None
        g = self.gatherer
        prefetch = getattr(g, "prefetch", None) if self.prefetch else None
        paths_before = dict(getattr(g, "path_counts", {}))
        # A gatherer that must agree with its peers before each gather (ZeRO-3's path) sends its flags along the
        # status exchange before the group instead of a collective of its own. With prefetch it agrees on the next
        # group when it starts gathering it, inside the current group: then it keeps its own collective.
        agreement = getattr(g, "agreement", None) if lock is not None and prefetch is None else None
        try:
            self.check_plan()  # before any exchange: a stale plan fails here, and the peers learn it below
            for gi, group in enumerate(groups):
                if lock is not None:
                    flags = agreement(group.params) if agreement is not None else None
                    if flags is not None and len(flags) > FLAG_CAPACITY:
                        flags = None  # every rank has as many: every rank leaves it to the gatherer's own
                    agreed = lock.exchange(Status.OK, f"before group {gi} of {n}", flags=flags)
                    if agreed is not None:
                        g.agreed(group.params, agreed)  # type: ignore[attr-defined]
                with g.gather(group.params) as full:
                    stats.groups += 1
                    stats.gathered_bytes += group.gathered_bytes
                    held = group.gathered_bytes
                    if prefetch is not None and gi + 1 < n:
                        # Every rank reaches this point for group gi, so the next group's gather (a collective)
                        # is started everywhere, even if a consumer stops while this group is consumed.
                        prefetch(groups[gi + 1].params)
                        held += groups[gi + 1].gathered_bytes
                    stats.peak_gathered_bytes = max(stats.peak_gathered_bytes, held)
                    if inputs is not None:
                        tensors = [self._input_tensor(spec, full, stats) for spec in sends[gi]]
                        yield [spec.key for spec in sends[gi]], tensors
                        del tensors
                    elif batched:
                        tensors = [x for s in group.steps for x in self._produce_step(s, full, stats, scratch)]
                        yield [o.name for o in group.outputs], tensors
                        del tensors
                    else:
                        for step in group.steps:
                            for o, tensor in zip(step.outputs, self._produce_step(step, full, stats, scratch)):
                                yield o.name, tensor
                                del tensor
                if outputs is not None:
                    outputs.end_group()
                if trimmer is not None:
                    trimmer.after_group(group.gathered_bytes)
            if lock is not None:
                lock.exchange(Status.OK, "after the last group")
            stats.complete = True
            handle.state = PassState.COMPLETE
        except GeneratorExit:
            status = Status.STOPPED
            handle.state = PassState.STOPPED
            raise
        except StreamAbortedError:
            handle.state = PassState.ABORTED
            raise
        except BaseException as exc:
            status = Status.FAILED
            handle.state = PassState.FAILED
            handle.stop_reason = describe_error(exc)
            raise
        finally:
            end_pass = getattr(g, "end_pass", None)
            if end_pass is not None:
                try:
                    end_pass()  # a prefetched gather still in flight: the peers started it too
                except Exception as exc:
                    if status == Status.OK and handle.state == PassState.COMPLETE:
                        raise
                    handle.stop_reason = handle.stop_reason or describe_error(exc)
            stats.kept_bytes = int(getattr(g, "kept_bytes", 0))
            stats.heap_trims = trimmer.trims if trimmer is not None else 0
            paths = getattr(g, "path_counts", {})
            stats.gather_paths = {k: v - paths_before.get(k, 0) for k, v in paths.items()}
            stats.fallback_reason = getattr(g, "fallback_reason", None) if stats.gather_paths.get("fallback") else None
            stats.seconds = time.perf_counter() - start
            stats.workspace_bytes = scratch.workspace.nbytes
            stats.rss_peak_bytes = rss.peak()
            scratch.workspace.clear()
            if outputs is not None:
                outputs.clear()
            if lock is not None and status != Status.OK and not lock.closed:
                try:
                    lock.exchange(status, f"after rank {lock.rank} stopped", handle.stop_reason or "")
                except StreamAbortedError:
                    pass  # the peers are gone too; the error that stopped this rank is the one to report
