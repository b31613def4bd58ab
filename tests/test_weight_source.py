"""ParamStream meets vLLM's ``WeightSource`` contract: proven beside vLLM's own ``ModuleSource`` on plain models.

vLLM's trainer-side engines take their weights from a ``WeightSource``. It is an abstract base class, not a
``Protocol``, and none of the engines a ``ParamStream`` is meant for (``nccl``, ``ipc``, ``sharded_rdt``) checks it with
``isinstance`` (only ``nccl_m2n`` requires its own subclass), so a ``ParamStream`` is handed to them as it is. What
they read, and what each test proves:

- ``metadata()``: ``(name, dtype, shape)`` of every tensor, the shape a tuple (``nccl`` sizes the workers' receive
  buffers and chunk boundaries from it). lora_stream's ``ParamMeta`` holds vLLM's fields under vLLM's names, but it is
  another class, and dataclasses compare equal only within one class: the tests compare the fields.
- iteration agrees with ``metadata()`` element for element, each ``iter()`` a fresh pass (``nccl`` checks the
  agreement while it sends, with ``_checked_iter``, which runs here).
- ``held_names()``: ``None``, every rank holds every tensor.
- ``iter_groups()``: one ``(names, tensors)`` batch per group of vLLM's ``layerwise_groups`` over the metadata's
  names, in order. ``sharded_rdt`` computes those groups from ``metadata()`` itself and raises on the first batch that
  differs. A ``ParamStream`` yields its own groups, so this holds with ``group_by="layer"`` (the default), on every
  model whose metadata order vLLM accepts at all (``sharded_rdt`` refuses one whose names are not group-contiguous,
  from ``ModuleSource`` too); under ``group_by="budget"`` only the flat iteration (all ``nccl`` reads) matches.

"A plain model" is one without adapters and without a checkpoint conversion (Llama, GPT-2): there the checkpoint's
names are ``named_parameters()``' names, a tied weight comes once under the name ``named_parameters()`` gives it, and
neither model has a persistent buffer, so the default ``layout="checkpoint"`` yields exactly what ``ModuleSource``
yields. Where the two differ, they differ by design and are tested elsewhere: a checkpoint conversion (MoE experts one
tensor per expert), a persistent buffer, a merged adapter -- a ``ParamStream`` yields what the served checkpoint holds
(``test_contract.py``, ``test_architectures.py``), ``ModuleSource`` the trainer's ``named_parameters()``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import pytest
import torch
from helpers import require, tiny_gpt2, tiny_llama
from torch import nn

from lora_stream import ParamStream
from lora_stream.stream_pass import ParamMeta

base = require("vllm.distributed.weight_transfer.base")

MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: tiny_llama(),
    "llama-tied": lambda: tiny_llama(tie=True),
    "llama-bf16": lambda: tiny_llama(dtype=torch.bfloat16),
    "gpt2-tied": lambda: tiny_gpt2(),
}


def meta_fields(meta: list[object]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``ParamMeta`` as plain tuples, whichever class holds them; the shape must be a tuple (``nccl`` compares
    ``tuple(tensor.shape)`` with it)."""
    out = []
    for m in meta:
        name, dtype, shape = m.name, m.dtype, m.shape  # type: ignore[attr-defined]
        assert isinstance(name, str) and isinstance(dtype, torch.dtype), m
        assert isinstance(shape, tuple) and all(type(d) is int for d in shape), m
        out.append((name, dtype, shape))
    return out


def layer_of(name: str) -> tuple[str, int] | None:
    """The decoder layer a name belongs to: its outermost integer segment and what precedes it."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i]), int(part)
    return None


def assert_same_pairs(got: Iterable[tuple[str, torch.Tensor]], want: Iterable[tuple[str, torch.Tensor]]) -> int:
    """The same ``(name, tensor)`` pairs in the same order, each tensor equal in dtype, shape and every bit."""
    n = 0
    for (name, tensor), (ref_name, ref) in zip(got, want, strict=True):
        assert name == ref_name, (name, ref_name)
        assert tensor.dtype == ref.dtype and tensor.shape == ref.shape, name
        assert torch.equal(tensor, ref), f"{name} differs from ModuleSource's"
        n += 1
    return n


def assert_same_batches(
    got: Iterable[tuple[list[str], list[torch.Tensor]]], want: Iterable[tuple[list[str], list[torch.Tensor]]]
) -> int:
    """The same ``(names, tensors)`` batches in the same order, every tensor equal bit for bit."""
    n = 0
    for (names, tensors), (ref_names, refs) in zip(got, want, strict=True):
        assert list(names) == list(ref_names), (names, ref_names)
        assert_same_pairs(zip(names, tensors, strict=True), zip(ref_names, refs, strict=True))
        n += 1
    return n


def test_param_stream_has_every_channel_of_weight_source_callable_as_vllm_calls_it() -> None:
    """The contract is what this file checks: ``WeightSource`` requires ``metadata`` and ``__iter__`` and defines
    ``held_names``, ``groups`` and ``iter_groups`` with defaults; ``ParamStream`` defines all five itself, each
    callable with no argument (as the engines call them)."""
    ws = base.WeightSource
    assert inspect.isabstract(ws) and ws.__abstractmethods__ == frozenset({"metadata", "__iter__"})
    channels = ["metadata", "__iter__", "held_names", "groups", "iter_groups"]
    for name in channels:
        assert callable(getattr(ws, name)), name
        method = getattr(ParamStream, name)
        assert name in vars(ParamStream), f"ParamStream inherits {name} instead of defining it"
        params = list(inspect.signature(method).parameters.values())[1:]  # after self
        required = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        assert not required, f"ParamStream.{name} requires {required}; vLLM's engines pass nothing"
    assert [f.name for f in base.ParamMeta.__dataclass_fields__.values()] == ["name", "dtype", "shape"]
    assert list(ParamMeta.__dataclass_fields__) == list(base.ParamMeta.__dataclass_fields__)


@pytest.mark.parametrize("arch", list(MODELS))
def test_metadata_is_module_sources(arch: str) -> None:
    """``metadata()`` lists what vLLM's ``ModuleSource`` lists: every name, dtype and shape, in the same order; both
    hold every tensor on this rank (``held_names()`` is ``None``). A tied weight is listed once, under the name
    ``named_parameters()`` gives it; the alias is what lora_stream's sinks add for engines that keep a copy."""
    model = MODELS[arch]()
    stream, ref = ParamStream(model), base.ModuleSource(model)
    assert meta_fields(stream.metadata()) == meta_fields(ref.metadata())
    assert meta_fields(stream.metadata()) == meta_fields(stream.metadata())  # the same on every call
    assert stream.held_names() is None and ref.held_names() is None
    assert len(stream) == len(ref.metadata()) > 0
    if "tied" in arch:
        assert "lm_head.weight" not in [m.name for m in stream.metadata()]
        assert set(stream.tied_aliases()) == {"lm_head.weight"}


@pytest.mark.parametrize("arch", list(MODELS))
def test_every_tensor_is_module_sources_and_agrees_with_metadata(arch: str) -> None:
    """Iteration yields ``ModuleSource``'s pairs: the same names in the same order, every tensor ``torch.equal``
    (same dtype, same shape, every bit), on two passes in a row; and vLLM's own NCCL sender check
    (``NCCLTrainerWeightTransferEngine._checked_iter``: iteration against ``metadata()``, element for element)
    accepts it."""
    nccl = require("vllm.distributed.weight_transfer.nccl_engine")
    model = MODELS[arch]()
    stream, ref = ParamStream(model), base.ModuleSource(model)
    n = len(ref.metadata())
    assert assert_same_pairs(iter(stream), iter(ref)) == n
    assert assert_same_pairs(iter(stream), iter(ref)) == n  # a fresh pass each time
    checked = nccl.NCCLTrainerWeightTransferEngine._checked_iter(stream, stream.metadata())
    assert assert_same_pairs(checked, iter(ref)) == n
    assert stream.last_stats.complete and stream.last_stats.tensors == n


@pytest.mark.parametrize("arch", list(MODELS))
def test_layer_groups_are_vllms_layerwise_groups_one_contiguous_run_per_decoder_layer(arch: str) -> None:
    """With ``group_by="layer"``, ``groups()`` is vLLM's ``layerwise_groups`` over the metadata's names, which is
    ``ModuleSource.groups()``: the embeddings, one group per decoder layer (each layer's tensors one contiguous run,
    no layer split or interleaved with another), then the rest. Flattened it is the metadata order (``sharded_rdt``
    refuses a source otherwise). ``iter_groups()`` yields those batches with ``ModuleSource``'s tensors, and so does
    vLLM's own default ``WeightSource.iter_groups`` driven by the stream's flat iteration."""
    model = MODELS[arch]()
    stream, ref = ParamStream(model, group_by="layer"), base.ModuleSource(model)
    names = [m.name for m in stream.metadata()]
    groups = stream.groups()
    assert groups == base.layerwise_groups(names) == ref.groups()
    assert [n for g in groups for n in g] == names

    layers = [layer_of(n) for n in names]
    per_layer = [g for g in groups if layer_of(g[0]) is not None]
    assert len(per_layer) == model.config.num_hidden_layers  # not vacuous: every decoder layer has its group
    for g in per_layer:
        key = layer_of(g[0])
        assert {layer_of(n) for n in g} == {key}, g  # one layer per group
        assert g == [n for n, k in zip(names, layers, strict=True) if k == key], key  # all of it
        first = names.index(g[0])
        assert names[first : first + len(g)] == g, key  # contiguous
    assert [layer_of(g[0]) for g in per_layer] == sorted({k for k in layers if k is not None})
    assert all(layer_of(n) is None for g in groups if g not in per_layer for n in g)

    assert assert_same_batches(stream.iter_groups(), ref.iter_groups()) == len(groups)
    assert assert_same_batches(base.WeightSource.iter_groups(stream), ref.iter_groups()) == len(groups)


def test_budget_grouping_matches_flat_iteration_only() -> None:
    """Under ``group_by="budget"`` the metadata and the flat iteration are still ``ModuleSource``'s (what ``nccl``
    reads), but the groups are not vLLM's (the whole tiny model fits one budget): ``sharded_rdt``, which checks every
    batch against ``layerwise_groups``, needs ``group_by="layer"``, the default."""
    model = tiny_llama()
    stream, ref = ParamStream(model, group_by="budget"), base.ModuleSource(model)
    assert meta_fields(stream.metadata()) == meta_fields(ref.metadata())
    assert assert_same_pairs(iter(stream), iter(ref)) == len(ref.metadata())
    expected = base.layerwise_groups([m.name for m in stream.metadata()])
    assert stream.groups() != expected
    assert len(stream.groups()) == 1 and len(expected) == model.config.num_hidden_layers + 2
    assert ParamStream(model).groups() == expected, "the default grouping is vLLM's"


def test_vllms_nccl_trainer_engine_iterates_the_stream_on_a_non_sender_rank() -> None:
    """vLLM's ``NCCLTrainerWeightTransferEngine.send_weights`` runs unchanged with a ``ParamStream`` as its source on
    a non-sender rank (the path that needs no GPU: read the metadata, iterate the source to stay in the trainer's
    gathers, never touch the client), and the stream's pass completes."""
    nccl = require("vllm.distributed.weight_transfer.nccl_engine")

    class UntouchedClient:
        def init_weight_transfer_engine(self, init_info: dict[str, object]) -> None:
            raise AssertionError("a non-sender rank called the client")

        def start_weight_update(self) -> None:
            raise AssertionError("a non-sender rank called the client")

        def update_weights(self, update_info: object) -> None:
            raise AssertionError("a non-sender rank called the client")

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            raise AssertionError("a non-sender rank called the client")

    client = UntouchedClient()
    assert isinstance(client, base.VLLMWeightSyncClient)
    stream = ParamStream(tiny_llama(), group_by="layer")
    engine = nccl.NCCLTrainerWeightTransferEngine(client=client, source=stream, is_sender=False)
    engine.send_weights()
    engine.send_weights()
    assert stream.last_stats.complete and stream.last_stats.tensors == len(stream.metadata())
