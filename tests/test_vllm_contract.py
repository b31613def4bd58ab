"""lora_stream's contract with vLLM (tests/vllm_contract.py), checked against releases that cannot run here.

Why: the CUDA-only vLLM releases (0.33, 0.34) install nothing on a CPU machine, but their wheels' Python sources can be
read. Each is checked against the same contract as the installed vLLM, whose source is checked too: a release that
actually runs the suite satisfies the contract, so a violation elsewhere is a real difference, not a checker quirk. A
copy of the installed source with one required method renamed must fail, naming it, so that the checker is known to
see what it claims to check.

The wheels are looked for in ``LORA_STREAM_VLLM_WHEELS`` (default ``.nox/vllm-wheels``; ``nox -s contract`` downloads
them). Missing wheels skip, or fail with ``LORA_STREAM_REQUIRE_ALL=1`` (CI).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import unavailable
from vllm_contract import CONTRACT, Calls, Class, Function, LoaderChecks, Route, Source, _routes, check

#: The CUDA releases checked from their wheels.
RELEASES = ("0.33.0", "0.34.0")
WHEELS = Path(os.environ.get("LORA_STREAM_VLLM_WHEELS", ".nox/vllm-wheels"))


def _missing(what: str) -> None:
    """Skip for a missing input, or fail in CI (``helpers.unavailable``)."""
    unavailable(f"{what} (`nox -s contract` provides it)")


def _wheel(version: str) -> Path:
    found = sorted(WHEELS.glob(f"vllm-{version}-*.whl"))
    if not found:
        _missing(f"no vllm {version} wheel in {WHEELS}")
    return found[0]


def _installed_root() -> Path:
    """The directory holding the installed ``vllm/`` package (its source, not imported: ``import vllm`` is slow)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        _missing("vLLM is not installed in this environment")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))).parent


def _report(problems: list[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)


@pytest.mark.parametrize("version", RELEASES)
def test_release_satisfies_the_contract(version: str) -> None:
    """Every vLLM name, signature and route lora_stream uses is in this release's wheel."""
    problems = check(_wheel(version))
    assert not problems, f"vllm {version} breaks lora_stream's contract:\n{_report(problems)}"


def test_installed_vllm_satisfies_the_contract() -> None:
    """The release the suite runs on satisfies the contract: it is neither stricter than vLLM nor misread."""
    problems = check(_installed_root())
    assert not problems, f"the installed vLLM breaks lora_stream's contract:\n{_report(problems)}"


def test_a_renamed_method_is_named(tmp_path: Path) -> None:
    """A copy of the installed source whose ``WeightTransferEngine.receive_weights`` is renamed fails the contract
    with a message naming that method (and the lora_stream module relying on it)."""
    rel = Path("vllm/distributed/weight_transfer/base.py")
    original = _installed_root() / rel
    # Only the files this entry reads need copying: the one module, with its packages' __init__ files.
    (tmp_path / rel.parent).mkdir(parents=True)
    for init in (Path("vllm/__init__.py"), Path("vllm/distributed/__init__.py"), rel.parent / "__init__.py"):
        shutil.copy(_installed_root() / init, tmp_path / init)
    text = original.read_text()
    assert "def receive_weights(" in text
    (tmp_path / rel).write_text(text.replace("def receive_weights(", "def receive_weights_renamed("))
    entry = next(e for e in CONTRACT if isinstance(e, Class) and e.name == "WeightTransferEngine")
    assert check(_installed_root(), [entry]) == []
    problems = check(tmp_path, [entry])
    assert any("WeightTransferEngine.receive_weights" in p and "lora_stream.engine.receiver" in p for p in problems), (
        problems
    )


def test_a_removed_route_is_named(tmp_path: Path) -> None:
    """A copy of the installed API-server sources without the ``/finish_weight_update`` route fails, naming it."""
    root = _installed_root()
    shutil.copytree(root / "vllm" / "entrypoints", tmp_path / "vllm" / "entrypoints")
    routers = [
        p for p in (tmp_path / "vllm" / "entrypoints").rglob("*.py") if '"/finish_weight_update"' in p.read_text()
    ]
    assert routers
    for p in routers:
        p.write_text(p.read_text().replace('"/finish_weight_update"', '"/finish_weight_update_gone"'))
    routes = [e for e in CONTRACT if type(e).__name__ == "Route"]
    problems = check(tmp_path, routes)
    assert problems == [p for p in problems if "/finish_weight_update" in p] and len(problems) == 1, problems


def _copy(root: Path, dest: Path, *rels: str) -> None:
    """Copy these files of the vLLM source at ``root`` (and every package ``__init__`` above them) into ``dest``."""
    for rel in rels:
        parts = Path(rel).parts
        for i in range(1, len(parts)):
            init = Path(*parts[:i], "__init__.py")
            if (root / init).is_file() and not (dest / init).exists():
                (dest / init).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / init, dest / init)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, dest / rel)


def _loader_entry() -> LoaderChecks:
    return next(e for e in CONTRACT if isinstance(e, LoaderChecks))


def test_the_adapter_loader_runs_exactly_the_validations_of_the_release(tmp_path: Path) -> None:
    """lora_stream's loader must run the validations vLLM's own ``_load_adapter`` runs, no fewer and no others: a
    copy of the installed loader that runs one more check, or one fewer, fails the contract naming the loader."""
    root = _installed_root()
    loader, manager = "vllm/lora/worker_manager.py", "vllm/lora/model_manager.py"
    assert check(root, [_loader_entry()]) == []
    text = (root / loader).read_text()
    call = "self._adapter_manager._validate_modules_to_save(lora)"
    assert call in text, "the installed release's loader validates modules_to_save"
    extra = tmp_path / "extra"
    _copy(root, extra, loader, manager)
    (extra / loader).write_text(text.replace(call, call + "\n            self._adapter_manager._validate_new(lora)"))
    problems = check(extra, [_loader_entry()])
    assert len(problems) == 1 and "_validate_new" in problems[0] and "_load_adapter" in problems[0], problems
    fewer = tmp_path / "fewer"
    _copy(root, fewer, loader, manager)
    (fewer / loader).write_text(text.replace(call, "pass"))
    problems = check(fewer, [_loader_entry()])
    assert len(problems) == 1 and "_validate_modules_to_save" in problems[0], problems


def test_lora_stream_picks_each_releases_validations_and_refuses_unknown_ones() -> None:
    """The pick for the method sets of 0.31, 0.32 and 0.33/0.34, and a clear refusal for a manager with none."""
    from lora_stream.engine.adapter_staging import AdapterLoadError, loader_validations

    def manager(*names: str) -> type:
        return type("LoRAModelManager", (), {n: (lambda self, lora: None) for n in names})

    moe, mts, tok, head = (
        "_validate_moe_lora_format",
        "_validate_modules_to_save",
        "_validate_token_classification_lora",
        "_validate_classification_head_lora",
    )
    assert loader_validations(manager(mts, tok)) == (mts, tok)  # 0.31
    assert loader_validations(manager(moe, mts, tok)) == (moe, mts, tok)  # 0.32
    assert loader_validations(manager(moe, head)) == (moe, head)  # 0.33, 0.34
    assert loader_validations(manager(moe, head)()) == (moe, head)  # an instance as well as its class
    with pytest.raises(AdapterLoadError, match=r"validates adapters differently.*supported vLLM release"):
        loader_validations(manager(moe, "_validate_something_else"))


def test_a_dropped_relayout_call_is_named(tmp_path: Path) -> None:
    """The experts' re-layout call that lora_stream's reload bracket watches: a copy of the installed MoE method
    that no longer makes it through ``fused_experts`` fails, naming it."""
    root = _installed_root()
    rel = "vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py"
    entry = next(e for e in CONTRACT if isinstance(e, Calls))
    assert check(root, [entry]) == []
    _copy(root, tmp_path, rel)
    text = (tmp_path / rel).read_text()
    assert ".fused_experts.process_weights_after_loading(" in text
    (tmp_path / rel).write_text(text.replace(".fused_experts.process_weights_after_loading(", ".fused_experts.other("))
    problems = check(tmp_path, [entry])
    assert len(problems) == 1 and "fused_experts.process_weights_after_loading" in problems[0], problems


def test_a_function_with_a_fallback_may_be_missing_but_not_changed(tmp_path: Path) -> None:
    """``compute_tensor_digests`` (lora_stream computes the same digests where vLLM has none, 0.31): a release
    without its module satisfies the entry, one with it satisfies it while the function takes the model, and one
    whose function needs another argument fails, naming it."""
    root = _installed_root()
    rel = "vllm/model_executor/model_loader/weight_checksum.py"
    entry = next(e for e in CONTRACT if isinstance(e, Function) and e.name == "compute_tensor_digests")
    assert entry.fallback and check(root, [entry]) == []
    _copy(root, tmp_path, "vllm/model_executor/model_loader/__init__.py")
    assert check(tmp_path, [entry]) == []  # no weight_checksum module: lora_stream's fallback
    (tmp_path / rel).write_text("def compute_tensor_digests(model):\n    return {}\n")
    assert check(tmp_path, [entry]) == []
    (tmp_path / rel).write_text("def compute_tensor_digests(model, kind):\n    return {}\n")
    problems = check(tmp_path, [entry])
    assert len(problems) == 1 and "compute_tensor_digests" in problems[0] and "kind" in problems[0], problems


def test_a_protocol_route_is_required_only_with_its_protocol(tmp_path: Path) -> None:
    """``/shutdown_weight_transfer_engine``, which lora_stream's client offers as vLLM's own HTTP client does
    (``HTTPVLLMWeightSyncClient``, 0.32 on; 0.31 has neither): required where vLLM's client has the method, not
    elsewhere."""
    root = _installed_root()
    entry = next(e for e in CONTRACT if isinstance(e, Route) and e.path == "/shutdown_weight_transfer_engine")
    assert entry.when is not None
    base = "vllm/distributed/weight_transfer/clients.py"
    has = "def shutdown_weight_transfer_engine(" in (root / base).read_text()
    assert check(root, [entry]) == []
    shutil.copytree(root / "vllm" / "entrypoints", tmp_path / "vllm" / "entrypoints")
    _copy(root, tmp_path, base)
    for p in (tmp_path / "vllm" / "entrypoints").rglob("*.py"):
        p.write_text(p.read_text().replace('"/shutdown_weight_transfer_engine"', '"/shutdown_gone"'))
    problems = check(tmp_path, [entry])
    assert len(problems) == (1 if has else 0), problems
    text = (tmp_path / base).read_text().replace("def shutdown_weight_transfer_engine(", "def other_method(")
    (tmp_path / base).write_text(text)
    assert check(tmp_path, [entry]) == []


def _unclassified_routes(src: Source) -> list[str]:
    from lora_stream.engine.routes import route_class

    return sorted({f"{m} {p}" for m, p in _routes(src) if route_class(p) == "unclassified"})


@pytest.mark.parametrize("version", RELEASES)
def test_every_route_of_the_release_is_classified(version: str) -> None:
    """Every route this release's API server declares is classified by lora_stream (serving, control or writing):
    a route vLLM adds is refused during a sync until someone reads its handler and decides."""
    unknown = _unclassified_routes(Source(_wheel(version)))
    assert not unknown, f"vllm {version} has routes lora_stream.engine.routes does not classify: {unknown}"


def test_every_route_of_the_installed_vllm_is_classified() -> None:
    unknown = _unclassified_routes(Source(_installed_root()))
    assert not unknown, f"the installed vLLM has routes lora_stream.engine.routes does not classify: {unknown}"
