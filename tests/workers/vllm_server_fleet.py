"""Rank worker: a 2-rank ZeRO-3 trainer keeps a fleet of two vLLM servers in sync with one VLLMServerSink.

Usage: vllm_server_fleet.py URL_A URL_B CHECKPOINT MARKER_DIR
One run, in order (the test drives the servers through marker files in MARKER_DIR):
  1. an adapter sync into both (server A fed by rank 0, B by rank 1): both serve it under the adapter's name.
  2. merged sync v1 into both: both serve the merged reference; each rank sent the model once (``sent_bytes``:
     its bytes, chunk padding aside), as a one-server sink's rank 0 does.
  3. a step; rank 1 writes ``kill1`` in the middle of the transfer and waits for ``killed1`` (the test kills B):
     every rank raises, A serves exactly v1's outputs and reports v1. Then ``restart1`` / ``restarted1``.
  4. ``on_replica_failure="exclude"``: B is killed in the middle of v2's transfer (``kill2``) : A commits and
     serves v2, the record and a warning name B.
  5. ``restart2`` / ``restarted2`` (B is back, serving its checkpoint): v3 readmits B, and both serve v3.
  6. a step: v4 sends only what changed to both servers (B's record is its own since v3), and both serve v4.
  7-9. decided once for every server (``decided_once``): a rank stopped inside the vote, one stopped after the
     decision's record, and (merge="trainer") B restarted between its load and the vote (``kill3``, ``restart3``).
Every outcome is printed as one RESULT {json} line. With LORA_STREAM_TEST_MERGE=engine the merged syncs run as
``merge="engine"``: the servers merge, the base travels with every full sync (the readmission's included).
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings

import deepspeed
import torch
import torch.distributed as dist
from helpers import ZERO3_CONFIG, assert_vllm_serves, finish, lora, report, server_generate, zero3_whole_into

from lora_stream import AdapterStream, LoraStreamError, ParamStream, StreamAbortedError, VLLMServerSink
from lora_stream.errors import ReplicaExcludedWarning

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = ZERO3_CONFIG
IDS = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])


class HoldOnRank1(ParamStream):
    """Rank 1 signals ``kill<n>`` when the third group is produced, and waits until the test killed server B."""

    marker_dir = ""
    kill = 0

    def iter_groups(self):  # type: ignore[no-untyped-def,override]
        for i, batch in enumerate(super().iter_groups()):
            if i == 2 and dist.get_rank() == 1:
                signal(f"kill{self.kill}")
                wait_for(f"killed{self.kill}")
            yield batch

    def iter_inputs(self, request):  # type: ignore[no-untyped-def,override]
        """The same under merge="engine" (a partial sync has one input batch per decoder layer: the second)."""
        for i, batch in enumerate(super().iter_inputs(request)):
            if i == 1 and dist.get_rank() == 1:
                signal(f"kill{self.kill}")
                wait_for(f"killed{self.kill}")
            yield batch


def restarted(n: int) -> None:
    """Rank 0 asks the test to restart server B; every rank waits until it serves again."""
    dist.barrier()
    if dist.get_rank() == 0:
        signal(f"restart{n}")
    wait_for(f"restarted{n}")


def signal(name: str) -> None:
    with open(os.path.join(HoldOnRank1.marker_dir, name), "w") as f:
        f.write(name)


def wait_for(name: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(HoldOnRank1.marker_dir, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never wrote {name!r}")
        time.sleep(0.1)


def main() -> None:
    from transformers import AutoModelForCausalLM

    url_a, url_b, ckpt, HoldOnRank1.marker_dir = sys.argv[1:5]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    pm = lora(AutoModelForCausalLM.from_pretrained(ckpt), target_modules="all-linear", lora_alpha=16)
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS)

    def reference() -> torch.nn.Module:
        return copy.deepcopy(zero3_whole_into(engine, template)).float().merge_and_unload()  # every rank

    def step() -> None:
        engine.backward(engine(input_ids=IDS, labels=IDS).loss)
        engine.step()

    # 1. the adapter, into both (first: the servers' base is still the trainer's base).
    merge = os.environ.get("LORA_STREAM_TEST_MERGE", "trainer")
    sink = VLLMServerSink([url_a, url_b], rank=rank, timeout=60, lora_name="policy", merge=merge)
    if merge == "trainer":  # under "engine" the servers hold the previous run's weights, not the base
        record = sink.sync(AdapterStream(engine), version="a1")
        merged = reference()
        for url in (url_a, url_b):
            assert_vllm_serves(server_generate(url, model="policy"), merged)
        report(rank=rank, event="adapter", replicas=list(record.replicas), sent_bytes=record.stages["sent_bytes"])

    # 2. merged, both servers; the bytes each rank sent, against the model's (what a one-server sink sends).
    record = sink.sync(ParamStream(engine, group_by="layer"), version="v1")
    expected = reference()
    outputs = {}
    for url in (url_a, url_b):
        outputs[url] = server_generate(url)
        assert_vllm_serves(outputs[url], expected)
    assert record.replicas == (url_a, url_b) and not record.excluded, record
    report(
        rank=rank,
        event="merged",
        sent_bytes=record.stages["sent_bytes"],
        model_bytes=record.bytes,
        seconds=record.seconds,
    )

    # 3. B dies mid-transfer: with the default policy every rank raises and A serves v1 exactly.
    step()
    t = time.monotonic()
    HoldOnRank1.kill = 1
    try:
        sink.sync(HoldOnRank1(engine, group_by="layer"), version="v2")
        raise AssertionError("the sync should have raised: server B stopped mid-transfer")
    except (LoraStreamError, StreamAbortedError) as exc:
        error = exc
    report(
        rank=rank,
        event="abort",
        error=type(error).__name__,
        message=str(error)[:400],
        equal=server_generate(url_a) == outputs[url_a],
        version=sink.client.weight_version(),
        seconds=time.monotonic() - t,
    )

    restarted(1)

    # 4. the same failure tolerated: B is excluded, A commits.
    fleet = VLLMServerSink(
        [url_a, url_b], rank=rank, timeout=30, lora_name="policy", on_replica_failure="exclude", merge=merge
    )
    HoldOnRank1.kill = 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = fleet.sync(HoldOnRank1(engine, group_by="layer"), version="v2")
    expected = reference()
    assert_vllm_serves(server_generate(url_a), expected)
    named = [str(w.message) for w in caught if issubclass(w.category, ReplicaExcludedWarning)]
    report(
        rank=rank,
        event="excluded",
        replicas=list(record.replicas),
        excluded=record.excluded,
        warned=bool(named) and url_b in named[0],
        version=fleet.client.weight_version(),
    )

    # 5. B restarted (serving its checkpoint): the next sync readmits it with the full weights.
    restarted(2)
    step()
    record = fleet.sync(ParamStream(engine, group_by="layer"), version="v3")
    expected = reference()
    for url in (url_a, url_b):
        assert_vllm_serves(server_generate(url), expected)
    report(
        rank=rank,
        event="readmitted",
        replicas=list(record.replicas),
        readmitted=list(record.readmitted),
        full_because=record.full_because,
    )

    # 6. after the readmission, both servers hold v3: the next sync sends only what changed, to both.
    step()
    record = fleet.sync(ParamStream(engine, group_by="layer"), version="v4")
    expected = reference()
    for url in (url_a, url_b):
        assert_vllm_serves(server_generate(url), expected)
    report(
        rank=rank,
        event="partial",
        replicas=list(record.replicas),
        skipped=record.skipped_tensors,
        full_because=record.full_because,
    )
    decided_once(engine, rank, [url_a, url_b], merge, reference)
    report(rank=rank, outcome="ok")
    finish()


def _stop_for(seconds: float, after: float = 0.0) -> None:
    """SIGSTOP this process ``after`` seconds from now, for ``seconds`` (a GC pause, a preemption), from outside."""
    import subprocess

    pid = os.getpid()
    subprocess.Popen(["sh", "-c", f"sleep {after}; kill -STOP {pid}; sleep {seconds}; kill -CONT {pid}"])


def decided_once(engine, rank: int, urls: list[str], merge: str, reference) -> None:  # type: ignore[no-untyped-def]
    """Decided once, for every server: each case with both servers and both ranks, and a lease of 2 s.

    7. rank 0 is stopped for 4 s *inside the vote to commit* (it voted; rank 1 is slow to): A's lease runs out and A
       rolls back. The vote passes, but A refuses the decision's record, so no server commits: every rank raises
       and both servers serve v4 (before, B committed v5 while A served v4).
    8. rank 0 is stopped for 5 s *after recording the decision*, before committing: A's lease has A's workers
       commit and finishes as v5; rank 0's late commit is answered as done. Both serve v5.
    9. (merge="trainer") B is restarted at its address between its load and the vote: it answers "not held, not
       expired", which counts as lost. Every rank raises; A serves v5, B never says v6; the next sync serves both.
    """
    import requests

    from lora_stream import transaction

    url_a, url_b = urls

    def state() -> dict[str, object]:
        return {
            u: (requests.get(f"{u}/weight_info", timeout=30).json()["weight_version"], server_generate(u)) for u in urls
        }

    def sync(version: str, timeout: float = 60) -> tuple[str | None, str]:
        # A new sink each time: its first sync sends everything (merge="engine" requires skip_unchanged).
        sink = VLLMServerSink(urls, rank=rank, timeout=timeout, lease=2, merge=merge, skip_unchanged=merge == "engine")
        try:
            sink.sync(ParamStream(engine, group_by="layer"), version=version)
            return None, "committed"
        except (LoraStreamError, StreamAbortedError) as exc:
            return type(exc).__name__, str(exc)[:600]

    def at(point: str, act) -> None:  # type: ignore[no-untyped-def]
        def hook(p: str) -> None:
            if p == point:
                act()

        transaction.set_fault_hook(hook)

    before = state() if rank == 0 else None
    engine.backward(engine(input_ids=IDS, labels=IDS).loss)
    engine.step()
    # 7: rank 0 enters the vote and is stopped there (0.5 s to 4.5 s: past A's 2 s lease); rank 1 reaches the vote at
    # 2.5 s. The vote itself settles (rank 0 runs again within lockstep.SETTLE_BOUND_S, 3 s, of the last arrival),
    # so what fails the sync is A's refusal of the decision.
    at("commit", (lambda: _stop_for(4.0, after=0.5)) if rank == 0 else (lambda: time.sleep(2.5)))
    try:
        error, message = sync("v5-lost-in-vote")
    finally:
        transaction.set_fault_hook(None)
    report(rank=rank, event="lost_in_vote", error=error, message=message, same=state() == before if rank == 0 else None)
    # 8: rank 0 is stopped after recording the decision at A, before committing.
    at("decision-recorded", (lambda: (_stop_for(5.0), time.sleep(1.0))) if rank == 0 else (lambda: None))
    try:
        error, message = sync("v5")
    finally:
        transaction.set_fault_hook(None)
    expected = reference()
    for url in urls:
        assert_vllm_serves(server_generate(url), expected)
    heal = requests.get(f"{url_a}/lora_stream/lease", timeout=30).json()["last_heal"] if rank == 0 else None
    report(
        rank=rank,
        event="forward_after_record",
        error=error,
        message=message,
        last_heal=heal,
        versions=[v for v, _ in state().values()] if rank == 0 else None,
    )
    if merge != "trainer":
        return
    # 9: B restarted between its load and the vote (rank 1 feeds B).
    engine.backward(engine(input_ids=IDS, labels=IDS).loss)
    engine.step()
    before = state() if rank == 0 else None

    def restart_b() -> None:
        signal("kill3")
        wait_for("killed3")
        signal("restart3")
        wait_for("restarted3")

    at("commit", restart_b if rank == 1 else (lambda: None))
    try:
        error, message = sync("v6", timeout=240)
    finally:
        transaction.set_fault_hook(None)
    after = state() if rank == 0 else None
    report(
        rank=rank,
        event="restarted_before_vote",
        error=error,
        message=message,
        a_same=after[url_a] == before[url_a] if rank == 0 else None,
        b_version=after[url_b][0] if rank == 0 else None,
    )
    error, message = sync("v6")
    # Reported before the check, so that a failed sync is read beside what the servers serve.
    report(rank=rank, event="after_restart", error=error, message=message if error else None)
    expected = reference()
    for url in urls:
        assert_vllm_serves(server_generate(url), expected)


if __name__ == "__main__":
    main()
