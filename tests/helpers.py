"""Tiny random models, non-zero adapters, and the oracle: peft's own merge_and_unload() in float32."""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

warnings.filterwarnings("ignore", message=".*Already unmerged.*")


def finish(code: int = 0) -> None:
    """End a distributed test worker without interpreter teardown.

    torch 2.13's gloo process groups occasionally abort the process while being destroyed at exit ("terminate called
    without an active exception"), after all the work and checks have passed; the exit code must reflect the checks.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_aborted(exc: Any, start: float) -> None:
    """A rank worker's ``aborted`` record for a :class:`~lora_stream.StreamAbortedError`, then exit 3."""
    import time

    report(
        rank=dist.get_rank(),
        event="aborted",
        seconds=time.monotonic() - start,
        failed_ranks=list(exc.failed_ranks),
        message=str(exc),
    )
    finish(3)


def count_exchanges() -> list[int]:
    """Count this process's status exchanges (the stream's and the sink's agreements): ``[n]``, updated in place."""
    from lora_stream.lockstep import Lockstep

    count = [0]
    statuses = Lockstep.statuses

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        count[0] += 1
        return statuses(self, *args, **kwargs)

    Lockstep.statuses = counted  # type: ignore[method-assign]
    return count


def private_base_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str) -> Iterator[Any]:
    """For a fixture: a private ``LORA_STREAM_BASE_DIR`` at ``tmp_path / name`` (yielded); the names this process
    published there are forgotten afterwards."""
    from lora_stream.engine import base_store
    from lora_stream.engine.base_dir import BASE_DIR_ENV

    where = tmp_path / name
    where.mkdir()
    monkeypatch.setenv(BASE_DIR_ENV, str(where))
    yield where
    for path in list(base_store._OWNED):
        if path.startswith(str(tmp_path)):
            base_store._OWNED.discard(path)


def report_exchange(rank: int, event: str, exchange: Any, returned: str = "returned") -> None:
    """Run ``exchange()`` (a lockstep agreement) and :func:`report` how it ended on this rank: ``returned`` (the
    outcome's name), or ``"raised"`` with the error's message, failed ranks and ``lost``; with the seconds it took."""
    import time

    from lora_stream import StreamAbortedError

    start = time.monotonic()
    try:
        exchange()
        report(rank=rank, event=event, outcome=returned, seconds=time.monotonic() - start)
    except StreamAbortedError as exc:
        report(
            rank=rank,
            event=event,
            outcome="raised",
            message=str(exc),
            failed=list(exc.failed_ranks),
            lost=exc.lost,
            seconds=time.monotonic() - start,
        )


def report(**fields: Any) -> None:
    """A test worker's result, as one ``RESULT {json}`` line that the test parses (see :func:`results_of`)."""
    import json

    print("RESULT " + json.dumps(fields, default=str), flush=True)


def report_sync(rank: int, label: str, record: Any, **extra: Any) -> None:
    """:func:`report` one sync's figures as the sync workers read them (event ``"sync"``): what was sent, skipped and
    gathered, why it was full, its elements, and the server workers' own stages (``worker``), plus ``extra``."""
    worker = dict(record.stages.get("worker") or {})
    report(
        rank=rank,
        event="sync",
        label=label,
        tensors=record.tensors,
        skipped=record.skipped_tensors,
        skipped_bytes=record.skipped_bytes,
        sent_bytes=record.bytes,
        gathered=record.gathered_bytes,
        full_because=record.full_because,
        elements=record.elements,
        fraction=record.element_fraction,
        seconds=record.seconds,
        worker=worker,
        kept=worker.get("kept_bytes"),
        **extra,
    )


def results_of(output: str) -> list[dict[str, Any]]:
    """Every ``RESULT`` record a worker printed, in order."""
    import json

    return [json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")]


def find_event(records: list[dict[str, Any]], name: str, where: str) -> dict[str, Any]:
    """The first of ``records`` with ``event == name``; fails naming ``where`` they came from if none."""
    for rec in records:
        if rec.get("event") == name:
            return rec
    raise AssertionError(f"no {name!r} result in {where}")


def event(output: str, name: str) -> dict[str, Any]:
    """The first ``RESULT`` record with ``event == name`` in a worker's output; fails showing the output if none."""
    return find_event(results_of(output), name, f"the worker's output:\n{output[-3000:]}")


def count_events(output: str, name: str) -> int:
    return sum(1 for rec in results_of(output) if rec.get("event") == name)


def require(module: str) -> ModuleType:
    """Import a component the test needs; in CI (LORA_STREAM_REQUIRE_ALL=1) a missing one fails instead of skipping."""
    if os.environ.get("LORA_STREAM_REQUIRE_ALL") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def unavailable(reason: str) -> None:
    """Something the test needs is missing here: skip, or in CI (LORA_STREAM_REQUIRE_ALL=1) fail, as ``require``."""
    if os.environ.get("LORA_STREAM_REQUIRE_ALL") == "1":
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


def tiny_llama(
    *,
    tie: bool = False,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 128,
    heads: int = 2,
    kv_heads: int = 1,
    inter: int = 96,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    bias: bool = False,
) -> nn.Module:
    """A random Llama of these sizes (``bias``: biases on the attention's projections)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        attention_bias=bias,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).to(dtype)


def tiny_gpt2(*, tie: bool = True, layers: int = 2, hidden: int = 64, vocab: int = 100, seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=vocab,
        n_embd=hidden,
        n_layer=layers,
        n_head=2,
        n_positions=32,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def lora(model: nn.Module, seed: int = 0, adapter_name: str = "default", **kw: Any) -> nn.Module:
    """Wrap with a LoRA adapter whose B is random (init_lora_weights=False), so merging is not the identity."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    kw.setdefault("r", 4)
    kw.setdefault("lora_alpha", 8)
    return get_peft_model(model, LoraConfig(init_lora_weights=False, **kw), adapter_name=adapter_name)


def oracle(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload() on an unsharded float32 copy: name -> tensor, as named_parameters() reports them."""
    m = copy.deepcopy(peft_model).float()
    if hasattr(m, "merge_and_unload"):
        m = m.merge_and_unload()
    return {n: p.detach() for n, p in m.named_parameters()}


def checkpoint_oracle(peft_model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    """The merged checkpoint: peft's merge_and_unload() of an unsharded float32 copy, written by save_pretrained
    (checkpoint names and layouts, persistent buffers) and read back."""
    copy.deepcopy(peft_model).float().merge_and_unload().save_pretrained(path)
    return read_checkpoint(path)


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_matches(
    got: Iterable[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor], tol: float = 1e-6
) -> None:
    """Same names in the same order, same shapes, relative Frobenius error under ``tol`` per tensor."""
    got = list(got)
    names = [n for n, _ in got]
    assert names == list(expected), (
        f"names differ: extra {set(names) - set(expected)}, missing {set(expected) - set(names)}"
    )
    for name, tensor in got:
        assert tuple(tensor.shape) == tuple(expected[name].shape), name
        err = rel_err(tensor, expected[name])
        assert err < tol, f"{name}: relative error {err:.3g} >= {tol}"


def stream_within_bound(stream: Any, bound: int, *, clone: bool = True) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """Iterate ``stream``, asserting at every yield that its gatherer holds more than nothing and at most ``bound``
    bytes gathered; returns the outputs and the largest amount held. ``clone=False`` keeps the yielded tensors
    themselves (a test that checks they stay valid past their group)."""
    got, peak = [], 0
    for name, tensor in stream:
        held = stream.gatherer.held_bytes()
        assert 0 < held <= bound, f"{name}: {held} bytes gathered, bound {bound}"
        peak = max(peak, held)
        got.append((name, tensor.clone() if clone else tensor))
    return got, peak


def assert_direct_equals_fallback(
    direct: Any, fallback: Any, groups: Iterable[Any], label: str, inside: Any = None
) -> int:
    """For every group, ``direct.gather`` gives the same dtypes, shapes and bytes as ``fallback.gather``;
    ``inside(params)`` runs while the direct gather is held. Returns the number of groups compared."""
    n = 0
    for group in groups:
        with direct.gather(group.params) as full:
            got = [full(p).clone() for p in group.params]
            if inside is not None:
                inside(group.params)
        with fallback.gather(group.params) as full:
            want = [full(p).clone() for p in group.params]
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), label
        n += 1
    return n


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def merged_flags(model: nn.Module) -> dict[str, object]:
    return {
        n: (getattr(m, "merged_adapters", None) and list(m.merged_adapters))
        for n, m in model.named_modules()
        if hasattr(m, "merged_adapters")
    }


def assert_bitwise_equal(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict(model.named_parameters())
    assert list(now) == list(before)
    for n, t in before.items():
        assert now[n].dtype == t.dtype and torch.equal(now[n].detach(), t), f"{n} changed"


# -- vLLM ----------------------------------------------------------------------------------------------------------
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
PROMPTS = [[1, 17, 42, 99, 5], [7, 300, 2, 11, 64, 8, 900]]


def vllm_llama(*, tie: bool = False, seed: int = 0, inter: int = 128, vocab: int = 1000) -> nn.Module:
    """The smallest Llama vLLM's CPU attention runs (head_dim 32), with weights large enough to give varied tokens.
    ``vocab``: vLLM pads its embedding to a multiple of 64 rows (1000 -> 1024)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model


def save_for_vllm(model: nn.Module, path: str, *, tokenizer: bool = False) -> str:
    """Save ``model`` where an engine will load it; with ``tokenizer`` also the word-level tokenizer a vLLM server
    needs (:func:`save_tokenizer`)."""
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    return path


def vllm_engine(path: str, *, compiled: bool = False, **kw: Any) -> Any:
    """An in-process vllm-cpu engine for the tests: float32, no tokenizer (prompts are token ids); eager, or with
    ``compiled`` in vLLM's default mode (torch.compile), the mode users run."""
    vllm = require("vllm")
    # An engine of an earlier test that is only now collected tears down vLLM's parallel groups in its finalizer;
    # collected in the middle of this engine's construction, it leaves the new one without them.
    gc.collect()
    options = {
        "dtype": "float32",
        "max_model_len": 128,
        "enforce_eager": not compiled,
        "seed": 0,
        "skip_tokenizer_init": True,
        "gpu_memory_utilization": 0.5,
        **kw,
    }
    return vllm.LLM(model=path, **options)


def assert_default_compiled_mode(compilation: Any, where: str) -> None:
    """``compilation`` (an engine's ``CompilationConfig``, or a server's ``compilation_config`` from ``/server_info``)
    is vLLM's default compiled mode: torch.compile is on, so a test built on it cannot quietly run eager. vllm-cpu
    compiles the model's forward with Inductor but captures no CUDA graphs (``cudagraph_mode`` NONE on a CPU), so the
    graphs' replay is not exercised here: ``benchmarks/gpu_check.py`` (``--vllm``) syncs, verifies and probes an
    engine that replays them on a GPU."""
    get = compilation.get if isinstance(compilation, dict) else lambda k: getattr(compilation, k)
    mode = get("mode")
    assert int(getattr(mode, "value", mode)) != 0, f"{where}: compilation mode {mode!r} is eager, not vLLM's default"
    graphs = get("cudagraph_mode")
    assert int(getattr(graphs, "value", graphs)) == 0, (
        f"{where}: vllm-cpu captured CUDA graphs ({graphs!r})? Then the test can cover them, and this helper's "
        "account of what vllm-cpu cannot compile is out of date"
    )


def vllm_generate(llm: Any, lora_request: Any = None) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation of PROMPTS with the chosen tokens' logprobs (with ``lora_request``: through that adapter)."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=8, logprobs=1),
        use_tqdm=False,
        lora_request=lora_request,
    )
    result = []
    for o in outs:
        c = o.outputs[0]
        ids = list(c.token_ids)
        result.append((ids, [c.logprobs[i][t].logprob for i, t in enumerate(ids)]))
    return result


def assert_vllm_serves(generated: list[tuple[list[int], list[float]]], hf_model: nn.Module, tol: float = 2e-3) -> None:
    """vLLM's greedy tokens and logprobs equal those of a transformers model holding the expected weights."""
    hf_model = hf_model.float().eval()
    # A saturated model (every logprob 0) would match any weights: refuse to compare against one.
    assert any(lp < -1e-3 for _, lps in generated for lp in lps), f"degenerate test model: {generated}"
    for prompt, (ids, logprobs) in zip(PROMPTS, generated):
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(full).logits[0].float(), -1)
        n = len(prompt)
        for i, tok in enumerate(ids):
            assert int(lp[n - 1 + i].argmax()) == tok, (
                f"token {i}: vLLM chose {tok}, reference {int(lp[n - 1 + i].argmax())}"
            )
            assert abs(logprobs[i] - float(lp[n - 1 + i, tok])) < tol, (i, logprobs[i], float(lp[n - 1 + i, tok]))


def merged_copy(peft_model: nn.Module) -> nn.Module:
    return copy.deepcopy(peft_model).float().merge_and_unload()


def save_tokenizer(path: str, vocab: int = 1000, pad_token: str | None = None) -> None:
    """A word-level tokenizer over tokens t0..t{vocab-1}, so vLLM's server can run (prompts are token ids).
    ``pad_token``: one of those tokens as the padding token (verl adds one past the vocabulary where there is none)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": pad_token} if pad_token is not None else {}
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2", **special
    ).save_pretrained(path)


def greedy_completion(
    base_url: str, prompt: str, *, max_tokens: int, model: str | None = None, timeout: float = 120.0
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """One greedy completion of ``prompt`` (``ignore_eos``) from a vLLM server: its token ids and their logprobs."""
    import requests

    if model is None:
        model = requests.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = requests.post(
        f"{base_url}/v1/completions",
        timeout=timeout,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "ignore_eos": True,
        },
    )
    r.raise_for_status()
    lp = r.json()["choices"][0]["logprobs"]
    return tuple(int(t.split(":")[1]) for t in lp["tokens"]), tuple(float(x) for x in lp["token_logprobs"])


def server_generate(
    base_url: str, api_key: str | None = None, model: str | None = None, dp_rank: int | None = None
) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation of PROMPTS from a vLLM server's /v1/completions, with the chosen tokens' logprobs
    (``model``: a LoRA adapter's name; default the served base model; ``dp_rank``: the data-parallel replica that
    must answer, through vLLM's ``X-data-parallel-rank`` header)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)
    if model is None:
        model = requests.get(f"{base_url}/v1/models", headers=headers, timeout=10).json()["data"][0]["id"]
    out = []
    for prompt in PROMPTS:
        r = requests.post(
            f"{base_url}/v1/completions",
            headers=headers,
            timeout=60,
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
        )
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append(([int(t.split(":")[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]))
    return out


#: The ZeRO-3 configuration the test workers train under (CPU, gloo, every parameter partitioned).
ZERO3_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}


def zero3_engine(
    model: nn.Module,
    config: dict[str, Any] | None = None,
    lr: float = 1e-2,
    *,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> Any:
    """``deepspeed.initialize`` with ``optimizer`` (default: AdamW at ``lr``) over the trainable parameters (what
    ZeRO-3 needs to run backward)."""
    import deepspeed

    # The shm comm op JIT-compiles with g++ for ~45 s on first use; plain gloo is all the tests need.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer is not None else torch.optim.AdamW(params, lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config or ZERO3_CONFIG)
    return engine


#: The sequence a test trainer's optimiser step trains on.
STEP_IDS = [[1, 17, 42, 99, 5, 7, 300]]


def train_sharded(
    model: nn.Module,
    gatherer: str,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    *,
    ds_config: dict[str, Any] | None = None,
    shard: tuple[str, ...] = (),
) -> tuple[Any, nn.Module, Callable[[], None]]:
    """``model`` sharded for training over the default process group: a ZeRO-3 engine (``gatherer="zero3"``, with
    ``ds_config``) or FSDP2 (``"fsdp2"``: each module whose name ends with one of ``shard``, then the root), its
    ``optimizer`` built over the trainable parameters. Returns ``(trainer, module, step)``: what a ParamStream takes,
    the module holding the parameters, and one optimiser step on :data:`STEP_IDS`."""
    ids = torch.tensor(STEP_IDS)
    if gatherer == "zero3":
        engine = zero3_engine(model, ds_config, optimizer=optimizer)

        def zero3_step() -> None:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        return engine, engine.module, zero3_step
    if gatherer != "fsdp2":
        raise ValueError(f"gatherer: zero3 or fsdp2, got {gatherer!r}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for name, m in model.named_modules():
        if shard and name.endswith(shard):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = optimizer([p for p in model.parameters() if p.requires_grad])

    def fsdp_step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return model, model, fsdp_step


def own_elements(p: torch.Tensor) -> torch.Tensor:
    """This rank's own elements of ``p``, flat, as a view that writes through: ZeRO-3's partition without the
    last partition's padding, FSDP2's local shard, or the whole tensor."""
    if hasattr(p, "ds_tensor"):
        size = int(p.ds_tensor.ds_numel)
        own = max(0, min(size, int(p.ds_numel) - dist.get_rank() * size))
        return p.ds_tensor.data.view(-1)[:own]
    if hasattr(p, "to_local"):
        return p.to_local().view(-1)
    return p.data.view(-1)


def edit_a_few(flat: torch.Tensor, g: torch.Generator, *, halve_sometimes: bool = False) -> None:
    """Structured edits of five elements of ``flat``, exact in any float dtype and missed by a linear or sampled
    check: a sign flip, a scaling by 2 (or, with ``halve_sometimes``, by 1/2 half the time), two elements swapped,
    four permuted. A ``flat`` of fewer than 16 elements is left as it is."""
    if flat.numel() < 16:
        return
    a, b, c, d, e = (int(i) for i in torch.randperm(flat.numel() - 4, generator=g)[:5])
    flat[a].neg_()
    flat[b].mul_(2.0 if not halve_sometimes or torch.rand((), generator=g) < 0.5 else 0.5)
    flat[c], flat[d] = flat[d].clone(), flat[c].clone()
    flat[e : e + 4] = flat[e : e + 4][torch.tensor([2, 0, 3, 1])].clone()


def fail_on_rank_1(point: str, rank: int) -> Callable[[str], None]:
    """A fault hook (``lora_stream.testing.set_fault_hook``) for the process of rank ``rank``: it raises at ``point``
    on rank 1 only, so that every other rank learns of the failure through the sync's agreements."""

    def hook(p: str) -> None:
        if rank == 1 and p == point:
            raise RuntimeError(f"injected failure at {p} on rank 1")

    return hook


def zero3_whole_into(engine: Any, template: nn.Module) -> nn.Module:
    """Copy a DeepSpeed ZeRO-3 engine's current whole weights into ``template``, an unsharded copy of its module.

    A gather of every parameter: every rank must call it together.
    """
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        src = dict(engine.module.named_parameters())
        with torch.no_grad():
            for n, p in template.named_parameters():
                assert src[n].shape == p.shape, (n, src[n].shape, p.shape)
                p.copy_(src[n].data.to(p.dtype))
    return template


class CollectiveCounter:
    """Counts every collective asked of the given namespaces (torch.distributed, deepspeed.comm, c10d ops) while active.

    Used to prove that planning and ``metadata()`` communicate nothing; a test also checks the counter does see the
    gathers of an iteration, so that a count of zero means something.
    """

    NAMES = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_into_tensor_coalesced",
        "_all_gather_base",
        "broadcast",
        "barrier",
        "reduce_scatter_tensor",
        "all_to_all_single",
        "send",
        "recv",
        "isend",
        "irecv",
        "gather",
        "scatter",
        "wait_tensor",
    )

    def __init__(self, *namespaces: Any) -> None:
        self.namespaces = namespaces
        self.count = 0
        self.saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> CollectiveCounter:
        self.count, self.saved = 0, []
        for ns in self.namespaces:
            for name in self.NAMES:
                fn = getattr(ns, name, None)
                if fn is None:
                    continue

                def wrapper(*a: Any, __fn: Any = fn, **k: Any) -> Any:
                    self.count += 1
                    return __fn(*a, **k)

                try:
                    setattr(ns, name, wrapper)
                except (AttributeError, TypeError):
                    continue
                self.saved.append((ns, name, fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for ns, name, fn in self.saved:
            setattr(ns, name, fn)


class Zoo(nn.Module):
    """One module of every kind peft can adapt, small enough to merge in milliseconds."""

    def __init__(self) -> None:
        from transformers.pytorch_utils import Conv1D

        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.lin = nn.Linear(32, 48)
        self.lin_nobias = nn.Linear(48, 32, bias=False)
        self.c1 = nn.Conv1d(8, 16, 3)
        self.c2 = nn.Conv2d(8, 16, 3)
        self.c2_1x1 = nn.Conv2d(16, 8, 1)
        self.c3 = nn.Conv3d(4, 8, (2, 3, 3))
        self.c2_groups = nn.Conv2d(8, 16, 3, groups=2)
        self.c2_dilated = nn.Conv2d(8, 16, 3, dilation=2)
        self.gpt2 = Conv1D(48, 32)
        self.mha = nn.MultiheadAttention(32, 2)
        self.moe = Experts()
        self.moe_t = TransposedExperts()


class Experts(nn.Module):
    """MoE experts as transformers 5 holds them: fused 3-D ``[experts, out, in]`` weights, and a 2-D router."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 32, 16))
        self.down = nn.Parameter(torch.randn(4, 16, 24))
        self.router = nn.Parameter(torch.randn(4, 16))


class TransposedExperts(nn.Module):
    """Experts stored ``[experts, in, out]`` (gpt-oss), which peft recognises by ``is_transposed``."""

    is_transposed = True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(4, 16, 32))


def zoo(seed: int = 0) -> nn.Module:
    """A :class:`Zoo` with seeded random weights."""
    torch.manual_seed(seed)
    return Zoo()


def perturb_adapters(model: nn.Module, seed: int = 1) -> None:
    """Move every trainable tensor (adapter factors, DoRA magnitudes, biases, modules_to_save copies) off peft's
    initialisation, which hides wrong merges (``lora_B == 0``; DoRA's magnitude equal to ``||W + dW||``)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(torch.randn(p.shape, generator=gen) * 0.2 * (p.abs().mean() + 0.1))


# -- QLoRA ---------------------------------------------------------------------------------------------------------
BNB_CONFIGS: dict[str, dict[str, Any]] = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16),
    "nf4-double": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.bfloat16),
    "fp4-double": dict(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    ),
    "int8": dict(load_in_8bit=True),
}


def load_quantized(path: str, quant: str, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A causal LM from ``path`` quantized by bitsandbytes the way QLoRA users load it (``from_pretrained``)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=BitsAndBytesConfig(**BNB_CONFIGS[quant]), device_map="cpu", dtype=dtype
    )


def dequantized_reference(qlora_model: nn.Module, path: str) -> nn.Module:
    """The QLoRA oracle: peft's ``merge_and_unload()`` on a float32 copy whose bases are bitsandbytes' own
    dequantization of the quantized weights, carrying the quantized model's adapter weights."""
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
    from peft.utils.integrations import dequantize_bnb_weight
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    quantized = qlora_model.get_base_model()  # type: ignore[operator]
    with torch.no_grad():
        for name, module in quantized.named_modules():
            if type(module).__module__.startswith("bitsandbytes"):
                target = dense.get_submodule(name.replace(".base_layer", ""))  # test-only name fix-up
                weight = dequantize_bnb_weight(module.weight, state=getattr(module, "state", None))
                target.weight.copy_(weight.float())
        for name, p in quantized.named_parameters():
            if not type(p).__module__.startswith("bitsandbytes") and "lora_" not in name:
                dense.get_parameter(name.replace(".base_layer", "")).copy_(p.float())
    config = copy.deepcopy(qlora_model.peft_config["default"])  # type: ignore[index]
    ref = get_peft_model(dense, config)
    set_peft_model_state_dict(ref, get_peft_model_state_dict(qlora_model))
    return ref.merge_and_unload()  # type: ignore[no-any-return]


def clear_cpu_shm() -> None:
    """vLLM's CPU tensor-parallel engines under ``external_launcher`` share memory through fixed-name segments; a
    worker killed by an earlier test's hard timeout leaves them behind and the next engine fails to start ("create
    shm ... errno: 17"). Only those port-less names go (``-tp:0-[0-1]-cpushm_<rank>``): a server's carry its port, and
    may belong to a server another xdist worker is starting."""
    from pathlib import Path

    for seg in Path("/dev/shm").glob("-*-cpushm_*"):
        seg.unlink(missing_ok=True)


def run_child_engine_script(script: str, path: str, *args: str, timeout: float = 300, in_process: bool = False) -> str:
    """Run ``tests/workers/<script> path *args`` with an engine in a child process (V1 multiprocessing, no insecure
    serialization) or, with ``in_process``, in the script's own process (for tests that need an engine of their own:
    vLLM's parallel state is per process, and tearing down a second engine breaks a module's shared one); returns
    its output, asserting it exited cleanly."""
    from launch import launch

    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
        "VLLM_ALLOW_INSECURE_SERIALIZATION": None,  # the extension must not need it
    }
    (rank,) = launch(script.removesuffix(".py"), path, *args, world=1, timeout=timeout, env=env, fork=in_process)
    assert rank.returncode == 0, rank.output[-8000:]
    return rank.output


@contextlib.contextmanager
def failing_at(point: str) -> Iterator[pytest.ExceptionInfo[RuntimeError]]:
    """The sync in the block fails at the transaction's fault point ``point`` (``lora_stream.testing``): a
    ``RuntimeError("injected at POINT")`` raised there, which the block must raise; yields pytest's record of it."""
    from lora_stream.testing import set_fault_hook

    def hook(p: str) -> None:
        if p == point:
            raise RuntimeError(f"injected at {p}")

    set_fault_hook(hook)
    try:
        with pytest.raises(RuntimeError, match=f"injected at {point}") as raised:
            yield raised
    finally:
        set_fault_hook(None)


def structured_edits(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Edits a linear (weighted-sum) fingerprint misses: every sign bit lands on bit 63 of some word at the right
    parity, and two changes of 2**63 cancel; powers of two touch only exponent bits; swaps and permutations keep
    every value."""
    out: dict[str, torch.Tensor] = {}
    rows, cols = w.shape
    for parity in range(8):  # a column at every position of a 64-bit word, whatever the element size
        e = w.clone()
        e[:, parity].neg_()
        out[f"column {parity} negated"] = e
    for step in (2, 4, 8):
        for offset in range(step):
            e = w.clone()
            e.view(-1)[offset::step].neg_()
            out[f"every {step}th element from {offset} negated"] = e
    for col in range(0, cols, 5):
        for factor in (2.0, 0.5, 4.0, 2.0**-8) if w.is_floating_point() else (2, -1):
            e = w.clone()
            e[:, col] = (e[:, col] * factor).to(w.dtype)
            out[f"column {col} times {factor}"] = e
    out["the whole tensor doubled"] = (w * 2).to(w.dtype)
    out["the whole tensor negated"] = -w
    for a, b in ((0, 1), (1, 3), (2, rows - 1)):
        e = w.clone()
        e[[a, b]] = e[[b, a]]
        out[f"rows {a} and {b} swapped"] = e
        e = w.clone()
        e[:, [a, b]] = e[:, [b, a]]
        out[f"columns {a} and {b} swapped"] = e
    gen = torch.Generator().manual_seed(w.numel())
    out["rows permuted"] = w[torch.randperm(rows, generator=gen)]
    out["columns permuted"] = w[:, torch.randperm(cols, generator=gen)]
    out["transposed in place"] = w.t().contiguous().view(rows, cols) if rows == cols else w.flip(0)
    return {k: e for k, e in out.items() if not torch.equal(e.view(torch.uint8), w.view(torch.uint8))}


def missed_structured_edits(fingerprint: Callable[[torch.Tensor], int], dtype: torch.dtype) -> list[str]:
    """The :func:`structured_edits` of a 32 x 40 tensor of ``dtype`` that ``fingerprint`` does not tell from the
    original, and the pairs of sign-flip edits that, composed, it does not (two flips cancel in a weighted sum)."""
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(32, 40, generator=gen) * 8).to(dtype)
    base = fingerprint(w)
    edits = structured_edits(w)
    assert len(edits) > 40
    missed = [name for name, e in edits.items() if fingerprint(e) == base]
    names = [k for k in edits if "negated" in k and "column" in k]
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            both = edits[a].clone()
            both.view(torch.uint8).bitwise_xor_(w.view(torch.uint8) ^ edits[b].view(torch.uint8))
            if not torch.equal(both.view(torch.uint8), w.view(torch.uint8)) and fingerprint(both) == base:
                missed.append(f"{a} and {b}")
    return missed
