"""Rank worker: 2 sharded ranks (ZeRO-3 or FSDP2) keep a vLLM server in sync sending only what changed.

Usage: skip_sync.py GATHERER TARGETS BASE_URL CHECKPOINT MARKERS [restart]
  GATHERER  zero3 | fsdp2
  TARGETS   all (LoRA on every linear layer) | attn (q, k, v, o only: the MLP is frozen) | qv (q and v only: vLLM's
            fused qkv_proj needs k too)

Every sync's record is reported as {"event": "sync", "label", "tensors", "skipped", "gathered", "full_because"}; the
served output after a partial sync is compared with what the same weights serve after a full sync by another sink
({"event": "equal", "label", "equal"}). With ``restart``, rank 0 asks the test to restart the server at the same
address (MARKERS/restart -> MARKERS/restarted) before the last sync.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from helpers import (
    ZERO3_CONFIG,
    finish,
    lora,
    own_elements,
    perturb_adapters,
    report,
    report_sync,
    server_generate,
    train_sharded,
)

from lora_stream import ParamStream, StreamAbortedError, VLLMServerSink
from lora_stream.testing import set_fault_hook

deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
#: ``attn`` runs with DeepSpeed's default ``stage3_param_persistence_threshold`` (every parameter of this tiny model
#: is then kept whole on every rank, as norms and biases are in a real one: the gather reads ``.data``, not the
#: partition); ``all`` with 0 (every parameter partitioned).
DS = ZERO3_CONFIG
DS_DEFAULT_PERSISTENCE = {**DS, "zero_optimization": {"stage": 3}}
TARGETS = {"all": "all-linear", "attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "qv": ["q_proj", "v_proj"]}


def build(gatherer: str, targets: str, ckpt: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    pm = lora(AutoModelForCausalLM.from_pretrained(ckpt), target_modules=TARGETS[targets], lora_alpha=16)
    perturb_adapters(pm)  # random factors everywhere: peft's initial B = 0 would make a wrong merge look right
    return train_sharded(
        pm,
        gatherer,
        lambda ps: torch.optim.SGD(ps, lr=0.5),
        ds_config=DS_DEFAULT_PERSISTENCE if targets == "attn" else DS,
        shard=tuple(f"layers.{i}" for i in range(8)),
    )


def _sign_flip(t: torch.Tensor) -> None:
    """A structured edit: every odd element negated. Sign bits change in pairs in every 64-bit word's top bit (two
    float32 elements to a word): a linear fingerprint cancels them and calls the weight unchanged."""
    t.view(-1)[1::2].neg_()


def edit_frozen_on_rank_1(model: torch.nn.Module, targets: str) -> str:
    """Edit one frozen weight in place by a sign flip (through ``.data``: no version counter moves): rank 1's own
    shard where it is sharded, or the whole tensor on every rank where ZeRO-3 keeps it whole (a persistent
    parameter: the gather reads ``.data``, which is not the partition the fingerprint used to read)."""
    name = "model.norm.weight" if targets == "all" else "model.layers.1.mlp.down_proj.weight"
    p = dict(model.named_parameters())[f"base_model.model.{name}"]
    assert not p.requires_grad
    with torch.no_grad():
        if getattr(p, "ds_persist", False):
            _sign_flip(p.data)
        elif dist.get_rank() == 1:
            _sign_flip(own_elements(p))
    return name


def reparametrize(model: torch.nn.Module) -> None:
    """A function-preserving edit: negate row 1 of layer 0's v_proj (base, under LoRA on q and v) and the o_proj
    columns that read it (one per query head sharing the KV head). The served model must be the trainer's: v_proj
    travels (it has an adapter), and o_proj must travel with it though only sign bits of two columns changed."""
    params = dict(model.named_parameters())
    attn = "base_model.model.model.layers.0.self_attn"
    v = params[f"{attn}.v_proj.base_layer.weight"]
    o = params[f"{attn}.o_proj.weight"]
    head_dim = 32
    columns = [1 + h * head_dim for h in range(o.shape[1] // head_dim)]  # DTensor shapes are global
    with torch.no_grad():
        for p, edit in ((v, "row"), (o, "columns")):
            local = p.to_local() if hasattr(p, "to_local") else p.data
            offset = dist.get_rank() * -(-p.shape[0] // dist.get_world_size()) if hasattr(p, "to_local") else 0
            if edit == "row":
                if offset <= 1 < offset + local.shape[0]:
                    local[1 - offset].neg_()
            else:
                for column in columns:
                    local[:, column].neg_()


def only_the_holder_writes(sync, url: str, rank: int) -> None:  # type: ignore[no-untyped-def]
    """While a sync holds the server (paused, its update loaded, before the vote), from outside: a plain client's
    ``GET /v1/models`` with made-up lease headers runs and touches nothing (before, it healed the live update); an
    operator's ``/resume`` without the sync's headers is refused with 409 naming the holder (before, it served the
    uncommitted update); so are ``/weight_checker``'s reset (it zeroed every parameter under the committed version)
    and ``/api/finish_weight_update`` behind the server's ``--root-path /api`` (it finished the uncommitted update).
    The sync then commits."""
    import requests

    from lora_stream.engine.lease_terms import LEASE_HEADER, SYNC_HEADER

    seen: dict[str, object] = {}

    def hook(point: str) -> None:
        if rank == 0 and point == "prefix-cache":
            forged = {SYNC_HEADER: "someone-else-" + "0" * 40, LEASE_HEADER: "1"}
            seen["models"] = requests.get(f"{url}/v1/models", headers=forged, timeout=30).status_code
            resumed = requests.post(f"{url}/resume", timeout=30)
            seen["resume"] = (resumed.status_code, resumed.text[:300])
            seen["paused"] = requests.get(f"{url}/is_paused", timeout=30).json()["is_paused"]
            # vLLM 0.31 has no /weight_checker (0.32 added it): there the request reaches no route at all.
            paths = requests.get(f"{url}/openapi.json", timeout=30).json()["paths"]
            seen["has_weight_checker"] = "/weight_checker" in paths
            reset = requests.post(f"{url}/weight_checker", json={"action": "reset"}, timeout=30)
            seen["weight_checker"] = (reset.status_code, reset.text[:300])
            finish = requests.post(f"{url}/api/finish_weight_update", json={"weight_version": "x"}, timeout=30)
            seen["prefixed_finish"] = (finish.status_code, finish.text[:300])
            status = requests.get(f"{url}/api/lora_stream/lease", timeout=30).json()
            seen["prefixed_status"] = {"holding": status["holding"]}
            seen["unclassified"] = status["unclassified_routes"]

    set_fault_hook(hook)
    try:
        sync("v5-held")
    finally:
        set_fault_hook(None)
    if rank == 0:
        report(rank=rank, event="held", **seen)


def a_commit_rolls_forward(trainer, url: str, rank: int, step, same_as_full) -> None:  # type: ignore[no-untyped-def]
    """The feeding rank stopped (SIGSTOP, as a GC pause or a preemption would) after the server answered the commit
    and before ``/finish_weight_update``, for longer than the lease: the server's lease finishes the committed update
    with its version (it used to "roll back" nothing and finish without a version: new weights under the old
    label), and the late finish is answered as committed: the sync commits, ``/weight_info`` says so, and the server
    serves exactly what a full sync of the same weights serves."""
    import os
    import signal
    import subprocess

    from lora_stream.sinks.vllm_server import VLLMServerClient

    step()
    short = VLLMServerSink(url, rank=rank, timeout=30, skip_unchanged=False, lease=2)
    finish = VLLMServerClient.finish_weight_update
    stopped: list[float] = []

    def stopping(self, weight_version=None):  # type: ignore[no-untyped-def]
        if not stopped:
            t = time.monotonic()
            subprocess.Popen(["sh", "-c", f"sleep 6; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
            stopped.append(time.monotonic() - t)
        return finish(self, weight_version)

    VLLMServerClient.finish_weight_update = stopping  # type: ignore[method-assign]
    try:
        record = short.sync(ParamStream(trainer, group_by="layer"), version="v5-forward")
        outcome = {"committed": True, "version": record.version}
    except Exception as exc:
        outcome = {"committed": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        VLLMServerClient.finish_weight_update = finish  # type: ignore[method-assign]
    if rank == 0:
        import requests

        info = requests.get(f"{url}/weight_info", timeout=30).json()["weight_version"]
        lease = requests.get(f"{url}/lora_stream/lease", timeout=30).json()
        heal = lease["last_heal"]
        report(rank=rank, event="forward", stopped=stopped, served_version=info, last_heal=heal, **outcome)
    same_as_full("v5-forward")


def main() -> None:
    gatherer, targets, url, ckpt, markers = sys.argv[1:6]
    restart = "restart" in sys.argv[6:]
    if gatherer == "zero3":
        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainer, model, step = build(gatherer, targets, ckpt)
    sink = VLLMServerSink(url, rank=rank, timeout=30, skip_unchanged=True)
    full = VLLMServerSink(url, rank=rank, timeout=30, skip_unchanged=False)

    def sync(label: str, into: VLLMServerSink = sink) -> None:
        report_sync(rank, label, into.sync(ParamStream(trainer, group_by="layer"), version=label))

    def same_as_full(label: str) -> None:
        """What the partial sync serves, against what a full sync of the same weights serves."""
        partial = server_generate(url) if rank == 0 else None
        sync(f"{label}-full", full)
        if rank == 0:
            report(rank=rank, event="equal", label=label, equal=server_generate(url) == partial)

    # A step before the first sync, as in training: ZeRO-3 keeps a persistent parameter whole from its first forward
    # on, and from then on fingerprints its whole .data too (what the gather then reads).
    step()
    sync("v1")  # a fresh server: everything
    step()
    sync("v2")  # the adapter moved: only the outputs it changes (and their fused neighbours)
    same_as_full("v2")
    sync("v3")  # the full sink wrote the server meanwhile: everything again
    step()
    edited = edit_frozen_on_rank_1(model, targets)
    sync("v4")  # the edited frozen weight goes too
    report(rank=rank, event="edited", name=edited)
    same_as_full("v4")
    sync("v5")
    if targets == "qv":
        step()
        reparametrize(model)
        sync("v5-reparametrized")  # v_proj (adapted) and o_proj (frozen, two columns' sign bits) both travel
        same_as_full("v5-reparametrized")
        sync("v5")
    if gatherer == "fsdp2" and targets == "qv":  # a case CI runs (fsdp2-all is in the matrix only)
        only_the_holder_writes(sync, url, rank)
        a_commit_rolls_forward(trainer, url, rank, step, same_as_full)
    step()
    before = server_generate(url) if rank == 0 else None

    def hook(p: str) -> None:
        if rank == 1 and p == "reload-check":
            raise RuntimeError("injected failure at reload-check on rank 1")

    set_fault_hook(hook)
    t = time.monotonic()
    try:
        sync("v6-fails")
        raise AssertionError("the sync should have raised")
    except (RuntimeError, StreamAbortedError) as exc:
        error = type(exc).__name__
    finally:
        set_fault_hook(None)
    if rank == 0:
        report(
            rank=rank, event="fault", error=error, equal=server_generate(url) == before, seconds=time.monotonic() - t
        )
    sync("v6")  # after a failed (rolled-back) sync: everything
    step()
    sync("v7")
    if restart:
        if rank == 0:
            (Path(markers) / "restart").write_text("1")
            while not (Path(markers) / "restarted").exists():
                time.sleep(0.2)
        dist.barrier()
        sync("v8")  # the same address, a new server: everything, and it serves the merged model
        served = server_generate(url) if rank == 0 else None
        sync("v8-full", full)
        if rank == 0:
            report(rank=rank, event="equal", label="v8", equal=server_generate(url) == served)
    finish()


if __name__ == "__main__":
    main()
