"""One architecture end to end: a tiny random model with a perturbed LoRA, synced into a real vLLM engine.

Usage: vllm_architecture.py ARCH_ID[,ARCH_ID...] WORKDIR

Several architectures run in one process (the imports and the interpreter are paid once); each one's records carry
``arch``. Every model and reference is made before the first engine starts.

Two references: the merged model's greedy tokens and logprobs in transformers (computed before any engine starts:
vLLM's Transformers backend patches transformers classes in place), and the oracle, what a vLLM engine started from
the merged checkpoint serves. One engine per architecture: started from the merged checkpoint, it serves the oracle;
then the base model is synced into it, so that it serves something else (the control); then the merged model is
synced, and what it serves must be the oracle again: the sync alone made the engine serve exactly what the merged
checkpoint does. Prints ``RESULT`` lines: ``reference``, ``engine`` (started, or vLLM's own error), ``oracle``
(generated from the merged checkpoint), ``control`` (generated after the base sync, or vLLM's error when it loads the
model but cannot run it), ``synced`` (the merged sync's outcome, and what was generated after it), ``partial``
(after the adapter moved again: a sync that sends only what changed, then what it served and what a full sync of the
same weights serves, which must be equal).
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

warnings.filterwarnings("ignore")


def greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids, lps = list(prompt), []
            for _ in range(n):
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
                tok = int(lp.argmax())
                ids.append(tok)
                lps.append(float(lp[tok]))
            out.append((ids[len(prompt) :], lps))
    return out


class Prepared:
    """One architecture's models and references, made before any engine starts in this process."""

    def __init__(self, arch_id: str, workdir: str) -> None:
        from architectures import BY_ID, build
        from helpers import PROMPTS, merged_copy, perturb_adapters
        from peft import LoraConfig, get_peft_model

        self.arch_id = arch_id
        arch = BY_ID[arch_id]
        self.base_dir = os.path.join(workdir, arch_id, "base")
        model = build(arch)
        model.save_pretrained(self.base_dir)
        from transformers import AutoModelForCausalLM

        # The control's weights, read back now: once an engine has used vLLM's Transformers backend, transformers'
        # classes are patched and cannot build a model outside vLLM.
        self.base = AutoModelForCausalLM.from_pretrained(self.base_dir, torch_dtype=torch.float32)
        self.pm = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **arch.lora))
        perturb_adapters(self.pm)
        merged = merged_copy(self.pm).eval()
        self.merged_dir = os.path.join(workdir, arch_id, "merged")
        merged.save_pretrained(self.merged_dir)
        self.reference = greedy(merged, PROMPTS, 8)


def check(p: Prepared) -> None:
    """The engine from the merged checkpoint (the oracle), then the base sync (the control), then the merged sync.
    Every outcome is reported, never raised, so that the next architecture runs."""
    from helpers import report, vllm_engine, vllm_generate

    from lora_stream import ParamStream, VLLMColocatedSink

    def say(**fields: object) -> None:
        report(arch=p.arch_id, **fields)

    def generated(event: str, llm: Any) -> bool:
        out, error = generate_or_error(llm)
        if error is None:
            say(event=event, ok=True, generated=out)
        else:
            say(event=event, ok=False, error=error)
        return error is None

    say(event="reference", generated=p.reference)
    try:
        llm = vllm_engine(p.merged_dir)
    except Exception as exc:
        say(event="engine", ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        return
    try:
        sink = VLLMColocatedSink(llm)
        assert sink._bracket is not None
        say(event="engine", ok=True, model_class=type(sink._bracket.model).__name__)
        generated("oracle", llm)  # what vLLM serves when started from the merged checkpoint itself
        for event, model in (("control", p.base), ("synced", p.pm)):
            try:
                record = sink.sync(ParamStream(model, group_by="layer"))
            except Exception as exc:
                say(
                    event="synced",
                    ok=False,
                    error_type=type(exc).__name__,
                    error=str(exc)[:1500],
                    trace=traceback.format_exc()[-1500:],
                )
                return
            if event == "control":
                generated("control", llm)
                continue
            try:
                say(event="synced", ok=True, tensors=record.tensors, generated=vllm_generate(llm))
            except Exception as exc:
                say(event="synced", ok=True, tensors=record.tensors, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        partial(p, llm, sink)
        elements(p, llm)
    finally:
        del llm


def generate_or_error(llm: Any) -> tuple[Any, str | None]:
    """What ``llm`` generates, or vLLM's error where it loads the model but cannot run it here (the syncs are still
    checked)."""
    from helpers import vllm_generate

    try:
        return vllm_generate(llm), None
    except Exception as exc:
        # The crashed request still holds its KV blocks, and the sink refuses to report success over a prefix
        # cache it cannot reset: drop them, as a user recovering from the crash would.
        llm.reset_prefix_cache(reset_running_requests=True)
        return None, f"{type(exc).__name__}: {str(exc)[:400]}"


def partial(p: Prepared, llm: Any, sink: Any) -> None:
    """A training step's worth of change (the adapter only), synced by the sink that holds the engine: it sends
    only the LoRA-merged outputs (and what vLLM loads into one module with them); what the engine then serves must be
    ``==`` what a full sync of the same weights makes it serve."""
    from helpers import perturb_adapters

    def prepare() -> tuple[Any, dict[str, Any]]:
        perturb_adapters(p.pm, seed=7)
        return sink, {}

    _against_full(p, llm, "partial", p.pm, prepare)


def _against_full(
    p: Prepared, llm: Any, event: str, model: torch.nn.Module, prepare: Callable[[], tuple[Any, dict[str, Any]]]
) -> None:
    """Runs ``prepare`` (it returns the sink under test and fields to report), syncs ``model`` by that sink, then a
    full sync of the same weights by another sink into the same engine, and reports ``event``: what the sync sent,
    and whether the engine served the same after each (``same``); or the first error."""
    from helpers import report

    from lora_stream import ParamStream, VLLMColocatedSink

    try:
        sink, fields = prepare()
        record = sink.sync(ParamStream(model, group_by="layer"))
        after = generate_or_error(llm)
        full = VLLMColocatedSink(llm, skip_unchanged=False).sync(ParamStream(model, group_by="layer"))
        again = generate_or_error(llm)
    except Exception as exc:
        report(arch=p.arch_id, event=event, ok=False, error=f"{type(exc).__name__}: {str(exc)[:1500]}")
        return
    report(
        arch=p.arch_id,
        event=event,
        ok=True,
        tensors=record.tensors,
        skipped=record.skipped_tensors,
        full_tensors=full.tensors,
        full_because=record.full_because,
        elements=record.elements,
        generated=after[1] is None,
        same=after == again,
        **fields,
    )


def _edit_elements(model: torch.nn.Module, seed: int) -> None:
    """Structured edits of a few elements of every weight (a sign flip, a scaling by a power of two, a swap): what a
    training step at an RL learning rate leaves in a bf16 model, a few elements per tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.data.view(-1)
            if flat.numel() < 4:
                continue
            a, b, c, d = (int(i) for i in torch.randperm(flat.numel(), generator=g)[:4])
            flat[a].neg_()
            flat[b].mul_(2.0)
            flat[c], flat[d] = flat[d].clone(), flat[c].clone()


def elements(p: Prepared, llm: Any) -> None:
    """Full fine-tuning of the base model (every weight trainable), synced with ``elements=True``: after a full sync,
    a few elements of every weight change and only those travel (outputs whose checkpoint conversion is not one
    tensor as is -- fused experts -- go whole, with the reason); the engine must then serve ``==`` what a full sync of
    the same weights serves."""
    from lora_stream import ParamStream, VLLMColocatedSink

    model = p.base
    for q in model.parameters():
        q.requires_grad_(True)

    def prepare() -> tuple[Any, dict[str, Any]]:
        sink = VLLMColocatedSink(llm, elements=True)
        first = sink.sync(ParamStream(model, group_by="layer"))
        _edit_elements(model, 3)
        return sink, {"first_full": first.full_because}

    _against_full(p, llm, "elements", model, prepare)


def main(arch_ids: list[str], workdir: str) -> None:
    from helpers import VLLM_ENV, finish

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    # Every reference first: vLLM's Transformers backend patches transformers classes in place once an engine uses
    # it, and a reference computed after that would not be transformers' own.
    prepared = [Prepared(a, workdir) for a in arch_ids]
    for p in prepared:
        check(p)
    finish(0)


if __name__ == "__main__":
    main(sys.argv[1].split(","), sys.argv[2])
