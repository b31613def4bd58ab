"""Runs inside vLLM's worker processes: the reload bracket, driven over ``collective_rpc``.

Start an engine that lives in a child process with ``LLM(..., worker_extension_cls=WORKER_EXTENSION)``
(:data:`lora_stream.sinks.WORKER_EXTENSION`, this class's dotted path); vLLM mixes this class into its worker, and
:class:`~lora_stream.sinks.VLLMColocatedSink` calls its methods by name. Weights arrive as safetensors bytes
(msgpack carries bytes intact, and nothing needs ``VLLM_ALLOW_INSECURE_SERIALIZATION``). The bracket and its reload
check are :class:`~lora_stream.engine.reload.ReloadBracket`'s, as in every other sink.
"""

from __future__ import annotations

from typing import Any

from .adapter_staging import StagedAdapter, stage, unstage
from .reload import ReloadBracket

__all__ = ["LoraStreamWorkerExtension"]


class LoraStreamWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); ``self.model_runner`` is the worker's."""

    model_runner: Any
    _lora_stream_bracket: ReloadBracket | None = None
    _lora_stream_previous: dict[str, StagedAdapter | None] | None = None
    #: The undecided update's engine-side merges (``lora_stream_begin_merge``), committed with it.
    _lora_stream_merge: Any = None
    _lora_stream_optional: tuple[str, ...] = ()

    def lora_stream_begin(
        self,
        keep_previous: bool = False,
        expect: list[str] | None = None,
        base: str | None = None,
        optional: list[str] | None = None,
        elements: dict[str, Any] | None = None,
        record: bool = True,
    ) -> None:
        """Open the bracket (:meth:`ReloadBracket.begin`; ``expect`` and ``base``: a partial update; ``elements``:
        an element sync's info, :class:`~lora_stream.engine.elements.ElementShadow`; ``record=False``: the commit
        will name no sync, so no digest of the model's state is measured for it)."""
        from .elements import ElementShadow
        from .merger import EngineMerger

        self.lora_stream_rollback()  # an update a vanished trainer left undecided: the safe outcome is the old one
        EngineMerger.of(self.model_runner.model).forget()  # weights this worker does not merge
        # Refused here, before the bracket opens, when this worker's copy is not of the sync the elements follow.
        shadow = ElementShadow.of(self.model_runner.model)
        shadow.begin(elements, base)
        expect = shadow.reloaded(expect)  # not what it writes in place
        restore = shadow.restorer(expect, optional or ()) if keep_previous else None
        bracket = ReloadBracket(self.model_runner.model, self.model_runner.model_config)
        bracket.begin(
            keep_previous=keep_previous,
            expect=expect,
            base=base,
            optional=optional or (),
            restore=restore,
            record=record,
            written=shadow.written_modules,
            moves=shadow.moves,
        )
        self._lora_stream_bracket = bracket

    def lora_stream_begin_merge(
        self,
        keep_previous: bool,
        partial: bool,
        base: str | None,
        optional: list[str] | None,
        merge: dict[str, Any],
    ) -> None:
        """Open the bracket for an engine-side merge (:mod:`lora_stream.engine.merger`): the loads that follow carry
        merge inputs, and ``merge`` the recipes. A partial update onto another base is refused here, before the
        bracket opens; one onto this worker's committed merges rolls back by recomputing, with no copy."""
        from .elements import ElementShadow
        from .merger import open_merge

        self.lora_stream_rollback()
        ElementShadow.of(self.model_runner.model).begin(None, base)
        bracket = ReloadBracket(self.model_runner.model, self.model_runner.model_config)
        self._lora_stream_merge = open_merge(
            bracket, merge, keep_previous=keep_previous, partial=partial, base=base, optional=optional or ()
        )
        self._lora_stream_bracket = bracket
        self._lora_stream_optional = tuple(optional or ())

    def lora_stream_held(self) -> str | None:
        """The token of the committed sync whose weights this worker's model serves (``None``: unknown)."""
        from .holding import held_by

        return held_by(self.model_runner.model)

    def lora_stream_held_state(self) -> tuple[str | None, str | None]:
        """The committed sync this worker's model provably serves, and why not (:func:`holding.held_state`: the
        token, and every module's state checked against what that commit left)."""
        from .holding import held_state

        return tuple(held_state(self.model_runner.model))  # type: ignore[return-value]

    def lora_stream_release(self) -> None:
        """The weights are about to be discarded (a level-2 sleep): this worker's model holds no committed sync."""
        from .holding import hold

        hold(self.model_runner.model, None)

    def lora_stream_load(self, blob: bytes, optional: list[str] | None = None) -> list[str]:
        from safetensors.torch import load

        if self._lora_stream_bracket is None:
            raise RuntimeError("lora_stream_load outside a reload bracket: call lora_stream_begin first")
        pairs = list(load(bytes(blob)).items())
        if self._lora_stream_merge is not None:
            pairs = self._lora_stream_merge.feed(pairs)
        else:
            from .elements import ElementShadow

            pairs = list(ElementShadow.of(self.model_runner.model).feed(pairs))
        return self._lora_stream_bracket.load(pairs, optional or ())

    def lora_stream_finish(self) -> tuple[list[str], dict[str, list[str]], bool, list[list[str]] | None]:
        """Close and check the bracket; the update stays undecided (kept for ``commit`` or ``rollback``).

        For an engine-side merge, the base a full update brings is also kept here, before the trainer ranks vote
        (:meth:`~lora_stream.engine.merger.EngineMerger.prepare`: written, verified, mapped): a failure raises
        :class:`~lora_stream.VLLMLoadError` naming the path, the sync fails on every rank and rolls back, and
        ``lora_stream_commit`` is left with nothing that can fail."""
        bracket = self._lora_stream_bracket
        if bracket is None:
            return ([], {}, True, None)
        update = self._lora_stream_merge
        if update is not None and bracket.open:
            rest = update.rest()
            if rest:
                bracket.load(rest, self._lora_stream_optional)
        report = bracket.finish().to_wire()
        from .elements import ElementShadow

        ElementShadow.of(self.model_runner.model).check()  # every payload it was to write in place came
        if update is not None:
            from .merger import EngineMerger

            EngineMerger.of(self.model_runner.model).prepare(update)
        return report

    def lora_stream_abort(self) -> None:
        """Close the bracket unchecked after a failure; the update stays undecided."""
        if self._lora_stream_bracket is not None:
            self._lora_stream_bracket.abort()

    def lora_stream_commit(self, token: str | None = None) -> int:
        """The update stands (the model now holds sync ``token``'s weights); returns the bytes kept to undo it."""
        bracket, self._lora_stream_bracket = self._lora_stream_bracket, None
        update, self._lora_stream_merge = self._lora_stream_merge, None
        if bracket is None:
            return 0
        from .elements import ElementShadow

        shadow = ElementShadow.of(self.model_runner.model)
        kept = bracket.kept_bytes + (update.kept_bytes if update is not None else 0) + shadow.kept_bytes
        try:
            bracket.abort()  # a no-op after finish; never leave a bracket open
            bracket.commit(token)
        finally:
            shadow.commit(token)  # references and a label: nothing that can fail
            if update is not None:
                from .merger import EngineMerger

                # After the vote, the weights loaded: the update stands. This only swaps references (the base was
                # kept in lora_stream_finish, before the vote).
                EngineMerger.of(self.model_runner.model).commit(update)
        return kept

    def lora_stream_rollback(self) -> bool:
        """Undo the update (bit for bit, when ``begin`` kept the previous weights); returns whether it was undone:
        ``True`` when nothing was open, ``False`` when an update was loaded and nothing could be restored (it kept
        no copy: ``rollback=False``), which the sink reports. A base file the update prepared is dropped."""
        from .elements import ElementShadow
        from .merger import EngineMerger, rolled_back

        bracket, self._lora_stream_bracket = self._lora_stream_bracket, None
        update, self._lora_stream_merge = self._lora_stream_merge, None
        EngineMerger.of(self.model_runner.model).drop(update)
        try:
            ElementShadow.of(self.model_runner.model).rollback()
        finally:
            restored = True if bracket is None else rolled_back(bracket)
        return restored

    # -- adapter sync (VLLMLoRASink): stage in this process, then the sink calls vLLM's own add_lora -------------------
    def lora_stream_stage_adapter(
        self, blob: bytes, path: str, config: dict[str, Any], version: str | None = None
    ) -> None:
        from safetensors.torch import load

        if self._lora_stream_previous is None:
            self._lora_stream_previous = {}
        self._lora_stream_previous[path] = stage(path, StagedAdapter(load(bytes(blob)), dict(config), version))

    def lora_stream_unstage_adapter(self, path: str) -> None:
        """Put back the version the latest ``lora_stream_stage_adapter`` replaced."""
        previous = (self._lora_stream_previous or {}).pop(path, None)
        unstage(path, previous)
