"""Fixes from a review: the adapter stream's config and refusals, the planner's seam, the merge's reads of the base,
linear budget grouping, gather-path counts in parameters, and the ZeRO-3 direct path decided by every rank together.

Every adapter tensor is perturbed away from peft's initialisation (``lora_B == 0`` hides wrong merges).
"""

from __future__ import annotations

import ast
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import perturb_adapters, rel_err, require, tiny_gpt2, tiny_llama
from launch import assert_all_ok, describe, launch
from torch import nn

from lora_stream import AdapterStream, UnsupportedAdapterError
from lora_stream.base_weights import DenseWeight
from lora_stream.buffers import Scratch
from lora_stream.core import ParamRef, Unit
from lora_stream.gatherers import PlainGatherer
from lora_stream.gatherers.base import nbytes
from lora_stream.grouping import partition
from lora_stream.merge import LoraTerm, LoraWeightMerge
from lora_stream.plan import Planner

SRC = Path(__file__).resolve().parent.parent / "src" / "lora_stream"

IDS = torch.tensor([[1, 17, 42, 99, 5, 7, 50, 3], [9, 8, 7, 6, 5, 4, 3, 2]])


def _peft_lora(model: nn.Module, **kw: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pm = get_peft_model(model, LoraConfig(**kw))
    perturb_adapters(pm)
    return pm


# -- 1. adapter_config() with rank_pattern / alpha_pattern --------------------------------------------------------
PATTERNS = dict(
    r=8,
    lora_alpha=12,
    rank_pattern={"o_proj": 4, r"layers\.1\.mlp\.down_proj": 2, "gate_proj": 6},
    alpha_pattern={"q_proj": 3, "down_proj": 5, r"layers\.0\.self_attn\.o_proj": 7},
)


def _save_adapter(stream: AdapterStream, path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    tensors = {n: t.detach().clone().contiguous() for n, t in stream}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(stream.adapter_config()))
    return tensors


@pytest.mark.parametrize("base", ["llama", "gpt2"])
def test_adapter_config_with_rank_and_alpha_patterns_loads_in_peft_with_the_trainers_forward(
    tmp_path: Path, base: str
) -> None:
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    build = (lambda: tiny_llama(layers=2)) if base == "llama" else (lambda: tiny_gpt2(layers=2))
    kw: dict[str, Any] = dict(PATTERNS, target_modules="all-linear")
    if base == "gpt2":
        kw = dict(
            r=8,
            lora_alpha=12,
            target_modules=["c_attn", "c_proj", "c_fc"],
            rank_pattern={"c_proj": 3, r"h\.1\.attn\.c_attn": 5},
            alpha_pattern={"c_fc": 2, r"h\.0\.mlp\.c_proj": 9},
            fan_in_fan_out=True,
        )
    pm = _peft_lora(build(), **kw).eval()
    stream = AdapterStream(pm)
    tensors = _save_adapter(stream, tmp_path / "adapter")
    # The stream's names are the keys peft itself saves (what from_pretrained reads back).
    assert list(tensors) == list(get_peft_model_state_dict(pm))
    ranks = {t.shape[0] for n, t in tensors.items() if n.endswith("lora_A.weight")}
    assert len(ranks) > 2, ranks  # the patterns really give modules different ranks
    config = stream.adapter_config()
    assert config["r"] == config["lora_alpha"] == max(ranks) and not config["use_rslora"]

    loaded = PeftModel.from_pretrained(build(), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want, got = pm(input_ids=IDS).logits, loaded(input_ids=IDS).logits
    assert rel_err(got, want) < 1e-6, rel_err(got, want)
    # ...and it is not the base model's forward: the adapter matters.
    with torch.no_grad(), pm.disable_adapter():
        assert rel_err(pm(input_ids=IDS).logits, want) > 1e-3


def test_adapter_config_patterns_resolve_in_vllm_to_each_modules_rank_and_scaling_one() -> None:
    require("vllm")
    from vllm.lora.peft_helper import PEFTHelper

    pm = _peft_lora(tiny_llama(layers=2), target_modules="all-linear", **PATTERNS)
    stream = AdapterStream(pm)
    helper = PEFTHelper.from_dict(stream.adapter_config())
    modules = 0
    for meta in stream.metadata():
        if meta.name.endswith(".lora_A.weight"):
            module = meta.name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            assert helper.get_rank_and_scaling(module) == (meta.shape[0], 1.0), module
            modules += 1
    assert modules == 2 * 7


def test_adapter_config_anchors_a_pattern_that_is_the_tail_of_another_modules_path() -> None:
    """A module path that ends another adapted module's path gets a ``^``-anchored key, so peft's "(.*\\.)?(K)$"
    matches it alone."""
    import re

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.inner = Inner()

    pm = _peft_lora(Outer(), r=4, lora_alpha=4, target_modules=["proj"], rank_pattern={r"^proj": 2})
    config = AdapterStream(pm).adapter_config()
    assert config["rank_pattern"] == {"^proj": 2} == config["alpha_pattern"]
    key = next(iter(config["rank_pattern"]))
    assert re.match(rf"(.*\.)?({key})$", "proj") and not re.match(rf"(.*\.)?({key})$", "inner.proj")


# -- 2. trainable tokens ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
def test_trainable_tokens_are_refused_with_unsupported_adapter_error(tie: bool) -> None:
    pm = _peft_lora(
        tiny_llama(layers=1, tie=tie), r=4, target_modules=["q_proj"], trainable_token_indices={"embed_tokens": [1, 2]}
    )
    with pytest.raises(UnsupportedAdapterError, match="trainable tokens"):
        AdapterStream(pm)


# -- 3. the planner's public seam ---------------------------------------------------------------------------------
def test_adapter_stream_uses_the_planners_public_seam_not_its_private_names() -> None:
    tree = ast.parse((SRC / "adapter.py").read_text())
    private = [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "plan"
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert private == []
    overridden = [
        f.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(ast.unparse(b) == "Planner" for b in node.bases)
        for f in node.body
        if isinstance(f, ast.FunctionDef) and f.name.startswith("_") and f.name != "__init__"
    ]
    assert overridden == [], "the adapter planner overrides only the documented hooks"


def test_planner_without_base_weights_emits_only_what_its_hooks_emit() -> None:
    from lora_stream.lockstep import Status  # noqa: F401  (the package imports cleanly alongside)

    pm = _peft_lora(tiny_llama(layers=1), r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    full = Planner(PlainGatherer(), None)
    full.visit(pm, "", "")
    assert full.units
    bare = Planner(PlainGatherer(), None, base_weights=False)
    bare.visit(pm, "", "")
    assert bare.units == []


# -- 4. one read of the base per merge ----------------------------------------------------------------------------
class _CountingFull:
    def __init__(self) -> None:
        self.calls: dict[int, int] = {}

    def __call__(self, p: Any) -> torch.Tensor:
        self.calls[id(p)] = self.calls.get(id(p), 0) + 1
        return p.detach().clone()  # what FSDP1's accessor does: a whole copy per call


@pytest.mark.parametrize("transposed", [False, True])
def test_lora_weight_merge_reads_each_parameter_once(transposed: bool) -> None:
    torch.manual_seed(0)
    out_f, in_f, r = 24, 40, 3
    weight = nn.Parameter(torch.randn(in_f, out_f) if transposed else torch.randn(out_f, in_f))
    a, b = nn.Parameter(torch.randn(r, in_f)), nn.Parameter(torch.randn(out_f, r))
    term = LoraTerm(a, b, 0.5, True, True) if transposed else LoraTerm(b, a, 0.5, False, False)
    merge = LoraWeightMerge(DenseWeight(weight, weight.shape), [term], channel_dim=int(transposed), block_bytes=256)
    full = _CountingFull()
    out = merge.compute(full, torch.float32, Scratch(None))
    delta = (b @ a).t() if transposed else b @ a
    assert torch.allclose(out, weight + 0.5 * delta, atol=1e-5)
    assert full.calls == {id(weight): 1, id(a): 1, id(b): 1}, full.calls


# -- 5. budget grouping in linear time ----------------------------------------------------------------------------
def _reference_partition(units: list[Unit], budget: int, gather_bytes: Any) -> list[list[int]]:
    """The grouping before the fix (quadratic): ask for the whole group's bytes for every unit added."""
    groups: list[list[Unit]] = []
    current: list[Unit] = []
    for unit in units:
        if current and gather_bytes([p for u in (*current, unit) for p in u.params]) > budget:
            groups.append(current)
            current = []
        current.append(unit)
    if current:
        groups.append(current)
    return [[units.index(u) for u in g] for g in groups]


class _CountingGatherer(PlainGatherer):
    """Sizes by a table (``uint8``: bytes == elements); counts the parameters it is asked about, through
    ``full_shape`` (what ``gather_bytes`` reads for every parameter it is given) and ``gather_key``. ``unit_of`` maps
    some parameters to a shared key (an FSDP1-like unit: they are materialized together)."""

    def __init__(self, sizes: dict[int, int], unit_of: dict[int, int]) -> None:
        self.sizes, self.unit_of = sizes, unit_of
        self.unit_bytes = {u: 1000 + 7 * u for u in set(unit_of.values())}
        self.seen = 0

    def full_shape(self, param: ParamRef) -> torch.Size:
        self.seen += 1
        return torch.Size([self.sizes[id(param)]])

    def full_dtype(self, param: ParamRef) -> torch.dtype:
        return torch.uint8

    def gather_key(self, param: ParamRef) -> tuple[Any, int]:
        u = self.unit_of.get(id(param))
        if u is None:
            return super().gather_key(param)
        self.seen += 1
        return ("unit", u), self.unit_bytes[u]


def _random_units(rng: random.Random, n: int) -> tuple[list[Unit], dict[int, int], dict[int, int]]:
    pool = [nn.Parameter(torch.empty(0)) for _ in range(n * 2)]
    sizes = {id(p): rng.randint(1, 400) for p in pool}
    unit_of = {id(p): rng.randrange(n // 4) for p in pool if rng.random() < 0.3}
    units = []
    for i in range(n):
        near = pool[max(0, 2 * i - 6) : 2 * i + 2]  # neighbours share parameters (tied weights)
        params = rng.sample(near, k=rng.randint(1, min(4, len(near))))
        units.append(Unit(f"m{i}", [], params))
    return units, sizes, unit_of


@pytest.mark.parametrize("seed", range(6))
def test_budget_partition_is_incremental_and_groups_exactly_as_before(seed: int) -> None:
    rng = random.Random(seed)
    units, sizes, unit_of = _random_units(rng, 300)
    for budget in (1, 500, 2500, 10_000, 10**9):
        g = _CountingGatherer(sizes, unit_of)
        groups = partition(units, "budget", budget, g.gather_bytes)
        got = [[units.index(u) for u in grp.units] for grp in groups]
        assert got == _reference_partition(units, budget, g.gather_bytes), budget
        assert [grp.gathered_bytes for grp in groups] == [g.gather_bytes(grp.params) for grp in groups]
        g.seen = 0
        partition(units, "budget", budget, g.gather_bytes)
        occurrences = sum(len(u.params) for u in units)
        assert g.seen <= 3 * occurrences, (budget, g.seen, occurrences)  # linear, not quadratic


def test_budget_partition_of_one_large_group_asks_about_each_parameter_a_bounded_number_of_times() -> None:
    """The worst case: everything fits in one group. Asking for the whole group's bytes for every unit added would
    cost ~n^2/2 parameter lookups here."""
    units, sizes, unit_of = _random_units(random.Random(0), 4000)
    g = _CountingGatherer(sizes, unit_of)
    groups = partition(units, "budget", 10**12, g.gather_bytes)
    assert len(groups) == 1
    assert g.seen <= 3 * sum(len(u.params) for u in units), g.seen


def test_gather_bytes_is_the_sum_over_distinct_gather_keys() -> None:
    a, b = nn.Parameter(torch.zeros(3, 4)), nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    g = PlainGatherer()
    assert g.gather_key(a) == (id(a), 48)
    assert g.gather_bytes([a, b, a]) == 48 + nbytes(b.shape, b.dtype)


# -- 6 and 7. gather paths in parameters; ZeRO-3's direct path decided by every rank ---------------------------
def test_zero3_direct_path_is_agreed_across_ranks_when_a_parameters_state_differs() -> None:
    require("deepspeed")
    results = launch("review_zero3", "agree", timeout=180)
    assert_all_ok(results)
    for r in results:
        assert "RESULT" in r.output and '"event": "agreed"' in r.output, describe(results)
