"""benchmarks/cost_elements.py, the projection of element syncs at GPU scale: its arithmetic holds together (what
docs/performance.md's table rests on), and what it claims about memory and the pause follows from its stages."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # last: nothing of the tests is shadowed

import cost_elements as ce
import cost_model as cm


@pytest.mark.parametrize("route", ["server", "colocated"])
@pytest.mark.parametrize("path", ce.PATHS)
def test_an_element_sync_is_the_sum_of_its_stages_and_pauses_only_for_the_apply_and_the_vote(
    route: ce.Route, path: ce.Path_
) -> None:
    shape, setup = cm.MODELS["Llama-3-8B"], cm.Setup(world=8, engine_tp=1, replicas=8, backend="nccl")
    p = ce.predict_elements(shape, setup, cm.GPU_PROFILES["H100"], 0.011, path, route)
    assert p.seconds == pytest.approx(sum(p.stages.values()))
    before = p.stages["trainer diff"] + p.stages["changes to host"] + p.stages["exchange"]
    before += p.stages.get("state check (pre-flight)", 0.0)
    assert 0 < p.paused <= p.seconds - before  # the trainer's read, the exchange and the pre-flight come first


def test_the_engine_keeps_o_changed_in_place_and_the_whole_model_to_rebuild() -> None:
    shape, setup, r = cm.MODELS["Llama-3-8B"], cm.Setup(world=8, engine_tp=1, replicas=8), cm.GPU_PROFILES["H100"]
    mem = {
        (path, f): ce.predict_elements(shape, setup, r, f, path, "server").engine_host_bytes
        for path in ("rebuild", "in place")
        for f in (0.01, 0.02)
    }
    assert mem[("in place", 0.02)] == pytest.approx(2 * mem[("in place", 0.01)])
    assert mem[("rebuild", 0.01)] == mem[("rebuild", 0.02)] == pytest.approx(cm.param_count(shape) * 2)


def test_the_full_sync_it_compares_with_merges_nothing() -> None:
    shape = cm.MODELS["Llama-3-8B"]
    full = cm.predict(shape, cm.Setup(world=8, sink="server", lora_targets="none"), cm.GPU_PROFILES["H100"])
    lora = cm.predict(shape, cm.Setup(world=8, sink="server"), cm.GPU_PROFILES["H100"])
    assert full.stages["merge"] == 0 < lora.stages["merge"]
    assert full.out_bytes == pytest.approx(cm.param_count(shape) * 2)


def test_the_projection_covers_both_models_routes_and_paths() -> None:
    rows = ce.project("H100", [0.011])
    assert {(r["model"], r["route"], r["path"]) for r in rows} == {
        (m, route, path)
        for m in ("Llama-3-8B", "Llama-3-70B")
        for route in ("server", "colocated")
        for path in ce.PATHS
    }
    assert "| Llama-3-70B | colocated | 1.1% | in place |" in ce.markdown(rows)
