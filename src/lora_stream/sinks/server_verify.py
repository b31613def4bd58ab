"""Verification on a vLLM server (``VLLMServerSink(verify=...)``): each server's workers probe what they loaded
against the trainer's forward, its data-parallel workers must hold the same bytes, and a fleet's servers must hold
the same bytes as each other. Called in step 3 of a sync (:mod:`lora_stream.sinks.vote`) by the server route.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from ..transaction import Transaction
from .server_replica import Replica
from .verify import ProbeHistory, Verification, VerificationError, compare, tolerance

__all__ = ["agree_on_weights", "verify_replica"]


def verify_replica(
    replica: Replica,
    ids: list[int],
    trainer: Any,
    scale: float,
    trainer_dtype: Any,
    *,
    rank: int,
    limit: float | None,
    history: ProbeHistory,
    index: int,
) -> tuple[Verification, str]:
    """Ask ``replica``'s workers to probe the weights they loaded (``{"command": "verify"}``) and check every
    worker's report; returns the server's verification and its weight digest."""
    import torch

    t = time.perf_counter()
    replica.client.update_weights({"command": "verify", "probe_ids": ids})
    call_s = time.perf_counter() - t
    engine = replica.engine
    reports = engine.verification_reports()
    where = f" (the vLLM server at {replica.url})"
    workers = engine.init_info.world_size - 1
    silent = [k for k in range(1, workers + 1) if k not in reports]
    if silent:
        raise VerificationError(
            f"rank {rank}: verification failed{where}: worker(s) {silent} of {workers} reported nothing, so "
            "what they serve is unknown; the sync is rolled back",
            max_abs_diff=math.inf,
            tolerance=0.0,
        )
    failed = {k: rep["error"] for k, rep in reports.items() if "error" in rep}
    if failed:
        raise VerificationError(
            f"rank {rank}: verification failed{where}: the probe could not run on worker(s) "
            f"{sorted(failed)} ({next(iter(failed.values()))}); the sync is rolled back",
            max_abs_diff=math.inf,
            tolerance=0.0,
        )
    first = next(iter(reports.values()))
    engine_dtype = getattr(torch, str(first["dtype"]), torch.bfloat16)
    if limit is None:
        limit = tolerance(engine_dtype, trainer_dtype, int(first["layers"]), scale)
    verification: Verification | None = None
    probed = {k: rep for k, rep in reports.items() if rep.get("after") is not None}
    if not probed:
        raise VerificationError(
            f"rank {rank}: verification failed{where}: no worker returned the probe's logits",
            max_abs_diff=math.inf,
            tolerance=limit,
        )
    for k, rep in probed.items():
        checked = compare(torch.tensor(rep["after"]), trainer, limit, call_s, rank, f"{where}, worker {k}")
        if verification is None or checked.max_abs_diff > verification.max_abs_diff:
            verification = checked
    # Workers that hold the same shard (the server's data-parallel replicas) must hold the same bytes.
    layouts: dict[str, set[str]] = {}
    for rep in reports.values():
        # What the worker serves as vLLM sees it, and what it received (what kernels repacked out of their
        # parameters is only seen there).
        layouts.setdefault(str(rep["layout"]), set()).add(f"{rep['digest']}/{rep.get('received')}")
    split = sorted(layout for layout, ds in layouts.items() if len(ds) > 1)
    if split:
        raise VerificationError(
            f"rank {rank}: verification failed{where}: its data-parallel workers holding shard(s) {split} do "
            "not hold the same weights (vLLM's weight digests differ); the sync is rolled back",
            max_abs_diff=math.inf,
            tolerance=limit,
        )
    for k, rep in probed.items():
        key = f"{replica.url}#{k}"
        history.check(
            index,
            key,
            rep.get("before"),
            rep["after"],
            trainer,
            scale,
            engine_dtype,
            limit,
            rank,
            f"{where}, worker {k}",
        )
        history.propose(index, trainer, key, rep["after"])
    assert verification is not None
    worker_s = {key: max(float(rep["seconds"].get(key, 0.0)) for rep in reports.values()) for key in first["seconds"]}
    verification = dataclasses.replace(verification, stages={**worker_s, "verify_call_s": call_s})
    from ..transfer.protocol import replica_digest

    digest = replica_digest({layout: ",".join(sorted(ds)) for layout, ds in layouts.items()})
    return verification, digest


def agree_on_weights(tx: Transaction, servers: int, rank: int, digests: list[str]) -> None:
    """A fleet: every rank learns whether its servers, and the servers fed by the other ranks, hold the same
    weights. One exchange of 128 bits on every rank alike (64 bits of each server's digest, each as "is 1" and
    "is 0"; none from a server that failed, or from a rank that feeds none): the servers agree iff no bit is
    both."""
    if servers < 2:
        return
    bits = [False] * 128
    for digest in digests:
        value = int(digest[:16], 16)
        for i in range(64):
            one = bool(value >> i & 1)
            bits[i] |= one
            bits[64 + i] |= not one
    agreed = tx.any_of(bits, "comparing the servers' weights")
    if agreed is not None and any(agreed[i] and agreed[64 + i] for i in range(64)):
        tx._record(
            VerificationError(
                f"rank {rank}: the vLLM servers of the fleet do not hold the same weights after this sync "
                "(their weight digests differ, whichever trainer ranks feed them; servers of different "
                "parallel layouts cannot be compared); the sync is rolled back on every server",
                max_abs_diff=math.inf,
                tolerance=0.0,
            )
        )
