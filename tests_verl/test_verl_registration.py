"""How ``lora_stream.integrations.verl`` enters verl's registry, and what it refuses at import (in this process)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from helpers import require


@pytest.fixture
def integration(monkeypatch: pytest.MonkeyPatch) -> Any:
    require("verl")
    monkeypatch.setenv("VERL_PLATFORM", "cpu")
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    import cpu_platform  # noqa: F401  (before verl picks a platform)

    import lora_stream.integrations.verl as integration

    return integration


def test_verl_builds_lora_streams_engine_for_both_fsdp_backends_and_keeps_its_own_for_the_rest(
    integration: Any,
) -> None:
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    assert integration.registry_key() == ("cuda", "cpu")
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is integration.LoraStreamFSDPEngine
        # verl's own engine keeps its device-wide key: other vendors still get it.
        assert EngineRegistry._engines["language_model"][backend]["cuda"] is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("value_model", "fsdp2") is not integration.LoraStreamFSDPEngine
    integration._register()  # importing twice (another config) registers nothing twice
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is integration.LoraStreamFSDPEngine


def test_another_engine_under_the_same_key_is_refused(integration: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers.engine import EngineRegistry

    class Other:
        pass

    key = integration.registry_key()
    held = {"language_model": {"fsdp2": {key: Other}}}
    monkeypatch.setattr(EngineRegistry, "_engines", held)
    with pytest.raises(integration.UnsupportedVerlError, match="already holds Other"):
        integration._register()


@pytest.mark.parametrize("release", ["0.9.0", "0.10.0", "1.0.0"])
def test_a_verl_release_outside_the_tested_range_is_refused(
    integration: Any, monkeypatch: pytest.MonkeyPatch, release: str
) -> None:
    monkeypatch.setattr(integration, "_installed_version", lambda name: release)
    with pytest.raises(integration.UnsupportedVerlError, match=f"this is verl {release}"):
        integration._check_verl_release()


def test_the_tested_releases_are_accepted(integration: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for release in ("0.9.1", "0.9.2", "0.9.10.dev0", "0.9.1+cpu"):
        monkeypatch.setattr(integration, "_installed_version", lambda name, r=release: r)
        integration._check_verl_release()
    assert os.environ["VERL_PLATFORM"] == "cpu"


def test_the_latest_exports_figures_join_the_next_training_steps_metrics_once(
    integration: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's training step is its own; its metrics (lists, one value per micro-batch) gain the latest export's
    figures once, in the shape verl's worker gathers per rank and its trainer reduces (the mean)."""
    from itertools import chain

    from verl.utils.metric import reduce_metrics
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    from lora_stream.sinks.record import METRICS, SyncRecord

    def verls_step(self: Any, data: Any, loss_function: Any) -> dict[str, Any]:
        return {"model_output": {}, "loss": [0.5], "metrics": {"pg_loss": [0.1, 0.3]}}

    monkeypatch.setattr(FSDPEngineWithLMHead, "train_batch", verls_step, raising=False)
    engine = object.__new__(integration.LoraStreamFSDPEngine)
    assert engine.train_batch(None, loss_function=None)["metrics"] == {"pg_loss": [0.1, 0.3]}  # no export yet
    record = SyncRecord("verl", 3, 2**20, 1, 0.25, 2**20, 2**20, version="export-1", full_because="verl")
    engine._unreported = record.metrics()
    metrics = engine.train_batch(None, loss_function=None)["metrics"]
    assert set(metrics) == {"pg_loss", *(f"lora_stream/{m}" for m in METRICS)}, metrics
    assert metrics["pg_loss"] == [0.1, 0.3] and metrics["lora_stream/sync_s"] == [0.25]
    per_rank = {k: list(chain.from_iterable([v, v])) for k, v in metrics.items()}  # 2 ranks, as verl flattens them
    reduced = reduce_metrics(per_rank)
    assert reduced["lora_stream/sent_mib"] == 1.0 and reduced["lora_stream/partial"] == 0.0, reduced
    again = engine.train_batch(None, loss_function=None)["metrics"]
    assert not [k for k in again if k.startswith("lora_stream/")], again


def test_an_export_consumed_to_its_end_is_one_logged_sync_with_its_record(integration: Any) -> None:
    """The export's record (every tensor verl took, a tied alias included), its line at INFO on rank 0 and at DEBUG
    on another rank, and its figures held for the next training step; an export stopped early is no sync."""
    import logging

    from helpers import lora, tiny_llama

    from lora_stream import ParamStream

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logger = logging.getLogger("lora_stream")
    keep, level = Keep(), logger.level
    logger.addHandler(keep)
    logger.setLevel(logging.DEBUG)
    try:
        engine = object.__new__(integration.LoraStreamFSDPEngine)
        engine._is_offload_param = False  # what verl's engine sets when it builds; nothing to stage here
        stream = ParamStream(lora(tiny_llama(tie=True), target_modules=["q_proj"]))
        aliases = stream.tied_aliases()
        assert aliases, "a tied model: the export yields lm_head under both names"
        for rank in (0, 1):
            engine.rank = rank
            got = list(engine._export(stream, aliases))
            record = engine.last_record
            assert record.tensors == len(got) and record.bytes == sum(t.numel() * t.element_size() for _, t in got)
            assert record.version == f"export-{rank + 1}" and record.sink == "verl" and not record.partial
            assert engine._unreported == record.metrics()
        lines = [r for r in seen if "lora_stream sync export-" in r.getMessage()]
        assert [(r.levelno, r.getMessage().split(" (")[0]) for r in lines] == [
            (logging.INFO, "lora_stream sync export-1"),
            (logging.DEBUG, "lora_stream sync export-2"),
        ], [r.getMessage() for r in seen]
        export = engine._export(stream, aliases)
        next(export)
        export.close()  # verl stopped taking tensors: not a sync
        assert engine.last_record.version == "export-2"
        assert [r for r in seen if "lora_stream sync export-" in r.getMessage()] == lines
    finally:
        logger.removeHandler(keep)
        logger.setLevel(level)


@pytest.mark.parametrize("strategy", ["fsdp", "megatron"])
def test_a_strategy_other_than_fsdp2_is_refused_naming_the_override_that_fixes_it(
    integration: Any, strategy: str
) -> None:
    """verl's default actor strategy is ``fsdp`` (FSDP1): the refusal, raised when the engine is built, gives the
    exact command-line line, as docs/verl.md shows it (the whole engine is built in tests_verl/test_verl.py)."""
    from pathlib import Path
    from types import SimpleNamespace

    engine = SimpleNamespace(rank=1, engine_config=SimpleNamespace(strategy=strategy), _qat_enabled=False)
    with pytest.raises(integration.UnsupportedVerlError) as info:
        integration.LoraStreamFSDPEngine._refuse_configuration(engine)
    message = str(info.value)
    assert message.startswith("rank 1: ") and f"strategy is {strategy!r}" in message, message
    assert "Add actor_rollout_ref.actor.strategy=fsdp2 to verl's command line" in message, message
    assert ("verl's default: FSDP1" in message) == (strategy == "fsdp"), message
    docs = (Path(__file__).resolve().parent.parent / "docs" / "verl.md").read_text()
    assert "    actor_rollout_ref.model.external_lib=lora_stream.integrations.verl \\\n" in docs
    assert "    actor_rollout_ref.actor.strategy=fsdp2 \\\n" in docs
    engine.engine_config.strategy = "fsdp2"
    integration.LoraStreamFSDPEngine._refuse_configuration(engine)  # accepted
