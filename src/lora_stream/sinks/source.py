"""What a sink sends for one sync: the stream's tensors plus the tied aliases the engine needs, counted as they go.

Both vLLM sinks send exactly this object's groups -- the colocated sink into ``load_weights``, the server sink as the
``WeightSource`` of vLLM's trainer-side transfer engine -- so the aliases, the order, and the :class:`SyncRecord`
built from what actually went out are the same for both.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator, Mapping
from contextlib import closing, contextmanager
from typing import Any

import torch

from ..coordination import this_rank
from ..gatherers.base import nbytes
from ..lockstep import describe_error
from ..reporting import SYNC_BAR_DELAY_S, progress_bar
from ..stream import ParamStream
from ..stream_pass import ParamMeta, Selection, StreamPass
from ..transaction import fault_point
from .record import SyncRecord

__all__ = ["ElementSource", "EngineMergeSource", "SyncSource", "source_for"]


class SyncSource:
    """One sync's view of a :class:`~lora_stream.ParamStream`, shaped as vLLM's ``WeightSource``.

    Each alias (``{alias: primary}``, from :func:`~lora_stream.sinks.preflight.preflight`) travels in its primary's
    group, after the group's own tensors, as the same tensor. ``metadata()`` and ``groups()`` describe exactly what
    ``iter_groups()`` yields; ``pass_`` is the stream pass of the latest iteration, with its state.
    """

    def __init__(
        self,
        stream: ParamStream,
        aliases: Mapping[str, str] | None = None,
        version: str | None = None,
        adapter: dict[str, Any] | None = None,
        selection: Selection | None = None,
        full_because: str | None = None,
    ):
        self.stream = stream
        self.weight_version = version
        #: A partial sync: the steps the pass produces (``None``: every output), and otherwise why every output goes.
        self.selection = selection
        self.full_because = full_because
        #: For an adapter sync over a server's data plane: where the worker stages it (see ``TransferUpdateInfo``).
        self.adapter = adapter
        self._by_primary: dict[str, list[str]] = {}
        for alias, primary in (aliases or {}).items():
            self._by_primary.setdefault(primary, []).append(alias)
        meta = {m.name: m for m in stream.metadata()}
        groups = stream.groups() if selection is None else stream.groups(selection)
        self._groups = [names + self._aliases_of(names) for names in groups]
        # An alias is described as its primary (the same tensor travels under both names).
        primary_of = {a: p for p, aliases in self._by_primary.items() for a in aliases}
        self._meta = [
            ParamMeta(n, meta[primary_of.get(n, n)].dtype, meta[primary_of.get(n, n)].shape)
            for names in self._groups
            for n in names
        ]
        # "group:<k>" counts the groups of the stream's whole plan: each batch's index there, so that a partial sync
        # passes the fault points of the groups it skips as well, in order (the last ones after its last batch).
        self._plan_index = list(range(len(groups)))
        self._plan_groups = len(groups)
        # The tied aliases of skipped outputs stay in the engine with them: counted as skipped, as they are sent.
        self._skipped_aliases = self._skipped_alias_bytes = 0
        if selection is not None:
            full = stream.groups()
            owner = {n: j for j, names in enumerate(full) for n in names}
            self._plan_index = [owner[names[0]] for names in groups]
            self._plan_groups = len(full)
            sent = {n for names in groups for n in names}
            for n in (n for names in full for n in names if n not in sent):
                k = len(self._by_primary.get(n, ()))
                self._skipped_aliases += k
                self._skipped_alias_bytes += k * nbytes(torch.Size(meta[n].shape), meta[n].dtype)
        self.pass_: StreamPass[Any] | None = None
        self._stop_reason: str | None = None
        self.tensors = self.bytes = self.groups_sent = self.peak_group_bytes = 0
        #: A progress bar on rank 0 for a sync that takes more than a few seconds
        #: (:func:`~lora_stream.reporting.progress_bar`): ``None`` shows it when stderr is a terminal, ``False``
        #: never (a sink that draws its own).
        self.progress: bool | None = None
        self._bar: Any = None
        self._describe()

    def _describe(self) -> None:
        """A subclass that sends something else than the stream's outputs describes it here (last in ``__init__``)."""

    @property
    def aliases(self) -> list[str]:
        """The alias names this source sends besides the stream's own (the engine may or may not hold them)."""
        return [a for aliases in self._by_primary.values() for a in aliases]

    def _aliases_of(self, names: list[str]) -> list[str]:
        return [a for n in names for a in self._by_primary.get(n, ())]

    # -- vLLM's WeightSource ---------------------------------------------------------------------------------------
    def metadata(self) -> list[ParamMeta]:
        return list(self._meta)

    def groups(self) -> list[list[str]]:
        return [list(g) for g in self._groups]

    def held_names(self) -> None:
        return None

    def iter_groups(self) -> Generator[tuple[list[str], list[torch.Tensor]], None, None]:
        """One pass over the stream, aliases included. Closing this generator (or an exception thrown into it) ends
        the stream pass, which tells the other trainer ranks at once."""
        self.tensors = self.bytes = self.groups_sent = self.peak_group_bytes = 0
        batches = self._open_pass()
        self.pass_ = batches if isinstance(batches, StreamPass) else None
        reason: str | None = None
        self._stop_reason = None
        with closing(batches):
            try:
                self._bar = self._open_bar()
                yield from self._expanded(batches)
            except GeneratorExit:
                raise
            except BaseException as exc:  # the stream (or a wrapper around it) raised: tell the peers what
                reason = describe_error(exc)
                raise
            finally:
                if self.pass_ is None:  # a subclass wrapped the stream's own pass in a generator of its own
                    self.pass_ = self.stream.last_pass
                if self.pass_ is not None:
                    reason = reason or self._stop_reason
                    if reason is not None and self.pass_.record.stop_reason is None:
                        self.pass_.record.stop_reason = reason
                    # End it now (a no-op once complete): a wrapper that raised may leave it alive in a traceback,
                    # and the other ranks learn of the stop only when it ends.
                    self.pass_.close()
                bar, self._bar = self._bar, None
                if bar is not None:
                    bar.close()

    def _open_bar(self) -> Any:
        """This sync's progress bar (rank 0, a terminal, after :data:`~lora_stream.reporting.SYNC_BAR_DELAY_S`), or
        ``None``."""
        if self.progress is False:
            return None
        total = sum(nbytes(torch.Size(m.shape), m.dtype) for m in self.metadata())
        desc = f"lora_stream sync {self.weight_version}" if self.weight_version else "lora_stream sync"
        return progress_bar(total, desc, show=self.progress, rank=this_rank(), delay=SYNC_BAR_DELAY_S, leave=False)

    def _sent(self, group_bytes: int) -> None:
        """Count one group handed over (the bar's progress)."""
        if self._bar is not None:
            self._bar.update(group_bytes)

    def _open_pass(self) -> Any:
        """The stream pass this sync sends (a subclass's stream may wrap it in a generator of its own)."""
        return self.stream.iter_groups() if self.selection is None else self.stream.iter_groups(self.selection)

    def _expanded(self, batches: Any) -> Generator[tuple[list[str], list[torch.Tensor]], None, None]:
        passed = 0  # the fault points "group:<j>" passed so far, j < passed
        for k, (names, tensors) in enumerate(batches):
            if self.pass_ is None:
                # A subclass wrapped the stream's pass in a generator of its own: hold the pass now, while it runs.
                # The stream keeps only a weak reference, so once the wrapper raised, the pass could be collected
                # before the end of this sync, leaving it unknown that every rank already learned how it ended (the
                # sink would then ask the peers to agree once more, alone, until the timeout).
                self.pass_ = self.stream.last_pass
            at = self._plan_index[k] if k < len(self._plan_index) else k
            for j in range(passed, at + 1):
                fault_point(f"group:{j}")
            passed = max(passed, at + 1)
            out_names, out_tensors = list(names), list(tensors)
            for n, t in zip(names, tensors):
                for alias in self._by_primary.get(n, ()):
                    out_names.append(alias)
                    out_tensors.append(t)
            group_bytes = sum(t.numel() * t.element_size() for t in out_tensors)
            self.tensors += len(out_tensors)
            self.bytes += group_bytes
            self.groups_sent += 1
            self.peak_group_bytes = max(self.peak_group_bytes, group_bytes)
            self._sent(group_bytes)
            yield out_names, out_tensors
        for j in range(passed, self._plan_groups):
            fault_point(f"group:{j}")

    @contextmanager
    def batches(self) -> Iterator[Generator[tuple[list[str], list[torch.Tensor]], None, None]]:
        """``iter_groups()`` as a ``with`` block: an exception leaving the block ends the pass at once, and its text
        travels to the other ranks as this rank's reason for stopping."""
        gen = self.iter_groups()
        try:
            yield gen
        except BaseException as exc:
            # Picked up when the pass is ended below (the stream's own pass may only be found then).
            self._stop_reason = describe_error(exc)
            raise
        finally:
            gen.close()

    @property
    def ended_early(self) -> bool:
        """The latest pass started and ended without completing, so the other ranks already know how it ended (a
        sink must not ask them to agree once more: no rank would join that exchange)."""
        return self.pass_ is not None and self.pass_.state.ended_early

    def __iter__(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        for names, tensors in self.iter_groups():
            yield from zip(names, tensors)

    # -- the record --------------------------------------------------------------------------------------------------
    def record(self, sink: str, seconds: float) -> SyncRecord:
        """The :class:`SyncRecord` of the latest pass: what went out, as counted on its way."""
        stats = self.pass_.stats if self.pass_ is not None else None
        return SyncRecord(
            sink=sink,
            tensors=self.tensors,
            bytes=self.bytes,
            groups=self.groups_sent,
            seconds=seconds,
            peak_group_bytes=self.peak_group_bytes,
            peak_gathered_bytes=stats.peak_gathered_bytes if stats is not None else 0,
            version=self.weight_version,
            skipped_tensors=(stats.skipped_tensors + self._skipped_aliases) if stats is not None else 0,
            skipped_bytes=(stats.skipped_bytes + self._skipped_alias_bytes) if stats is not None else 0,
            gathered_bytes=stats.gathered_bytes if stats is not None else 0,
            full_because=self.full_because if self.selection is None else None,
        )


class ElementSource(SyncSource):
    """A sync of a sink built with ``elements=True`` (:mod:`lora_stream.elements`): the element steps it sends
    travel as the elements that changed on every rank (``sends``: each step's segments, every rank's, from the
    exchange), one ``uint8`` blob per output, before the stream's pass over the other steps it sends
    (``selection``). :attr:`element_info` tells the engines how to rebuild each blob, and which outputs to keep a
    copy of for the next element sync (``shadow``). With no ``sends`` it is a sync like any other (the first one, or
    one whose elements were refused: ``refused`` says why), except that the engines keep their copy."""

    def __init__(
        self,
        stream: ParamStream,
        aliases: Mapping[str, str] | None,
        version: str | None,
        selection: Selection | None,
        sends: Mapping[int, Any],
        *,
        shadow: list[str],
        refused: str | None,
        full_because: str | None = None,
    ):
        self.sends = dict(sends)
        self.shadow = list(shadow)
        self.elements_refused = refused
        super().__init__(stream, aliases, version, None, selection=selection, full_because=full_because)

    def _describe(self) -> None:
        steps = self.stream.steps()
        meta = {m.name: m for m in self.stream.metadata()}
        owner = {n: j for j, names in enumerate(self.stream.groups()) for n in names}
        by_group: dict[int, list[str]] = {}
        self._payloads: dict[str, Any] = {}
        self._blobs: dict[str, torch.Tensor] = {}
        self.element_figures = {"tensors": 0, "changed": 0, "elements": 0, "bytes": 0, "whole_bytes": 0}
        self.encodings: dict[str, int] = {}
        for i, segments in sorted(self.sends.items()):
            name = steps[i][0]
            m = meta[name]
            by_group.setdefault(owner[name], []).append(name)
            blob = torch.cat([s.encoded.blob.reshape(-1) for s in segments]) if segments else torch.empty(0)
            self._blobs[name] = blob.to(torch.uint8)
            self._payloads[name] = {
                "shape": list(m.shape),
                "dtype": str(m.dtype)[6:],
                "segments": [s.describe() for s in segments],
            }
            f = self.element_figures
            f["tensors"] += 1
            f["changed"] += sum(s.encoded.count if s.encoded.encoding != "dense" else 0 for s in segments)
            f["changed"] += sum(s.hi - s.lo for s in segments if s.encoded.encoding == "dense")
            f["elements"] += sum(s.hi - s.lo for s in segments)
            f["bytes"] += int(blob.numel())
            f["whole_bytes"] += nbytes(torch.Size(m.shape), m.dtype)
            for s in segments:
                self.encodings[s.encoded.encoding] = self.encodings.get(s.encoded.encoding, 0) + 1
        self._element_groups = [by_group[j] + self._aliases_of(by_group[j]) for j in sorted(by_group)]
        primary_of = {a: p for p, aliases in self._by_primary.items() for a in aliases}
        element_meta = [
            ParamMeta(n, torch.uint8, (int(self._blobs[primary_of.get(n, n)].numel()),))
            for names in self._element_groups
            for n in names
        ]
        self._groups = [list(g) for g in self._element_groups] + self._groups
        self._meta = element_meta + self._meta
        self._primary_of = primary_of
        # The element outputs and their aliases, which the stream's pass leaves out and counts as skipped.
        sent = [meta[primary_of.get(n, n)] for names in self._element_groups for n in names]
        self._element_outputs = (len(sent), sum(nbytes(torch.Size(m.shape), m.dtype) for m in sent))

    @property
    def element_info(self) -> dict[str, Any]:
        """What the engines need (:class:`~lora_stream.engine.elements.ElementShadow`): the outputs to keep a copy
        of, the element payloads' shapes, dtypes and segments, and the tied aliases that travel with them."""
        aliases = {a: p for a, p in self._primary_of.items() if p in self._payloads}
        return {"shadow": list(self.shadow), "payloads": dict(self._payloads), "aliases": aliases}

    def _expanded(self, batches: Any) -> Generator[tuple[list[str], list[torch.Tensor]], None, None]:
        for names in self._element_groups:
            tensors = [self._blobs[self._primary_of.get(n, n)] for n in names]
            group_bytes = sum(t.numel() for t in tensors)
            self.tensors += len(tensors)
            self.bytes += group_bytes
            self.groups_sent += 1
            self.peak_group_bytes = max(self.peak_group_bytes, group_bytes)
            self._sent(group_bytes)
            yield list(names), tensors
        yield from super()._expanded(batches)

    def record(self, sink: str, seconds: float) -> SyncRecord:
        import dataclasses

        record = super().record(sink, seconds)
        figures: dict[str, Any] = {**self.element_figures, "encodings": dict(self.encodings)}
        figures["refused"] = self.elements_refused if not self.sends else None
        if self.sends:
            count, whole = self._element_outputs
            record = dataclasses.replace(
                record,
                skipped_tensors=max(0, record.skipped_tensors - count),
                skipped_bytes=max(0, record.skipped_bytes - whole),
            )
        return dataclasses.replace(record, elements=figures)


class EngineMergeSource(SyncSource):
    """A sync whose merges run in the engine (:mod:`lora_stream.engine_merge`): what travels is each selected
    step's trainable inputs -- and, in a full sync, the frozen base with them -- under their plan keys, and
    :attr:`merge_info` carries the recipes. ``metadata()``, ``groups()`` and ``iter_groups()`` describe those
    inputs; the record counts them, and the outputs the engine computes from them as the stream's.

    In a full sync each frozen tensor is fingerprinted as it passes (:attr:`base_fp`, whole tensors, on every
    rank): the engine fingerprints what it received, and every later partial sync names these fingerprints again
    (``base_fp``), so that the engine refuses to merge onto any other base.
    """

    def __init__(
        self,
        stream: ParamStream,
        plan: Any,
        aliases: Mapping[str, str] | None = None,
        version: str | None = None,
        selection: Selection | None = None,
        full_because: str | None = None,
        base_fp: Mapping[str, int] | None = None,
    ):
        from ..stream_pass import InputRequest

        self.plan = plan
        n = len(plan.recipes)
        steps = sorted(selection.steps) if selection is not None else list(range(n))
        full = selection is None
        sends = {i: [plan.inputs[k] for k in (plan.reads[i] if full else plan.trainable(i))] for i in steps}
        self.request = InputRequest(frozenset(steps), sends)
        self._frozen = {k for k, spec in plan.inputs.items() if not spec.trainable}
        super().__init__(stream, aliases, version, None, selection=selection, full_because=full_because)
        # The trainer's intra-op thread count: some CPU kernels' reduction order depends on it, and the engine
        # computes each merge with the same count, so that its result is the trainer's bit for bit.
        threads = torch.get_num_threads()
        recipes = [{**plan.recipes[i], "threads": threads} for i in steps]
        read = {k for i in steps for k in plan.reads[i] if k in self._frozen}
        self.merge_info: dict[str, Any] = {
            "recipes": recipes,
            "frozen": sorted(read),
            "base_fp": {} if full else {k: int((base_fp or {})[k]) for k in sorted(read)},
        }
        #: Fingerprints of the base tensors this (full) sync sent, whole; filled as they pass.
        self.base_fp: dict[str, int] = {}

    def _describe(self) -> None:
        """What travels: the selected steps' inputs, in the stream's input groups."""
        _, specs, origin = self.stream._select_inputs(self.request)
        self._input_groups = [[s.key for s in group] for group in specs]
        self._input_meta = [ParamMeta(s.key, s.dtype, s.shape) for group in specs for s in group]
        # The fault points "group:<k>" of the whole plan, as for merged syncs: each input batch's group there.
        self._plan_index = origin
        self._plan_groups = len(self.stream._groups)

    @property
    def aliases(self) -> list[str]:
        return [a for r in self.merge_info["recipes"] for names in r.get("aliases", {}).values() for a in names]

    def metadata(self) -> list[ParamMeta]:
        return list(self._input_meta)

    def groups(self) -> list[list[str]]:
        return [list(g) for g in self._input_groups]

    def _open_pass(self) -> Any:
        self.base_fp = {}
        return self.stream.iter_inputs(self.request)

    def _expanded(self, batches: Any) -> Generator[tuple[list[str], list[torch.Tensor]], None, None]:
        from ..fingerprint import fingerprint

        passed = 0
        for k, (names, tensors) in enumerate(batches):
            if self.pass_ is None:  # see SyncSource._expanded: hold the stream's pass while it runs
                self.pass_ = self.stream.last_pass
            at = self._plan_index[k] if k < len(self._plan_index) else k
            for j in range(passed, at + 1):
                fault_point(f"group:{j}")
            passed = max(passed, at + 1)
            for n, t in zip(names, tensors):
                if n in self._frozen:
                    self.base_fp[n] = fingerprint(t)
            group_bytes = sum(t.numel() * t.element_size() for t in tensors)
            self.tensors += len(tensors)
            self.bytes += group_bytes
            self.groups_sent += 1
            self.peak_group_bytes = max(self.peak_group_bytes, group_bytes)
            self._sent(group_bytes)
            yield list(names), list(tensors)
        for j in range(passed, self._plan_groups):
            fault_point(f"group:{j}")


def source_for(
    stream: ParamStream,
    aliases: Mapping[str, str],
    version: str | None,
    *,
    adapter: dict[str, Any] | None = None,
    selection: Selection | None = None,
    full_because: str | None = None,
    merge_plan: Any = None,
    base_fp: Mapping[str, int] | None = None,
) -> SyncSource:
    """What one sync sends: the merged outputs (or an adapter's factors), or, with ``merge_plan``, the engine-side
    merge's inputs (:class:`EngineMergeSource`, naming the base the engines hold by ``base_fp``)."""
    if merge_plan is not None:
        return EngineMergeSource(stream, merge_plan, aliases, version, selection, full_because, base_fp=base_fp)
    return SyncSource(stream, aliases, version, adapter, selection=selection, full_because=full_because)
