"""lora_stream inside the REAL verl: its FSDP engine built on 2 gloo ranks on CPU through verl's own trainer config,
the ``model.external_lib`` line and its ``EngineRegistry`` (workers/verl_engine.py says what each scenario checks).

Each test prints what it measured (``RESULT`` lines, shown with ``-s``); the comparison with verl's own export is
asserted where it is a property of this library (exactness, no drift, memory), and reported where it is verl's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from helpers import require, results_of
from launch import RankResult, describe, launch

from lora_stream.sinks.record import METRICS

WORKER = str(Path(__file__).resolve().parent / "workers" / "verl_engine.py")


def run(scenario: str, tmp_path: Path, timeout: float = 420) -> list[RankResult]:
    require("verl")
    # A new interpreter per rank: the main suite's fork server preloads vLLM and DeepSpeed, which this environment
    # does not have.
    return launch(WORKER, scenario, str(tmp_path), timeout=timeout, fork=False)


def events(results: list[RankResult], name: str) -> list[dict[str, Any]]:
    return [rec for r in results for rec in results_of(r.output) if rec.get("event") == name]


def test_merged_sync_is_the_exact_policy_for_twenty_syncs_and_never_writes_the_training_weights(
    tmp_path: Path,
) -> None:
    results = run("merged", tmp_path)
    assert all(r.returncode == 0 for r in results), describe(results)
    exact = events(results, "merged-exact")
    assert sorted((e["rank"], e["model"]) for e in exact) == sorted(
        (rank, model) for rank in (0, 1) for model in ("llama", "qwen2-tied", "llama-bf16", "llama-offload")
    ), describe(results)
    for e in exact:
        assert e["syncs"] == 20 and e["peak_gathered_bytes"] <= e["largest_layer_bytes"] < e["model_bytes"] / 3, e
    theirs = events(results, "verl-own")
    assert len(theirs) == 8 and all(e["same_names"] for e in theirs), theirs
    for e in theirs:
        print(
            f"verl's own merged export, {e['model']}: {e['tensors_unequal_to_oracle']} tensors differ from the "
            f"float32 merge (max {e['max_abs_diff_to_oracle']}), {e['shards_drifted']} shards drifted; "
            f"{e['seconds_per_sync']:.3f} s per sync"
        )
    assert len(events(results, "replanned")) == 2, describe(results)
    refused = events(results, "refused")
    assert len(refused) == 4, describe(results)


def test_adapter_sync_is_verls_adapter_with_the_scaling_in_lora_b(tmp_path: Path) -> None:
    results = run("adapter", tmp_path)
    assert all(r.returncode == 0 for r in results), describe(results)
    done = events(results, "adapter-exact")
    assert len(done) == 2 and all(e["tensors"] > 0 and e["base_tensors"] > 0 for e in done), describe(results)
    # Each sync is seen: one line per export on rank 0's stderr at the logging defaults (verl's own basicConfig,
    # WARNING), none on rank 1 (its line is DEBUG); the record's figures wait for the next training step's metrics.
    r0, r1 = results
    lines = [line for line in r0.output.splitlines() if "lora_stream sync " in line]
    assert [line.split("lora_stream sync ")[1].split(" ")[0] for line in lines] == [
        "export-1",
        "export-2",
        "export-3",
    ], describe(results)
    assert all("(verl-adapter)" in line and "; full: " in line and "; not verified;" in line for line in lines), lines
    assert not [line for line in r1.output.splitlines() if "lora_stream sync " in line], describe([r1])
    for e in done:
        figures = e["sync_figures"]
        assert e["sync_version"] == "export-3" and e["sync_tensors"] == e["tensors"], e
        assert set(figures) == {f"lora_stream/{m}" for m in METRICS} and figures["lora_stream/sent_mib"] > 0, e
        assert e["pending_figures"] == figures, e


def test_a_consumer_failing_on_rank_1_makes_rank_0_raise_naming_it(tmp_path: Path) -> None:
    results = run("raise", tmp_path, timeout=240)
    r0, r1 = results
    assert r1.returncode == 0 and events([r1], "consumer-raised"), describe(results)
    (aborted,) = events([r0], "aborted")
    assert r0.returncode == 3 and aborted["failed_ranks"] == [1], describe(results)
    assert aborted["seconds"] < 5, aborted  # from the stream's status exchange, not from rank 1's exit (8 s later)
