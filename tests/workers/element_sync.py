"""Rank worker: 2 sharded ranks (ZeRO-3 or FSDP2) fully fine-tune a model and keep vLLM servers in sync with element
syncs (``VLLMServerSink(elements=True)``): each rank sends the elements of its own shard that changed, nothing is
gathered, and every server serves exactly what a full sync of the same weights serves.

Usage: element_sync.py GATHERER CHECKPOINT URLS [faults]
  GATHERER  zero3 | fsdp2
  URLS      one server URL, or several joined by "," (a fleet)

Reports {"event": "sync", "label", "tensors", "gathered", "full_because", "elements", "kept", ...} per sync,
{"event": "equal", "label", "equal"} where what an element sync serves is compared (==, greedy tokens and logprobs)
with what a full sync of the same weights serves on every server, and with ``faults`` {"event": "fault", "point",
"equal", "version", "error", "pauses", "resets", "during"} for a failure on rank 1 only at every fault point of an
element sync ("staged" included: the servers received the payload and are not paused yet; ``during``: what the first
server said and served at that point; ``pauses`` and ``resets``: the /pause and /reset_prefix_cache requests the
failed sync sent).
"""

from __future__ import annotations

import sys
import time

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    edit_a_few,
    fail_on_rank_1,
    finish,
    own_elements,
    report,
    report_sync,
    server_generate,
    train_sharded,
)

from lora_stream import ParamStream, StreamAbortedError, VLLMServerSink
from lora_stream.testing import FAULT_POINTS, set_fault_hook

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
#: The weights the structured edits touch: an attention projection (vLLM fuses q, k and v: k and v travel along,
#: rebuilt from the engine's copy with no element changed), an MLP weight, and the embedding.
EDITED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "model.embed_tokens.weight")


def build(gatherer: str, ckpt: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt)  # full fine-tuning: every weight trains
    return train_sharded(model, gatherer, lambda ps: torch.optim.AdamW(ps, lr=1e-5), shard=("layers.0", "layers.1"))


def edit(model: torch.nn.Module, seed: int, ranks: tuple[int, ...]) -> None:
    """Structured edits of a few elements of this rank's own shard of each weight in :data:`EDITED`
    (``helpers.edit_a_few``), on the ranks in ``ranks``."""
    if dist.get_rank() not in ranks:
        return
    g = torch.Generator().manual_seed(seed * 10 + dist.get_rank())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in EDITED:
            edit_a_few(own_elements(params[name]), g)


def main() -> None:
    gatherer, ckpt, urls_arg = sys.argv[1:4]
    faults = "faults" in sys.argv[4:]
    urls = urls_arg.split(",")
    if gatherer == "zero3":
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer, model, step = build(gatherer, ckpt)
    sink = VLLMServerSink(urls, rank=rank, timeout=30, elements=True)
    full = VLLMServerSink(urls, rank=rank, timeout=30, skip_unchanged=False)

    def sync(label: str, into: VLLMServerSink = sink) -> None:
        r = into.sync(ParamStream(trainer, group_by="layer"), version=label)
        copy_bytes = dict(r.stages.get("worker") or {}).get("element_copy_bytes")
        report_sync(rank, label, r, copy_bytes=copy_bytes, line=r.summary(), metrics=r.metrics())

    def served() -> list | None:  # type: ignore[type-arg]
        return [server_generate(u) for u in urls] if rank == 0 else None

    def same_as_full(label: str) -> None:
        """What the element sync serves, against what a full sync of the same weights serves (on every server)."""
        mine = served()
        sync(f"{label}-full", full)
        if rank == 0:
            report(rank=rank, event="equal", label=label, equal=served() == mine)

    step()
    sync("v1")  # fresh servers: everything, and the engines keep a copy of what they loaded
    edit(model, 1, (1,))
    sync("v2")  # rank 1's few edited elements, and nothing gathered
    same_as_full("v2")
    sync("v3")  # the full sink wrote the servers: everything again
    edit(model, 2, (0, 1))
    sync("v4")
    same_as_full("v4")
    sync("v5")
    step()  # AdamW moves every float32 element: elements would cost more than the tensors
    sync("v6")
    if len(urls) > 1:
        # A fleet fed by rank 0 alone: its servers receive the payload, and then load it, at once.
        one = VLLMServerSink(urls, rank=rank, timeout=30, elements=True, spread=False)
        sync("one-v1", one)
        edit(model, 6, (0, 1))
        sync("one-v2", one)
        same_as_full("one-v2")
    if faults:
        from lora_stream.sinks.server_client import VLLMServerClient

        # Every /pause and /reset_prefix_cache this process sends: a failure before the servers are paused must send
        # neither (nothing their prefix caches were computed with changed).
        pauses: list[str] = []
        resets: list[str] = []
        pause, reset = VLLMServerClient.pause, VLLMServerClient.reset_prefix_cache

        def counted(self: VLLMServerClient, mode: str) -> None:
            pauses.append(self.url)
            pause(self, mode)

        def counted_reset(self: VLLMServerClient) -> bool:
            resets.append(self.url)
            return reset(self)

        VLLMServerClient.pause = counted  # type: ignore[method-assign]
        VLLMServerClient.reset_prefix_cache = counted_reset  # type: ignore[method-assign]
        points = [p for p in FAULT_POINTS if p not in ("group:<k>", "verify")] + ["group:0", "decision-recorded"]
        for point in [*points, "staged"]:
            sync(f"{point}-base")  # after a failed sync: everything
            edit(model, 3, (0, 1))
            sync(f"{point}-elements")  # the baseline and the engines' copy of that sync
            edit(model, 4, (1,))
            before = served()

            during: dict[str, object] = {}
            failing = fail_on_rank_1(point, rank)

            def hook(p: str, failing=failing, during=during, before=before) -> None:  # type: ignore[no-untyped-def]
                if p == "staged" and rank == 0:
                    # The payload is on the servers, decoded and checked; they are held (their update session is
                    # open) and not paused: generation goes on.
                    import requests

                    status = requests.get(f"{urls[0]}/lora_stream/lease", timeout=30).json()
                    during.update(paused=status["paused"], session=status["session"])
                    during["generated"] = served() == before
                failing(p)

            set_fault_hook(hook)
            paused_before, reset_before = len(pauses), len(resets)
            t = time.monotonic()
            try:
                sync(f"{point}-fails")
                raise AssertionError("the sync should have raised")
            except (RuntimeError, StreamAbortedError) as exc:
                error = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                set_fault_hook(None)
            if rank == 0:
                import requests

                version = requests.get(f"{urls[0]}/weight_info", timeout=30).json()["weight_version"]
                report(
                    rank=rank,
                    event="fault",
                    point=point,
                    error=error,
                    equal=served() == before,
                    version=version,
                    seconds=time.monotonic() - t,
                    pauses=len(pauses) - paused_before,
                    resets=len(resets) - reset_before,
                    during=during,
                )
        sync("after-faults")
        edit(model, 5, (0, 1))
        sync("after-faults-elements")
        same_as_full("after-faults-elements")
    finish()


if __name__ == "__main__":
    main()
