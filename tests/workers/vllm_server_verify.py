"""Rank worker: ``verify=`` on a vLLM server and on a fleet of two, with corrupted syncs, from 2 trainer ranks.

Usage: vllm_server_verify.py URL_A URL_B CHECKPOINT   (both servers serve CHECKPOINT in bfloat16)

Each rank holds the whole LoRA model (replicated, as under DDP). Corruption is injected into the bytes one server
receives (``sender._start`` patched on the rank that feeds it): a module's delta doubled, or dropped, or the
previous sync's chunks sent again (the load "skipped"). In order:
  server (A, fed by rank 0):  v1 correct; double; drop (both fail, A keeps v1 and its outputs); a small step sent
                              stale (fails on "it changed"); v2 correct.
  fleet (A by rank 0, B by rank 1): a probe the workers cannot run (fails, nothing changes);
                              v3 correct; double on B only; a small step, stale on B only; one element of B
                              nudged below the probe's tolerance (the servers' digests differ); v4 correct.
Every outcome is one RESULT {json} line, with the servers' versions and whether their outputs equal the last
committed version's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from helpers import finish, lora, perturb_adapters, report, server_generate
from transformers import AutoModelForCausalLM

import lora_stream.sinks.vllm_server as vllm_server
import lora_stream.transfer.sender as sender
from lora_stream import ParamStream, VLLMServerSink
from lora_stream.sinks.verify import probe_ids, tolerance, trainer_logprobs

TARGET = "model.layers.0.self_attn.q_proj.weight"


class Tamper:
    """Rewrites what one server receives. ``sent[url]``: the payloads each server got in the latest sync."""

    def __init__(self) -> None:
        self.mode: str | None = None
        self.victim: str | None = None
        self.sink: Any = None
        self.needle = b""
        self.replacement = b""
        self.sent: dict[str, list[torch.Tensor]] = {}
        self.previous: dict[str, list[torch.Tensor]] = {}
        self.count: dict[str, int] = {}
        self.hits = 0
        self._start = sender._start
        sender._start = self.start  # type: ignore[assignment]

    def begin(self, mode: str | None, victim: str | None, model: Any = None) -> None:
        self.mode, self.victim, self.hits = mode, victim, 0
        self.previous, self.sent, self.count = self.sent, {}, {}
        if mode in ("double", "drop", "nudge"):
            merged = dict(ParamStream(model))[TARGET]
            base = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach()
            if mode == "nudge":  # one element off by a few bf16 roundings: below any probe's tolerance
                bad = merged.clone()
                bad[0, 0] *= 1 + 2.0**-5
            else:
                bad = base if mode == "drop" else 2 * merged - base
            self.needle = merged.contiguous().view(torch.uint8).numpy().tobytes()
            self.replacement = bad.to(merged.dtype).contiguous().view(torch.uint8).numpy().tobytes()

    def _url(self, group: Any) -> str:
        for r in self.sink.replicas:
            if r.engine is not None and r.engine.group is group:
                return str(r.url)
        return "?"

    def start(self, group: Any, payload: torch.Tensor) -> Any:
        url = self._url(group)
        k = self.count.get(url, 0)
        self.count[url] = k + 1
        self.sent.setdefault(url, []).append(payload.clone())
        if url == self.victim and self.mode == "stale":
            old = self.previous.get(url, [])
            if k < len(old) and old[k].numel() == payload.numel():
                payload = old[k].clone()
                self.hits += 1
        elif url == self.victim and self.mode in ("double", "drop", "nudge"):
            data = payload.numpy().tobytes()
            at = data.find(self.needle)
            if at >= 0:
                data = data[:at] + self.replacement + data[at + len(self.replacement) :]
                payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                self.hits += 1
        return self._start(group, payload)


def small_step(model: Any, ids: list[int], low: float, high: float) -> float:
    """Move the adapter until the trainer's probe moves by between ``low`` and ``high`` nats (a bisection over the
    step's size, in log space); returns the move."""
    before, _ = trainer_logprobs(model, ids)
    factors = [p for n, p in model.named_parameters() if "lora_B" in n]
    saved = [p.detach().clone() for p in factors]
    gen = torch.Generator().manual_seed(7)
    noise = [torch.randn(p.shape, generator=gen) for p in factors]
    small, large = 1e-6, 1.0
    for _ in range(40):
        size = (small * large) ** 0.5
        with torch.no_grad():
            for p, s, n in zip(factors, saved, noise):
                p.copy_(s + size * n)
        moved = float((trainer_logprobs(model, ids)[0] - before).abs().max())
        if low <= moved <= high:
            return moved
        small, large = (size, large) if moved < low else (small, size)
    raise AssertionError("no step size moved the probe into the window")


def main() -> None:
    url_a, url_b, checkpoint = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = lora(
        AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32), target_modules="all-linear"
    )
    perturb_adapters(model, seed=11)
    ids = probe_ids(1000)
    _, scale = trainer_logprobs(model, ids)
    limit = tolerance(torch.bfloat16, torch.float32, 2, scale)
    resolution = 2.0**-8 * scale
    tamper = Tamper()
    committed: dict[str, Any] = {}

    def served(url: str) -> Any:
        return server_generate(url) if rank == 0 else None

    def sync(sink: VLLMServerSink, name: str, version: str, mode: str | None = None, victim: str | None = None) -> None:
        tamper.sink = sink
        tamper.begin(mode, victim, model)
        urls = sink.urls
        try:
            record = sink.sync(ParamStream(model), version=version)
            v = record.verification
            outcome: dict[str, Any] = {
                "outcome": "ok",
                "max_abs_diff": None if v is None else v.max_abs_diff,
                "tolerance": None if v is None else v.tolerance,
                "stages": None if v is None else v.stages,
                "kept_bytes": record.stages.get("worker", {}).get("kept_bytes"),
            }
            for u in urls:
                committed[u] = served(u)
        except Exception as exc:
            outcome = {"outcome": "raised", "error": type(exc).__name__, "message": str(exc)[:600]}
        dist.barrier()
        versions = {u: _version(u) for u in urls}
        same = {u: served(u) == committed.get(u) for u in urls} if rank == 0 else None
        report(rank=rank, event=name, hits=tamper.hits, versions=versions, outputs_unchanged=same, **outcome)

    # skip_unchanged=False: the "stale" corruption replays the previous sync's chunks, which needs every sync to send
    # the same chunks (after a failed partial sync the next one is full, and nothing would be replayed). Verification
    # of partial syncs: tests/test_vllm_colocated.py and tests/test_vllm_colocated_dist.py.
    server = VLLMServerSink([url_a], rank=rank, timeout=60, verify=True, skip_unchanged=False)
    sync(server, "server-v1", "v1")
    sync(server, "server-double", "x1", "double", url_a)
    sync(server, "server-drop", "x2", "drop", url_a)
    moved = small_step(model, ids, 2 * resolution, limit / 2)
    report(rank=rank, event="small-step", moved=moved, resolution=resolution, tolerance=limit)
    sync(server, "server-stale", "x3", "stale", url_a)
    sync(server, "server-v2", "v2")
    server.close()

    fleet = VLLMServerSink([url_a, url_b], rank=rank, timeout=60, verify=True, skip_unchanged=False)
    # A probe the workers cannot run (token ids beyond the vocabulary): each reports the error instead of raising
    # (an error would end vLLM's update session with the update still loaded), and the sync rolls back.
    client_cls = vllm_server.VLLMServerClient
    real_update = client_cls.update_weights

    def beyond_vocabulary(self: Any, update_info: dict[str, Any]) -> None:
        if update_info.get("command") == "verify":
            update_info = {**update_info, "probe_ids": [5000] * 16}
        real_update(self, update_info)

    client_cls.update_weights = beyond_vocabulary  # type: ignore[method-assign]
    versions_before = {u: _version(u) for u in fleet.urls}
    committed[url_b] = served(url_b)  # B serves its checkpoint so far
    sync(fleet, "fleet-probe-error", "x0")
    report(rank=rank, event="versions-before-probe-error", versions=versions_before)
    client_cls.update_weights = real_update  # type: ignore[method-assign]
    sync(fleet, "fleet-v3", "v3")
    sync(fleet, "fleet-double", "x4", "double", url_b)
    moved = small_step(model, ids, 2 * resolution, limit / 2)
    report(rank=rank, event="small-step-2", moved=moved, resolution=resolution, tolerance=limit)
    sync(fleet, "fleet-stale", "x5", "stale", url_b)
    sync(fleet, "fleet-nudge", "x6", "nudge", url_b)
    sync(fleet, "fleet-v4", "v4")
    fleet.close()
    finish(0)


def _version(url: str) -> Any:
    import requests

    return requests.get(f"{url}/weight_info", timeout=10).json()["weight_version"]


if __name__ == "__main__":
    main()
