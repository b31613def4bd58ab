"""One process of bench_elements.py (not meant to be run by hand): full fine-tuning (float32 master weights, AdamW)
streamed as bfloat16, element syncs against full syncs of the same weights.

Usage:
  elements_worker.py server CHECKPOINT URL_ELEMENTS URL_FULL OUT LRS WARMUP STEPS BATCH SEQ    (2 ZeRO-3 ranks)
  elements_worker.py colocated CHECKPOINT OUT LRS WARMUP STEPS BATCH SEQ LORA_LRS               (one process)

``server``: each rank feeds two vLLM servers that hold the same weights, one per sink, so that neither sink's writes
make the other's next sync full: ``VLLMServerSink(URL_ELEMENTS, elements=True)`` and
``VLLMServerSink(URL_FULL, skip_unchanged=False)``. After every training step both sync, in alternating order.

``colocated``: one in-process ``vllm.LLM`` (bfloat16) fed by both sinks in turn. A full sink's write makes the element
sink's next sync full, so after each step: the element sync (measured), the full sync of the same weights
(measured), then one more element-sink sync with nothing trained in between (full, "another writer"; reported, not
compared), which re-establishes its baseline for the next step. Then LoRA r=16 on every linear layer, merged, into
the same engine: what an ``elements=True`` sink's record says, and how many merged bfloat16 elements changed per step
(consecutive merged outputs compared here, bit for bit).

Each row is one sync: its wall seconds on this rank, what the record says, and this rank's exact count of changed
bfloat16 elements since the previous step (its own shard, compared here independently of the library), summed over
the ranks.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

PROMPTS = [[1, 17, 42, 99, 5], [7, 300, 2, 11, 64, 8, 900]]
DS = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_allow_untested_optimizer": True,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def local_shards(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """This rank's own elements of every parameter, flat, cast to bfloat16 (copies): ZeRO-3's partition (the padding
    of the last one cut off, as the library cuts it) or the whole tensor in one process."""
    out = {}
    for name, p in model.named_parameters():
        part = getattr(p, "ds_tensor", None)
        if part is not None:
            size, numel = int(part.ds_numel), int(p.ds_numel)
            lo = min(rank * size, numel)
            flat = part.data.view(-1)[: min(lo + size, numel) - lo]
        else:
            flat = p.detach().reshape(-1)
        out[name] = flat.to(torch.bfloat16)
    return out


def changed_elements(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Elements whose bfloat16 bits differ between ``old`` and ``new``, and the elements compared."""
    changed = sum(int((new[n].view(torch.int16) != old[n].view(torch.int16)).sum()) for n in new)
    return changed, sum(t.numel() for t in new.values())


def row(kind: str, lr: float, step: int, seconds: float, r: Any, rank: int) -> dict[str, Any]:
    worker = dict(r.stages.get("worker") or {})
    return {
        "kind": kind,
        "lr": lr,
        "step": step,
        "seconds": seconds,
        "record_seconds": r.seconds,
        "tensors": r.tensors,
        "bytes": r.bytes,
        "gathered_bytes": r.gathered_bytes,
        "peak_gathered_bytes": r.peak_gathered_bytes,
        "full_because": r.full_because,
        "elements": r.elements,
        "element_fraction": r.element_fraction,
        "stages": {k: v for k, v in r.stages.items() if isinstance(v, (int, float))},
        "worker": {k: v for k, v in worker.items() if isinstance(v, (int, float))},
        "rank": rank,
    }


def batch(vocab: int, b: int, seq: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (b, seq), generator=g)


def server_generate(url: str) -> list[tuple[list[int], list[float]]]:
    """Greedy continuations of PROMPTS with their tokens' logprobs, from a server."""
    import requests

    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
        r = requests.post(f"{url}/v1/completions", timeout=60, json={**body, "return_tokens_as_token_ids": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append(([int(t.split(":")[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]))
    return out


def llm_generate(llm: Any) -> list[tuple[list[int], list[float]]]:
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=8, logprobs=1),
        use_tqdm=False,
    )
    result = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        result.append((ids, [c.logprobs[i][t].logprob for i, t in enumerate(ids)]))
    return result


def server(argv: list[str]) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from lora_stream import ParamStream, VLLMServerSink

    ckpt, url_e, url_f, out = argv[:4]
    lrs = [float(x) for x in argv[4].split(",")]
    warmup, steps, b, seq = (int(x) for x in argv[5:9])
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)  # the float32 master weights
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0])
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=DS)
    sinks = {
        "elements": VLLMServerSink(url_e, rank=rank, timeout=600, elements=True),
        "full": VLLMServerSink(url_f, rank=rank, timeout=600, skip_unchanged=False),
    }
    stream = ParamStream(engine, dtype=torch.bfloat16, group_by="layer")
    rows: list[dict[str, Any]] = []
    n = 0

    def step() -> None:
        nonlocal n
        n += 1
        ids = batch(vocab, b, seq, n, rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    def sync(kind: str, lr: float, i: int) -> None:
        dist.barrier()
        t = time.perf_counter()
        r = sinks[kind].sync(stream, version=f"{kind}-{lr:g}-{i}")
        rows.append(row(kind, lr, i, time.perf_counter() - t, r, rank))

    for kind in sinks:  # the first syncs: full, and the transfer groups' setup
        sync(kind, 0.0, -1)
    prev = local_shards(engine.module, rank)
    equal = {}
    for lr in lrs:
        for g in opt.param_groups:
            g["lr"] = lr
        for i in range(warmup + steps):
            step()
            now = local_shards(engine.module, rank)
            counts = torch.tensor(changed_elements(prev, now), dtype=torch.int64)
            dist.all_reduce(counts)
            prev = now
            order = ("elements", "full") if i % 2 == 0 else ("full", "elements")
            for kind in order:
                sync(kind, lr, i - warmup)
                rows[-1]["changed"], rows[-1]["compared"] = int(counts[0]), int(counts[1])
                rows[-1]["warmup"] = i < warmup
        if rank == 0:
            equal[str(lr)] = server_generate(url_e) == server_generate(url_f)
        dist.barrier()
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "rows": rows, "served_equal": equal}, f)
    dist.barrier()


def bf16_engine(path: str) -> Any:
    """The in-process engine both colocated benchmarks sync into: bfloat16, eager, no tokenizer."""
    from vllm import LLM

    return LLM(
        model=path,
        dtype="bfloat16",
        max_model_len=128,
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.5,
    )


def colocated(argv: list[str]) -> None:
    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.element_codec import ENCODINGS, encoded_size

    ckpt, out = argv[:2]
    lrs = [float(x) for x in argv[2].split(",")]
    warmup, steps, b, seq = (int(x) for x in argv[3:7])
    lora_lrs = [float(x) for x in argv[7].split(",")]
    t0 = time.perf_counter()
    llm = bf16_engine(ckpt)
    engine_start_s = time.perf_counter() - t0
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    vocab = model.config.vocab_size
    rows: list[dict[str, Any]] = []
    n = 0

    def train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        nonlocal n
        n += 1
        ids = batch(vocab, b, seq, n, 0)
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    # Full fine-tuning: every parameter trains, float32 masters, streamed as bfloat16.
    opt = torch.optim.AdamW(model.parameters(), lr=lrs[0])
    sinks = {
        "elements": VLLMColocatedSink(llm, elements=True),
        "full": VLLMColocatedSink(llm, skip_unchanged=False),
    }
    stream = ParamStream(model, dtype=torch.bfloat16, group_by="layer")

    from lora_stream.engine.elements import ElementShadow
    from lora_stream.sinks.local_engine import local_model_runner

    shadow = ElementShadow.of(local_model_runner(llm.llm_engine).model)

    def sync(kind: str, lr: float, i: int, label: str | None = None) -> None:
        t = time.perf_counter()
        r = sinks[kind].sync(stream, version=f"{label or kind}-{lr:g}-{i}")
        rows.append(row(label or kind, lr, i, time.perf_counter() - t, r, 0))
        # The engine's own figures: tensors written where they are served, and its host copy.
        rows[-1]["engine"] = {"in_place": shadow.stats.get("in_place", 0.0), "copy_bytes": shadow.host_bytes}

    sync("elements", 0.0, -1)
    prev = local_shards(model, 0)
    equal = {}
    for lr in lrs:
        for g in opt.param_groups:
            g["lr"] = lr
        for i in range(warmup + steps):
            train(model, opt)
            now = local_shards(model, 0)
            changed, compared = changed_elements(prev, now)
            prev = now
            last = i == warmup + steps - 1
            sync("elements", lr, i - warmup)
            served = llm_generate(llm) if last else None
            sync("full", lr, i - warmup)
            if last:
                equal[str(lr)] = served == llm_generate(llm)
            sync("elements", lr, i - warmup, label="reestablish")
            for r in rows[-3:]:
                r["changed"], r["compared"], r["warmup"] = changed, compared, i < warmup

    # Merged LoRA (r=16, every linear layer) into the same engine, an elements=True sink.
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    lopt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=lora_lrs[0])
    lsink = VLLMColocatedSink(llm, elements=True)
    lstream = ParamStream(pm, dtype=torch.bfloat16, group_by="layer")
    factor_bytes = sum(p.numel() * 2 for p in pm.parameters() if p.requires_grad)  # the factors in bfloat16

    def merged() -> dict[str, torch.Tensor]:
        """Every LoRA-merged output of the stream (bfloat16), as the stream computes it."""
        out = {}
        with lstream.iter_groups() as it:
            for names, tensors in it:
                for name, t in zip(names, tensors, strict=True):
                    if name.endswith("proj.weight"):
                        out[name] = t.detach().clone()
        return out

    lrows: list[dict[str, Any]] = []
    r = lsink.sync(lstream, version="lora-first")
    lrows.append({**row("lora-first", 0.0, -1, r.seconds, r, 0), "warmup": True})
    mprev = merged()
    for lr in lora_lrs:
        for g in lopt.param_groups:
            g["lr"] = lr
        for i in range(warmup + steps):
            train(pm, lopt)
            mnow = merged()
            changed = {k: int((mnow[k].view(torch.int16) != mprev[k].view(torch.int16)).sum()) for k in mnow}
            whole = {k: mnow[k].numel() for k in mnow}
            # What the codec would send for these changes, had merged outputs been eligible (the smallest encoding).
            would = sum(min(encoded_size(e, changed[k], whole[k], 2) for e in ENCODINGS) for k in mnow)
            mprev = mnow
            t = time.perf_counter()
            r = lsink.sync(lstream, version=f"lora-{lr:g}-{i}")
            lrows.append(
                {
                    **row("lora", lr, i - warmup, time.perf_counter() - t, r, 0),
                    "warmup": i < warmup,
                    "merged_changed": sum(changed.values()),
                    "merged_elements": sum(whole.values()),
                    "merged_whole_bytes": 2 * sum(whole.values()),
                    "would_be_element_bytes": would,
                    "factor_bytes": factor_bytes,
                }
            )
    with open(f"{out}.json", "w") as f:
        json.dump({"rows": rows, "lora": lrows, "served_equal": equal, "engine_start_s": engine_start_s}, f)


if __name__ == "__main__":
    {"server": server, "colocated": colocated}[sys.argv[1]](sys.argv[2:])
