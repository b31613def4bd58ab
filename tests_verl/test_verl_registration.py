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
