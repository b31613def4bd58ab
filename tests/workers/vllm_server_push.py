"""Rank worker: a 2-rank ZeRO-3 trainer pushes its merged LoRA weights into a vLLM server over the gloo backend.

Usage: vllm_server_push.py SCENARIO BASE_URL CHECKPOINT [API_KEY]
  push          sync v1, check the served output equals the merged reference; a step; sync v2, check again.
  push-moe      the same with a Qwen3-MoE checkpoint and LoRA on all linear layers (experts and router included).
  server-down   the server is not there: every rank raises at once.
  unknown-name  a renamed parameter: rank 0 raises CheckpointMismatchError, rank 1 StreamAbortedError; nothing sent.
  die-mid       rank 0 dies in the middle of the transfer (the test then checks the server).
  hold-mid      pause in the middle of the transfer (the test stops the server meanwhile): every rank raises.
  no-key        the server has --api-key and the sink has none: every rank raises.
  server-error  the server answers an error (an update is already in progress): every rank raises.
  tied-mts      modules_to_save=["lm_head"] on a tied checkpoint: refused by rank 0's pre-flight, nothing sent.
  drop-shard    k_proj of layer 0 renamed to a name vLLM ignores (pre-flight off): the server's consumption check
                names it and the incomplete qkv_proj on every rank.
  faults        after a sync at v1, a failure on rank 1 only at each transaction point: every rank raises, the
                server serves exactly v1's outputs and reports v1; then v2 syncs and is served.
  traffic       a client generates continuously while three syncs run (a step between them): every response
                equals one version's output, never a mix.

Every outcome is printed as one RESULT {json} line: {"rank", "outcome": "ok"|"raised", "error", "message", ...}.
"""

from __future__ import annotations

import copy
import os
import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    ZERO3_CONFIG,
    assert_vllm_serves,
    fail_on_rank_1,
    finish,
    lora,
    perturb_adapters,
    report,
    server_generate,
    zero3_whole_into,
)

from lora_stream import LoraStreamError, ParamStream, StreamAbortedError, VLLMServerSink

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
DS = ZERO3_CONFIG


def reference(engine, template: torch.nn.Module) -> torch.nn.Module:  # type: ignore[no-untyped-def]
    return copy.deepcopy(zero3_whole_into(engine, template)).float().merge_and_unload()


class Interrupted(ParamStream):
    """Calls ``action`` on one rank when the third group is produced (the middle of the transfer)."""

    action = None
    on_rank = 0

    def iter_groups(self):  # type: ignore[no-untyped-def,override]
        for i, batch in enumerate(super().iter_groups()):
            if i == 2 and dist.get_rank() == self.on_rank and self.action is not None:
                self.action()
            yield batch


def main() -> None:
    from transformers import AutoModelForCausalLM

    scenario, url, ckpt = sys.argv[1], sys.argv[2], sys.argv[3]
    api_key = sys.argv[4] if len(sys.argv) > 4 else None
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    saved = ["lm_head"] if scenario == "tied-mts" else None
    # merge="engine" into the MoE server: LoRA on the fused experts too (peft's target_parameters).
    experts = {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    pm = lora(
        AutoModelForCausalLM.from_pretrained(ckpt),
        target_modules="all-linear",
        lora_alpha=16,
        modules_to_save=saved,
        **(experts if scenario == "push-moe-engine" else {}),
    )
    if scenario == "push-moe-engine":
        perturb_adapters(pm)
    template = copy.deepcopy(pm)
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.5)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS)
    sink = VLLMServerSink(url, rank=rank, api_key=api_key, timeout=30)
    start = time.monotonic()
    if scenario == "faults":
        faults(rank, url, engine, template, sink)
        finish()
    if scenario == "traffic":
        traffic(rank, url, engine, sink)
        finish()
    if scenario == "push-moe-engine":
        moe_engine_merge(rank, url, engine, api_key)
        finish()
    if scenario in ("push", "push-moe"):
        record = sink.sync(ParamStream(engine, group_by="layer"), version="v1")
        expected = reference(engine, template)  # a gather: every rank takes part
        first = server_generate(url, api_key) if rank == 0 else None
        if rank == 0:
            assert_vllm_serves(first, expected)
        ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        sink.sync(ParamStream(engine, group_by="layer"), version="v2")
        expected = reference(engine, template)
        if rank == 0:
            second = server_generate(url, api_key)
            assert second != first, "the step should change what the server serves"
            assert_vllm_serves(second, expected)
        if rank == 0:  # both sides timed their stages; the worker's came back through the trainer's store
            assert {"produce_s", "pack_s", "send_wait_s", "http_s"} <= set(record.stages), record.stages
            assert record.stages["worker"]["load_s"] > 0 and record.stages["worker"]["recv_wait_s"] >= 0, record.stages
        report(rank=rank, outcome="ok", tensors=record.tensors, streamed=len(ParamStream(engine)), version="v2")
        finish()
    k0 = "model.layers.0.self_attn.k_proj.weight"
    streams = {
        "unknown-name": lambda: ParamStream(engine, renames={"model.norm": "model.final_norm"}),
        "tied-mts": lambda: ParamStream(engine, group_by="layer"),
        "drop-shard": lambda: ParamStream(engine, group_by="layer", renames={k0: k0.replace(".weight", ".bias")}),
    }
    if scenario == "drop-shard":
        sink = VLLMServerSink(url, rank=rank, api_key=api_key, timeout=30, checkpoint=False)
    stream = streams.get(scenario, lambda: Interrupted(engine, group_by="layer"))()
    if scenario == "die-mid":
        Interrupted.action = staticmethod(lambda: os._exit(9))
    if scenario == "hold-mid":

        def hold() -> None:
            with open(os.environ["LORA_STREAM_TEST_MARKER"], "w") as f:
                f.write("holding")
            time.sleep(8)

        Interrupted.action = staticmethod(hold)
        Interrupted.on_rank = 1
    if scenario == "server-error" and rank == 0:
        sink.client.start_weight_update()  # leave an update open: the sync's own start is refused
    try:
        sink.sync(stream, version="never")
    except (LoraStreamError, StreamAbortedError) as exc:
        report(
            rank=rank,
            outcome="raised",
            error=type(exc).__name__,
            message=str(exc),
            seconds=time.monotonic() - start,
            stale=getattr(exc, "stale", None),
            incomplete=getattr(exc, "incomplete", None),
        )
        if scenario == "server-error" and rank == 0:
            sink.client.finish_weight_update()  # close the update this test left open
        finish(0)
    report(rank=rank, outcome="ok")
    finish(5)


def moe_engine_merge(rank: int, url: str, engine, api_key: str | None) -> None:  # type: ignore[no-untyped-def]
    """merge="engine" into the MoE server: the fused experts are merged and converted to one tensor per expert in
    the server's workers; after a step, only the inputs travel, and the server serves == what a trainer-side merged
    sync of the same weights serves."""
    sink = VLLMServerSink(url, rank=rank, api_key=api_key, timeout=30, merge="engine")
    trainer_side = VLLMServerSink(url, rank=rank, api_key=api_key, timeout=30, skip_unchanged=False)
    sink.sync(ParamStream(engine, group_by="layer"), version="e1")
    _step(engine)
    partial = sink.sync(ParamStream(engine, group_by="layer"), version="e2")
    served = server_generate(url, api_key) if rank == 0 else None
    trainer_side.sync(ParamStream(engine, group_by="layer"), version="e2-trainer")
    equal = server_generate(url, api_key) == served if rank == 0 else None
    report(rank=rank, outcome="ok", equal=equal, full_because=partial.full_because, sent_bytes=partial.bytes)


def _step(engine) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor([[1, 17, 42, 99, 5, 7, 300]])
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def faults(rank: int, url: str, engine, template, sink) -> None:  # type: ignore[no-untyped-def]
    from lora_stream.testing import FAULT_POINTS, set_fault_hook

    sink.sync(ParamStream(engine, group_by="layer"), version="v1")
    before = server_generate(url) if rank == 0 else None
    _step(engine)
    # The server route's point after the vote to commit, once every server recorded the decision and before the
    # vote that they all did: a failure there still rolls every server back (the holder withdraws the decision).
    for point in (*FAULT_POINTS, "decision-recorded"):
        point = point.replace("<k>", "1")
        if point == "verify":
            continue  # the server sink has no verification yet (docs/guarantees.md)

        set_fault_hook(fail_on_rank_1(point, rank))
        t = time.monotonic()
        try:
            sink.sync(ParamStream(engine, group_by="layer"), version="v2")
            raise AssertionError(f"the sync should have raised at {point}")
        except (RuntimeError, StreamAbortedError) as exc:
            error = exc
        finally:
            set_fault_hook(None)
        equal = version = None
        if rank == 0:
            equal = server_generate(url) == before
            version = sink.client.weight_version()
        report(
            rank=rank,
            event="fault",
            point=point,
            error=type(error).__name__,
            message=str(error)[:300],
            failed_ranks=list(getattr(error, "failed_ranks", ())),
            equal=equal,
            version=version,
            seconds=time.monotonic() - t,
        )
    sink.sync(ParamStream(engine, group_by="layer"), version="v2")
    expected = reference(engine, template)
    if rank == 0:
        after = server_generate(url)
        assert after != before
        assert_vllm_serves(after, expected)
    report(rank=rank, outcome="ok", event="recovered")


def traffic(rank: int, url: str, engine, sink) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 runs a client that generates without pause during three syncs; the outputs of each version are taken
    while nothing else runs. Every response must be one of them."""
    import threading

    import requests
    from helpers import PROMPTS, greedy_completion

    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] if rank == 0 else None
    prompt = PROMPTS[1]

    def once() -> tuple[tuple[int, ...], tuple[float, ...]]:
        return greedy_completion(url, prompt, max_tokens=24, model=model)

    seen: list[tuple[tuple[int, ...], tuple[float, ...]]] = []
    failures: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                seen.append(once())
            except Exception as exc:  # an aborted request is allowed; a wrong one is not
                failures.append(repr(exc))

    versions = []
    sink.sync(ParamStream(engine, group_by="layer"), version="v0")
    if rank == 0:
        versions.append(once())
    thread = threading.Thread(target=client, daemon=True)
    if rank == 0:
        thread.start()
    for v in ("v1", "v2", "v3"):
        _step(engine)
        sink.sync(ParamStream(engine, group_by="module"), version=v)
        if rank == 0:
            time.sleep(0.5)  # let the client finish requests on this version too
            stop.set()
            thread.join()
            versions.append(once())
            stop.clear()
            thread = threading.Thread(target=client, daemon=True)
            thread.start()
    if rank == 0:
        stop.set()
        thread.join()
        distinct = len(set(versions))
        mixed = [s for s in seen if s not in versions]
        report(
            rank=rank, event="traffic", responses=len(seen), versions=distinct, mixed=len(mixed), failures=failures[:3]
        )
    report(rank=rank, outcome="ok")


if __name__ == "__main__":
    main()
