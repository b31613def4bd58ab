"""``verify=`` on the server sink: a server and a fleet of two prove before committing that they serve the policy.

Two real bfloat16 vLLM servers; the trainer's 2 ranks corrupt what one server receives (see
``workers/vllm_server_verify.py``). Every corrupted sync fails on every rank and every server serves, bit for bit,
what it served before; every correct bf16 sync passes.
"""

from __future__ import annotations

import os

import pytest
from helpers import require, results_of, save_for_vllm, vllm_llama
from launch import assert_all_ok, describe, launch
from vllm_server import Server, running


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    require("vllm")
    return save_for_vllm(vllm_llama(tie=False), str(tmp_path_factory.mktemp("verify") / "model"), tokenizer=True)


@pytest.fixture(scope="module")
def bf16_fleet(checkpoint: str):  # type: ignore[no-untyped-def]
    cores = os.cpu_count() or 2
    servers = [
        Server(
            checkpoint,
            extra=("--dtype", "bfloat16"),
            compiled=True,  # vLLM's default mode: the probe runs through the compiled graph requests use
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores), "OMP_NUM_THREADS": "1"},
        )
        for i in range(2)
    ]
    with running(servers) as ready:
        yield ready


def test_verify_catches_every_corrupted_sync_on_a_server_and_a_fleet_and_passes_correct_bf16_syncs(
    bf16_fleet: list[Server], checkpoint: str
) -> None:
    a, b = bf16_fleet
    from helpers import assert_default_compiled_mode

    from lora_stream.sinks.server_client import VLLMServerClient

    for s in bf16_fleet:
        assert_default_compiled_mode(VLLMServerClient(s.url).server_config()["compilation_config"], s.url)
    results = launch("vllm_server_verify", a.url, b.url, checkpoint, timeout=600)
    assert_all_ok(results)
    why = describe(results)
    events = [{e["event"]: e for e in results_of(r.output)} for r in results]
    r0, r1 = events

    def ok(name: str, versions: dict[str, str]) -> None:
        for e in (r0[name], r1[name]):
            assert e["outcome"] == "ok", f"{name}: {e.get('error')}: {e.get('message')}\n{why}"
            assert e["versions"] == versions, (name, e)
        v = r0[name]
        assert v["max_abs_diff"] is not None and v["max_abs_diff"] <= v["tolerance"], v
        assert v["kept_bytes"] and v["kept_bytes"] > 0, v  # what the server's workers kept to undo it
        assert {"trainer_s", "probe_s", "probe_before_s", "digest_s"} <= set(v["stages"]), v

    def failed(name: str, feeder: int, versions: dict[str, str], why_text: str) -> None:
        mine, other = (r0[name], r1[name]) if feeder == 0 else (r1[name], r0[name])
        assert mine["outcome"] == "raised" and mine["error"] == "VerificationError", f"{name}: {mine}\n{why}"
        assert why_text in mine["message"], (name, mine)
        assert other["outcome"] == "raised" and other["error"] in ("StreamAbortedError", "VerificationError"), other
        assert mine["versions"] == versions, (name, mine)
        # The strongest observable: every server's greedy outputs equal those of the last committed version.
        assert all(r0[name]["outputs_unchanged"].values()), (name, r0[name])

    ok("server-v1", {a.url: "v1"})
    assert r0["server-double"]["hits"] == 1 and r0["server-drop"]["hits"] == 1
    failed("server-double", 0, {a.url: "v1"}, "differ from the trainer's forward")
    failed("server-drop", 0, {a.url: "v1"}, "differ from the trainer's forward")
    step = r0["small-step"]
    assert step["resolution"] < step["moved"] < step["tolerance"], step  # below what the probe alone would catch
    assert r0["server-stale"]["hits"] > 0
    failed("server-stale", 0, {a.url: "v1"}, "did not change, bit for bit")
    ok("server-v2", {a.url: "v2"})

    before = r0["versions-before-probe-error"]["versions"]
    for feeder in (0, 1):
        e = (r0, r1)[feeder]["fleet-probe-error"]
        assert e["outcome"] == "raised" and "could not run" in e["message"], e
        assert e["versions"] == before, e
    assert all(r0["fleet-probe-error"]["outputs_unchanged"].values()), r0["fleet-probe-error"]
    ok("fleet-v3", {a.url: "v3", b.url: "v3"})
    assert r1["fleet-double"]["hits"] == 1 and r0["fleet-double"]["hits"] == 0
    failed("fleet-double", 1, {a.url: "v3", b.url: "v3"}, "differ from the trainer's forward")
    failed("fleet-stale", 1, {a.url: "v3", b.url: "v3"}, "did not change, bit for bit")
    assert r1["fleet-nudge"]["hits"] == 1
    failed("fleet-nudge", 1, {a.url: "v3", b.url: "v3"}, "do not hold the same weights")
    assert "do not hold the same weights" in r0["fleet-nudge"]["message"], r0["fleet-nudge"]
    ok("fleet-v4", {a.url: "v4", b.url: "v4"})
