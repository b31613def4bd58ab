"""A cost model of one lora_stream sync: time per stage, bytes gathered and sent, peak memory per rank.

    python benchmarks/cost_model.py                  # tables: calibration, validation, projections
    python benchmarks/cost_model.py --calibration benchmarks/results/calibration.json

What it predicts, from a model's shapes (dense or MoE), the trainer's sharding (ZeRO-3, FSDP2, DDP) and world
size, the dtypes, the LoRA rank (merged sync or adapter sync), the number of inference replicas and a set of rates
(:class:`Rates`: all-gather bus bandwidth and per-collective latency, trainer -> engine send bandwidth, merge
throughput, the engine's load throughput, ...):

* the sync's time, per stage (status exchanges, gathers, merges, copies, send, engine load, fixed costs);
* bytes gathered per rank (received over the trainer's collectives) and bytes sent to the engines;
* peak memory per rank: the gather buffer (the largest group; two with ``prefetch``), the largest output tensor,
  the merge workspace, and on CPU the freed memory the heap holds before a ``malloc_trim`` (``Setup.trim_policy``).

The equations are in ``docs/performance.md``. Rates come from three places, kept apart in every table:

* **measured here**: ``benchmarks/calibrate.py`` (probes on this 2-core CPU machine, gloo), or the floors a
  benchmark measured in the same run;
* **taken from the benchmarks' stage timings**: vLLM's own load (``bench_server.py``'s worker ``load_s``) and the
  HTTP round trips (``http_s``), which no probe can reproduce without vLLM;
* **assumed for GPUs** (:data:`GPU_PROFILES`): NVIDIA's published NVLink / InfiniBand figures and nccl-tests-style
  bus bandwidths, HBM bandwidth for the merge, kernel-dispatch costs. Nothing here has been measured on a GPU;
  ``benchmarks/gpu_check.py`` measures the merge throughput, the peak memory and the FSDP2 path on one.

``main`` validates the model against the benchmarks' JSON under ``benchmarks/results/`` (whatever is there), then
projects Llama-3-8B/70B and Qwen3-30B-A3B/235B-A22B (shapes from their ``config.json``) onto H100/H200 nodes and
writes ``benchmarks/results/cost_model.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 2**20
GB = 1e9

Sharding = Literal["zero3", "fsdp2", "ddp"]
Mode = Literal["merged", "adapter", "engine"]
#: Modes whose trainer side gathers and sends only the LoRA factors ("engine": the server merges them onto its base).
FACTORS_ONLY = ("adapter", "engine")
Sink = Literal["destination", "colocated", "server"]

#: lora_stream's defaults the model mirrors (src/lora_stream/grouping.py, merge.py, stream.py).
DEFAULT_BUDGET_BYTES = 128 * MiB
MERGE_BLOCK_BYTES = 8 * MiB
#: ``release_memory``'s heap trim (stream.py, buffers.HeapTrimmer): after a group, ``malloc_trim`` once the process
#: has grown past this many largest groups since the pass started (``"growth"``, the library now: none in a steady
#: state); before that, once per ``TRIM_EVERY_BYTES`` released (``"every_64mib"``, what the published runs measured).
TRIM_BOUND_GROUPS = 1.5
TRIM_EVERY_BYTES = 64 * MiB
#: Parameters of at most this many whole bytes share one all-gather per group (gatherers/base.py: COALESCE_BYTES).
COALESCE_BYTES = 1 * MiB
#: The server sink's packing buffer per backend (src/lora_stream/sinks/vllm_server.py); two of them.
SERVER_BUFFER_BYTES = {"gloo": 1 * MiB, "nccl": 256 * MiB}


# --------------------------------------------------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shapes, as its ``config.json`` gives them.

    ``experts`` > 0 makes every layer from ``first_moe_layer`` on an MoE layer with a router and ``experts``
    experts of ``expert_intermediate`` (transformers >= 5 holds them fused: ``gate_up_proj [E, 2I, H]``,
    ``down_proj [E, H, I]``; checkpoints and vLLM hold three tensors per expert).
    """

    name: str
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int | None = None
    experts: int = 0
    expert_intermediate: int = 0
    first_moe_layer: int = 0
    tie_embeddings: bool = False
    qk_norm: bool = False
    source: str = ""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads


@dataclass(frozen=True)
class Unit:
    """One module as the stream plans it: a group never splits it.

    ``base`` is ``(rows, cols)`` of each base parameter (per expert for experts); ``lora`` marks a module LoRA
    targets (merged out of place); ``count`` is how many such parameters (experts: ``experts`` per fused tensor).
    """

    name: str
    layer: int | None
    params: tuple[tuple[int, int], ...]
    lora: bool = False
    experts: int = 0  # > 0: params are per-expert matrices, ``experts`` of each
    ckpt_tensors: int = 0  # tensors the checkpoint format (and vLLM's loader) sees for this unit

    def numel(self) -> int:
        return sum(r * c for r, c in self.params) * max(1, self.experts)


def units(shape: ModelShape, lora_experts: bool = False) -> list[Unit]:
    """The model's modules in registration order (Llama / Qwen3 / Qwen3-MoE layout)."""
    h, hd = shape.hidden, shape.hd
    out: list[Unit] = [Unit("embed_tokens", None, ((shape.vocab, h),), ckpt_tensors=1)]
    for i in range(shape.layers):
        q, kv = shape.heads * hd, shape.kv_heads * hd
        out += [
            Unit(f"{i}.q_proj", i, ((q, h),), lora=True, ckpt_tensors=1),
            Unit(f"{i}.k_proj", i, ((kv, h),), lora=True, ckpt_tensors=1),
            Unit(f"{i}.v_proj", i, ((kv, h),), lora=True, ckpt_tensors=1),
            Unit(f"{i}.o_proj", i, ((h, q),), lora=True, ckpt_tensors=1),
        ]
        if shape.qk_norm:
            out += [
                Unit(f"{i}.q_norm", i, ((1, hd),), ckpt_tensors=1),
                Unit(f"{i}.k_norm", i, ((1, hd),), ckpt_tensors=1),
            ]
        if shape.experts and i >= shape.first_moe_layer:
            e, ei = shape.experts, shape.expert_intermediate
            out += [
                Unit(f"{i}.router", i, ((e, h),), ckpt_tensors=1),
                Unit(f"{i}.experts", i, ((2 * ei, h), (h, ei)), lora=lora_experts, experts=e, ckpt_tensors=3 * e),
            ]
        else:
            f = shape.intermediate
            out += [
                Unit(f"{i}.gate_proj", i, ((f, h),), lora=True, ckpt_tensors=1),
                Unit(f"{i}.up_proj", i, ((f, h),), lora=True, ckpt_tensors=1),
                Unit(f"{i}.down_proj", i, ((h, f),), lora=True, ckpt_tensors=1),
            ]
        out += [
            Unit(f"{i}.input_layernorm", i, ((1, h),), ckpt_tensors=1),
            Unit(f"{i}.post_attention_layernorm", i, ((1, h),), ckpt_tensors=1),
        ]
    out.append(Unit("norm", None, ((1, h),), ckpt_tensors=1))
    if not shape.tie_embeddings:
        out.append(Unit("lm_head", None, ((shape.vocab, h),), ckpt_tensors=1))
    return out


def param_count(shape: ModelShape) -> int:
    return sum(u.numel() for u in units(shape))


# --------------------------------------------------------------------------------------------------------------------
# Rates
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Rates:
    """Bandwidths (bytes/s) and fixed costs (s) of one machine. ``kind="cpu"``: the stages run one after another on
    the host (what lora_stream does on CPU); ``kind="gpu"``: kernels run asynchronously, so a merge costs the larger
    of its GPU time and its CPU dispatch time."""

    name: str
    kind: Literal["cpu", "gpu"]
    ag_busbw: float  # all-gather bus bandwidth: t = lat + S (W-1)/W / busbw, S the gathered bytes
    ag_latency: float  # per all-gather call
    ar_latency: float  # the per-group status exchange (a small all_reduce)
    merge_bps: float  # merged output bytes per second, bf16 outputs
    merge_fp32_bps: float  # the same, float32 outputs
    per_merge: float  # fixed cost of one merged tensor (Python planning, factor casts, first block)
    per_block: float  # each further 8 MiB float32 block
    copy_bps: float  # a warm memory copy (bytes of the destination per second)
    send_bps: float  # trainer rank 0 -> engines (broadcast), bytes/s
    send_latency: float  # per broadcast chunk
    load_bps: float  # the engine's own load_weights, bytes it keeps per second (per TP worker)
    load_per_tensor: float  # the engine's per-tensor load cost (weight_loader dispatch)
    snapshot_bps: float  # the rollback's host copy of the engine's weights (per worker)
    fixed_server: float  # HTTP round trips of one server sync (start, update, finish, version)
    fixed_pause: float  # the two extra HTTP calls of pause / resume
    trim_s: float = 0.0  # one malloc_trim (CPU only)
    per_sync: float = (
        0.0  # t_sync: fixed cost of one merged pass (setting up the pass and its workspace, last exchange)
    )
    ag_busbw_inter: float | None = None  # when the trainer spans nodes
    ag_latency_inter: float | None = None
    gpus_per_node: int = 8
    sources: dict[str, str] = field(default_factory=dict[str, Any])


def rates_from_calibration(
    cal: dict[str, Any], server: dict[str, Any] | None = None, name: str = "this CPU machine"
) -> Rates:
    """This machine's rates from ``benchmarks/calibrate.py``'s JSON; the engine's load and the HTTP costs from
    ``bench_server.py``'s stage timings (``server``), or the figures recorded in docs/benchmarks.md without it."""
    load_s, http_s, load_bytes = 0.460, 0.143, 673_255_424.0  # docs/benchmarks.md, the server table (1 MiB buffer)
    src_load = "docs/benchmarks.md: bench_server worker load_s 0.460 s for 642 MiB float32"
    if server is not None:
        load_s = float(server["worker_stages_s"]["load_s"])
        http_s = float(server["trainer_stages_s"]["http_s"])
        load_bytes = float(server["bytes"])
        src_load = f"bench_server.py this run: worker load_s {load_s:.3f} s for {load_bytes / MiB:.0f} MiB"
    r = Rates(
        name=name,
        kind="cpu",
        ag_busbw=float(cal["all_gather_busbw_Bps"]),
        ag_latency=float(cal["all_gather_latency_s"]),
        ar_latency=float(cal["all_reduce_latency_s"]),
        merge_bps=float(cal["merge_bf16_Bps"]),
        merge_fp32_bps=float(cal["merge_fp32_Bps"]),
        per_merge=float(cal["per_merge_s"]),
        per_block=float(cal["merge_per_block_s"]),
        copy_bps=float(cal["copy_Bps"]),
        send_bps=float(cal["broadcast_bw_Bps"]),
        send_latency=float(cal["broadcast_latency_s"]),
        load_bps=load_bytes / load_s,
        load_per_tensor=0.0,
        snapshot_bps=float(cal["copy_Bps"]),
        fixed_server=http_s,
        fixed_pause=0.0,
        trim_s=float(cal["malloc_trim_s"]),
        gpus_per_node=2,
        sources={
            "all-gather, all-reduce, broadcast, merge, copy, malloc_trim": "measured: benchmarks/calibrate.py",
            "per sync": "fitted: the published depth sweep's intercept less the model's own (fit_per_sync)",
            "engine load": "stage timing: " + src_load,
            "HTTP round trips": "stage timing: bench_server trainer http_s",
        },
    )
    # No probe isolates the fixed cost of a pass: it comes from the published depth sweep (fit_per_sync).
    return dataclasses.replace(r, per_sync=fit_per_sync(published_rates(r)))


def with_floors(
    r: Rates,
    floors: dict[str, Any],
    gathered_bytes: float,
    params: int,
    merged_bytes: float,
    merges: int,
    blocks: int,
    copied_bytes: float,
    world: int = 2,
) -> Rates:
    """``r`` with the all-gather, merge and copy rates re-derived from a benchmark's own floors (same run, same
    process group), keeping the probe's latencies: the calibration the brief calls "the floors the benchmark prints"."""
    ag = float(floors["all_gather_s"]) - params * r.ag_latency
    merge = float(floors["merge_s"]) - merges * r.per_merge - max(0, blocks - merges) * r.per_block
    return dataclasses.replace(
        r,
        name=r.name + " (floors of the same run)",
        ag_busbw=gathered_bytes * (world - 1) / world / max(ag, 1e-6),
        merge_bps=merged_bytes / max(merge, 1e-6),
        copy_bps=copied_bytes / float(floors["copy_s"]),
        sources={**r.sources, "all-gather, merge, copy": "measured: bench_zero3 floors of the same run"},
    )


#: GPU rates: ASSUMED, not measured (no GPU here). Sources: NVIDIA DGX H100 / HGX H200 specifications (NVLink 4,
#: 900 GB/s bidirectional per GPU through NVSwitch; 8 x 400 Gb/s ConnectX-7 per node; HBM3 3.35 TB/s on H100 SXM,
#: HBM3e 4.8 TB/s on H200), and nccl-tests-style bus bandwidths for 8 GPUs on NVLink 4 (all-gather ~350-480 GB/s
#: at large messages; we take 360 GB/s). The merge reads and writes ~20 bytes of HBM per bf16 output element
#: (bf16 base -> float32 block, rank-r addmm in place, float32 -> bf16 output); we take 80% of HBM bandwidth for it.
#: Dispatch: ~6 CUDA launches per 8 MiB block (~40 us from Python), ~150 us per merged tensor. Per sync: 50 us, one
#: more status exchange (20 us) and the workspace's allocation from the caching allocator (a few us), with the Python
#: set-up of the pass taken as small next to it on a fast host; immaterial next to syncs of 0.1-10 s either way.
GPU_PROFILES: dict[str, Rates] = {}
for _gpu, _hbm in (("H100", 3.35e12), ("H200", 4.8e12)):
    GPU_PROFILES[_gpu] = Rates(
        name=f"8x{_gpu} SXM nodes (assumed)",
        kind="gpu",
        ag_busbw=360e9,
        ag_latency=20e-6,
        ar_latency=20e-6,
        merge_bps=_hbm * 0.8 * 2 / 20,
        merge_fp32_bps=_hbm * 0.8 * 4 / 22,
        per_merge=150e-6,
        per_block=40e-6,
        copy_bps=_hbm * 0.45,
        send_bps=45e9,
        send_latency=30e-6,
        load_bps=_hbm * 0.45,
        load_per_tensor=50e-6,
        snapshot_bps=20e9,
        fixed_server=0.03,
        fixed_pause=0.01,
        per_sync=50e-6,
        ag_busbw_inter=200e9,
        ag_latency_inter=40e-6,
        gpus_per_node=8,
        sources={
            "all-gather intra-node": "assumed 360 GB/s busbw, 20 us (nccl-tests range for 8 GPUs on NVLink 4)",
            "all-gather across nodes": "assumed 200 GB/s busbw (half of 8 x 400 Gb/s line rate), 40 us",
            "send to engines": "assumed 45 GB/s: one 400 Gb/s NIC (the sender is rank 0 alone), 30 us per chunk",
            "merge": f"assumed 80% of HBM {_hbm / 1e12:.2f} TB/s at ~20 B per bf16 output element",
            "engine load": "assumed 45% of HBM (a device copy), 50 us per checkpoint tensor (vLLM weight_loader)",
            "rollback snapshot": "assumed 20 GB/s device -> host (pageable PCIe Gen5)",
            "per sync": "assumed 50 us: the last status exchange and the merge workspace's allocation",
        },
    )


# --------------------------------------------------------------------------------------------------------------------
# The sync
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """The trainer and the engines."""

    world: int = 2
    sharding: Sharding = "zero3"
    dtype_bytes: int = 2  # base weights and merged outputs (bf16)
    adapter_bytes: int = 4  # LoRA factors (peft keeps them in float32)
    lora_rank: int = 16
    lora_experts: bool = False
    mode: Mode = "merged"
    group_by: Literal["budget", "layer"] = "budget"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    prefetch: bool = False
    release_memory: bool = True
    sink: Sink = "destination"
    replicas: int = 1
    engine_tp: int = 1
    rollback: bool = True
    pause: bool = True
    backend: Literal["gloo", "nccl"] = "gloo"
    coalesce_bytes: int = COALESCE_BYTES  # 0: one all-gather per parameter (the library before issue 26)
    # release_memory's malloc_trim: "growth" (the library now: once the pass has grown past TRIM_BOUND_GROUPS largest
    # groups; none in a steady state) or "every_64mib" (once per 64 MiB released: the library the published runs ran)
    trim_policy: Literal["growth", "every_64mib"] = "growth"
    # Which linear layers LoRA targets: "all" (every linear layer; the MoE models' attention, their experts being
    # fused parameters), "attention" (q, k, v, o only) or "none" (full fine-tuning: no adapter, no merge).
    lora_targets: Literal["all", "attention", "none"] = "all"
    # A sync after the first with skip_unchanged (the default): only outputs with a trainable source travel; every
    # rank fingerprints its shard of the sources of every other output instead.
    skip_unchanged: bool = False


@dataclass
class Group:
    units: list[Unit]
    gathered: int  # bytes gathered for the group (base + factors)


def _lora_factor_numel(u: Unit, r: int) -> int:
    return sum(r * (rows + cols) for rows, cols in u.params) * max(1, u.experts)


def plan(shape: ModelShape, s: Setup) -> tuple[list[Unit], list[Group]]:
    """The units the stream gathers and how it groups them (greedy by budget, or one group per layer with the runs
    of un-indexed modules before and after the layers as one group each), as ``grouping.partition`` does."""
    us = units(shape, lora_experts=s.lora_experts)
    if s.lora_targets == "attention":
        attention = (".q_proj", ".k_proj", ".v_proj", ".o_proj")
        us = [dataclasses.replace(u, lora=u.lora and u.name.endswith(attention)) for u in us]
    if s.lora_targets == "none":  # full fine-tuning: every output is its parameter, cast, with nothing to merge
        us = [dataclasses.replace(u, lora=False) for u in us]
    if s.skip_unchanged and s.mode == "merged":
        us = [u for u in us if u.lora]  # what changes with the adapter (and vLLM fuses LoRA targets with each other)
    if s.mode in FACTORS_ONLY:
        # AdapterStream refuses LoRA on MoE experts; the engine-side merge refuses transformers' fused experts.
        us = [u for u in us if u.lora and not u.experts]

    def gathered(u: Unit) -> int:
        if s.mode in FACTORS_ONLY:
            return _lora_factor_numel(u, s.lora_rank) * s.adapter_bytes
        lora = _lora_factor_numel(u, s.lora_rank) * s.adapter_bytes if u.lora else 0
        return u.numel() * s.dtype_bytes + lora

    groups: list[Group] = []
    cur: list[Unit] = []
    size = 0
    key: object = object()
    for u in us:
        b = gathered(u)
        if s.group_by == "budget":
            split = bool(cur) and size + b > s.budget_bytes
        else:
            split = bool(cur) and u.layer != key
            key = u.layer
        if split:
            groups.append(Group(cur, size))
            cur, size = [], 0
        cur.append(u)
        size += b
    if cur:
        groups.append(Group(cur, size))
    return us, groups


@dataclass
class Prediction:
    stages: dict[str, float]
    seconds: float
    seconds_prefetch: float
    gathered_per_rank: float  # bytes received by each rank's collectives
    peak_gathered: float  # the largest group (what the gather buffer holds)
    sent: float  # bytes sent to the engines (server: once, by rank 0; colocated: loaded by each engine)
    out_bytes: float  # bytes the stream yields
    peak_memory: float  # per rank
    memory_parts: dict[str, float]
    groups: int
    tensors: int
    ckpt_tensors: int
    whole_gather_bytes: float  # what TRL's whole-model gather holds per rank

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def predict(shape: ModelShape, s: Setup, r: Rates) -> Prediction:
    """One sync's time per stage, bytes and peak memory per rank (see docs/performance.md for the equations)."""
    us, groups = plan(shape, s)
    W = s.world
    sharded = s.sharding != "ddp" and W > 1
    inter = r.ag_busbw_inter is not None and W > r.gpus_per_node
    busbw = (r.ag_busbw_inter if inter else r.ag_busbw) or r.ag_busbw
    lat = (r.ag_latency_inter if inter else r.ag_latency) or r.ag_latency
    out_b = s.dtype_bytes
    gpu = r.kind == "gpu"

    # What is gathered: every parameter of every unit (experts: the two fused tensors), plus the LoRA factors.
    # Collectives: a group's parameters of at most ``coalesce_bytes`` whole bytes (LoRA factors, norms) share one
    # all-gather of a flat buffer; every larger one gets its own (the direct paths of ZeRO-3 and FSDP2).
    n_params = 0
    gathered = 0.0
    for g in groups:
        gathered += g.gathered
        small = 0
        for u in g.units:
            sizes: list[int] = []
            for rows, cols in u.params:
                e = max(1, u.experts)
                if s.mode == "merged":
                    sizes.append(rows * cols * e * s.dtype_bytes)
                if u.lora or s.mode in FACTORS_ONLY:
                    sizes += [s.lora_rank * cols * e * s.adapter_bytes, rows * s.lora_rank * e * s.adapter_bytes]
            for b in sizes:
                if b <= s.coalesce_bytes:
                    small += 1
                else:
                    n_params += 1
        n_params += 1 if small else 0
    stages: dict[str, float] = {}
    if s.skip_unchanged and s.mode == "merged":
        # Each rank reads its own shard of the sources of every untrained output once (fingerprint.py: one
        # multiply-add per 8 bytes, memory-bound), and the ranks agree in two status exchanges.
        frozen = sum(u.numel() for u in units(shape, lora_experts=s.lora_experts)) - sum(u.numel() for u in us)
        stages["fingerprint"] = frozen * s.dtype_bytes / (W if sharded else 1) / r.copy_bps + 2 * r.ar_latency
    if s.mode == "engine":
        # Every frozen byte is fingerprinted on its shard (the bases under adapters too: they must be the engine's).
        frozen = sum(u.numel() for u in units(shape, lora_experts=s.lora_experts))
        stages["fingerprint"] = frozen * s.dtype_bytes / (W if sharded else 1) / r.copy_bps + 2 * r.ar_latency
    if sharded:
        # ZeRO-3's direct path: one all_reduce deciding the path plus the lockstep exchange per group (and one
        # at the end); FSDP2: the lockstep exchange only.
        per_group = 2 if s.sharding == "zero3" else 1
        stages["status"] = (len(groups) * per_group + 1) * r.ar_latency
        stages["gather"] = n_params * lat + gathered * (W - 1) / W / busbw
    # Merges (merged mode): every LoRA-targeted base weight, in row blocks of MERGE_BLOCK_BYTES float32.
    merged = unmerged = 0.0
    merges = blocks = 0
    for u in us:
        if s.mode == "adapter":
            continue
        nb = 0
        for rows, cols in u.params:
            step = max(1, MERGE_BLOCK_BYTES // (4 * cols))
            nb += math.ceil(rows / step) * max(1, u.experts)
        if u.lora:
            merged += u.numel() * out_b
            merges += len(u.params) * max(1, u.experts if u.experts else 1)
            blocks += nb
        else:
            unmerged += u.numel() * out_b
    engine_merge = 0.0
    if s.mode == "engine":
        # The trainer sends the factors as gathered; the server merges (below), with the trainer's merge code.
        factors = sum(_lora_factor_numel(u, s.lora_rank) for u in us) * s.adapter_bytes
        rate = r.merge_bps if out_b == 2 else r.merge_fp32_bps
        dispatch = merges * r.per_merge + max(0, blocks - merges) * r.per_block
        engine_merge = max(dispatch, merged / rate) if gpu else dispatch + merged / rate
        stages["merge"] = 0.0
        out_bytes = float(factors)
        tensors = 2 * len(us)
    elif s.mode == "adapter":
        # lora_B is yielded with its scaling folded in (float32, rounded once); lora_A as gathered.
        factors = sum(_lora_factor_numel(u, s.lora_rank) for u in us) * s.adapter_bytes
        b_count = len(us)
        stages["merge"] = b_count * r.per_merge / 4 + factors / 2 / r.copy_bps
        out_bytes = float(factors)
        tensors = 2 * len(us)
    else:
        rate = r.merge_bps if out_b == 2 else r.merge_fp32_bps
        dispatch = merges * r.per_merge + max(0, blocks - merges) * r.per_block
        stages["merge"] = max(dispatch, merged / rate) if gpu else dispatch + merged / rate
        out_bytes = merged + unmerged
        tensors = len([1 for u in us for _ in u.params])
        if sharded:
            # Parameters that need no merge are copied out of the reused gather buffer.
            stages["copy_out"] = unmerged / r.copy_bps
        # "growth" trims only while the process grows past its bound: never once a sync has run (the steady state).
        trims = math.floor(gathered / TRIM_EVERY_BYTES) if s.trim_policy == "every_64mib" else 0
        if sharded and s.release_memory and r.trim_s and trims:
            stages["trim"] = trims * r.trim_s
        if r.per_sync:
            # A merged pass's fixed cost (fit_per_sync); the adapter's pass shows none (its published row, 0.99).
            stages["setup"] = r.per_sync
    ckpt = sum(u.ckpt_tensors for u in us) if s.mode in ("merged", "engine") else 2 * len(us)
    # The consumer.
    sent = 0.0
    if s.sink == "destination":
        stages["consume"] = out_bytes / r.copy_bps
    elif s.sink == "colocated":
        tp = max(1, s.engine_tp)
        stages["engine_load"] = out_bytes / tp / r.load_bps + ckpt * r.load_per_tensor
        if s.rollback:
            stages["snapshot"] = out_bytes / tp / r.snapshot_bps
        sent = out_bytes
    else:  # server: rank 0 broadcasts every byte to every engine worker; the workers load in parallel
        tp = max(1, s.engine_tp)
        buf = SERVER_BUFFER_BYTES[s.backend]
        chunks = max(1, math.ceil(out_bytes / buf)) if s.backend == "nccl" else tensors
        stages["send"] = out_bytes / r.send_bps + chunks * r.send_latency
        if s.mode == "engine":
            # Each TP worker merges and loads only the slice its weight loader reads (docs/merge_location.md); a
            # partial update rolls back by recomputing, so no copy is taken.
            stages["engine_merge"] = engine_merge / tp
            stages["engine_load"] = merged / tp / r.load_bps + ckpt * r.load_per_tensor
        else:
            stages["engine_load"] = out_bytes / tp / r.load_bps + ckpt * r.load_per_tensor
        if s.rollback and s.backend == "gloo" and s.mode != "engine":  # vLLM's nccl worker engine keeps no copy
            stages["snapshot"] = out_bytes / tp / r.snapshot_bps
        stages["http"] = r.fixed_server + (r.fixed_pause if s.pause else 0.0)
        sent = out_bytes
    # Total: by default (no prefetch) the stages run one after another, except the server's: on GPUs its trainer,
    # transport and engine worker pipeline chunk by chunk (the slowest of produce, send and load, plus one group's
    # worth of the other two); on a CPU machine only the transfer hides.
    produce = sum(
        v for k, v in stages.items() if k in ("setup", "fingerprint", "status", "gather", "merge", "copy_out", "trim")
    )
    if s.sink == "server":
        n = max(1, len(groups))
        engine = stages["engine_load"] + stages.get("snapshot", 0.0) + stages.get("engine_merge", 0.0)
        if gpu:
            pipe = [produce, stages["send"], engine]
            total = stages["http"] + max(pipe) + (sum(pipe) - max(pipe)) / n
        else:
            # On a CPU machine the trainer's merges and the engine's (multi-threaded) load share the same cores,
            # so they add up; only the transfer hides behind them, chunk by chunk.
            total = stages["http"] + produce + engine + stages["send"] / n
        total_pf = total
    else:
        total = sum(stages.values())
        # With prefetch the next group's gather overlaps this group's merge and consumer (GPU: NCCL on its own
        # stream); the first group's gather is not hidden.
        rest = total - stages.get("gather", 0.0)
        first = stages.get("gather", 0.0) / max(1, len(groups))
        total_pf = max(stages.get("gather", 0.0), rest) + first
    # Memory per rank.
    largest_group = max(g.gathered for g in groups) if sharded else 0
    # With prefetch the buffer holds this group and the next one.
    pair = max((a.gathered + b.gathered for a, b in itertools.pairwise(groups)), default=largest_group)
    largest_out = max((rows * cols * out_b for u in us for rows, cols in u.params), default=0)
    if s.mode in FACTORS_ONLY:
        largest_out = max((rows * s.lora_rank * s.adapter_bytes for u in us for rows, _ in u.params), default=0)
    parts: dict[str, float] = {
        "gather_buffer": float(pair if s.prefetch and sharded else largest_group),
        "largest_output": float(largest_out),
        "merge_workspace": float(MERGE_BLOCK_BYTES if s.mode == "merged" else 0),
    }
    if s.sink == "server":
        parts["send_buffers"] = 2.0 * SERVER_BUFFER_BYTES[s.backend]
    if r.kind == "cpu" and sharded and s.release_memory:
        # Freed memory the heap holds before a trim, half its most on average: 64 MiB between two trims, or (growth)
        # up to TRIM_BOUND_GROUPS largest groups of growth before one.
        bound = TRIM_EVERY_BYTES if s.trim_policy == "every_64mib" else TRIM_BOUND_GROUPS * largest_group
        parts["untrimmed (mean)"] = bound / 2
    elif r.kind == "cpu" and sharded:
        parts["untrimmed (mean)"] = 1.0 * largest_group  # freed buffers pile up to about one more group
    whole = (
        sum(u.numel() for u in units(shape)) * s.dtype_bytes
        + sum(_lora_factor_numel(u, s.lora_rank) for u in units(shape, s.lora_experts) if u.lora) * s.adapter_bytes
    )
    return Prediction(
        stages=stages,
        seconds=total,
        seconds_prefetch=total_pf,
        gathered_per_rank=gathered * (W - 1) / W if sharded else 0.0,
        peak_gathered=float(largest_group),
        sent=sent,
        out_bytes=out_bytes,
        peak_memory=sum(parts.values()),
        memory_parts=parts,
        groups=len(groups),
        tensors=tensors,
        ckpt_tensors=ckpt,
        whole_gather_bytes=float(whole),
    )


# --------------------------------------------------------------------------------------------------------------------
# Models (their published config.json values) and peers (their published figures)
# --------------------------------------------------------------------------------------------------------------------
#: The benchmarks' model (benchmarks/common.py: llama_config), at a given depth.
def bench_shape(layers: int = 16) -> ModelShape:
    return ModelShape(f"bench Llama {layers} layers", 1024, layers, 2816, 16, 16, 32000, source="benchmarks/common.py")


MODELS: dict[str, ModelShape] = {
    "Llama-3-8B": ModelShape(
        "Llama-3-8B", 4096, 32, 14336, 32, 8, 128256, source="meta-llama/Meta-Llama-3-8B config.json"
    ),
    "Llama-3-70B": ModelShape(
        "Llama-3-70B", 8192, 80, 28672, 64, 8, 128256, source="meta-llama/Meta-Llama-3-70B config.json"
    ),
    "Qwen3-30B-A3B": ModelShape(
        "Qwen3-30B-A3B",
        2048,
        48,
        6144,
        32,
        4,
        151936,
        head_dim=128,
        experts=128,
        expert_intermediate=768,
        qk_norm=True,
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    "Qwen3-235B-A22B": ModelShape(
        "Qwen3-235B-A22B",
        4096,
        94,
        12288,
        64,
        4,
        151936,
        head_dim=128,
        experts=128,
        expert_intermediate=1536,
        qk_norm=True,
        source="Qwen/Qwen3-235B-A22B config.json",
    ),
    # The peers' models, for like-for-like rows.
    "Qwen3-4B": ModelShape(
        "Qwen3-4B",
        2560,
        36,
        9728,
        32,
        8,
        151936,
        head_dim=128,
        tie_embeddings=True,
        qk_norm=True,
        source="Qwen/Qwen3-4B config.json",
    ),
    "Qwen3-32B": ModelShape(
        "Qwen3-32B", 5120, 64, 25600, 64, 8, 151936, head_dim=128, qk_norm=True, source="Qwen/Qwen3-32B config.json"
    ),
}

#: Published sync times of other systems (shared/notes/anchors.md, read from their public posts and docs).
PEERS: list[dict[str, str]] = [
    {
        "system": "NeMo-RL",
        "model": "Qwen3-4B",
        "setup": "H100, colocated, CUDA IPC, full weights",
        "time": "0.21-0.34 s",
    },
    {"system": "NeMo-RL", "model": "Qwen3-30B-A3B", "setup": "H100, colocated, CUDA IPC", "time": "0.74-1.0 s"},
    {
        "system": "checkpoint-engine",
        "model": "Qwen3-235B-A22B",
        "setup": "8xH800, bf16, parameter server",
        "time": "6.2 s",
    },
    {
        "system": "vLLM sharded RDT",
        "model": "Qwen3-235B-A22B",
        "setup": "FSDP2 -> DP8/EP8, 2x8 H100, NIXL pulls",
        "time": "2.7-3.3 s",
    },
    {"system": "verl", "model": "27B dense", "setup": "bf16 over EFA", "time": "2.5 s"},
    {"system": "TRL", "model": "Qwen3-32B", "setup": "FSDP2, 16 + 16 H200, vLLM server, NCCL", "time": "~2.3 s"},
    {
        "system": "Perplexity",
        "model": "Kimi-K2 1T",
        "setup": "256 trainer -> 128 inference GPUs, RDMA",
        "time": "1.3 s",
    },
]


# --------------------------------------------------------------------------------------------------------------------
# Validation against this machine's benchmarks
# --------------------------------------------------------------------------------------------------------------------
def _load(name: str, results: Path = RESULTS) -> dict[str, Any] | None:
    p = results / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _worst(rows: Iterable[dict[str, Any]], key: str) -> float:
    return max(float(r[key]) for r in rows)


def _merge_counts(shape: ModelShape, s: Setup) -> tuple[float, int, int, float, int]:
    """(merged bytes, merges, blocks, unmerged bytes, gathered params) of a merged sync: what the floors measured."""
    us, _ = plan(shape, s)
    merged = unmerged = 0.0
    merges = blocks = params = 0
    for u in us:
        params += len(u.params) * (3 if u.lora else 1)
        for rows, cols in u.params:
            step = max(1, MERGE_BLOCK_BYTES // (4 * cols))
            if u.lora:
                merges += 1
                blocks += math.ceil(rows / step)
        if u.lora:
            merged += u.numel() * s.dtype_bytes
        else:
            unmerged += u.numel() * s.dtype_bytes
    return merged, merges, blocks, unmerged, params


def validate(probe: Rates, results: Path = RESULTS, trim_policy: str = "auto") -> list[dict[str, Any]]:
    """Predicted against measured, for every benchmark JSON found under ``results``. ``trim_policy``: the heap-trim
    policy the runs measured (``Setup.trim_policy``); ``"auto"``: ``"growth"`` for a file whose rows record
    ``heap_trims_per_sync`` (zero3_worker's runs since the change), else ``"every_64mib"`` (the runs before it)."""
    rows: list[dict[str, Any]] = []

    def setups(data: dict[str, Any]) -> Callable[..., Setup]:
        """``Setup`` with the trim policy ``data``'s run measured."""
        recorded = any(
            isinstance(r, dict) and "heap_trims_per_sync" in r for v in data.values() if isinstance(v, list) for r in v
        )
        pol = trim_policy if trim_policy != "auto" else "growth" if recorded else "every_64mib"
        return functools.partial(Setup, trim_policy=pol)

    def add(bench: str, case: str, pred: float, meas: float, unit: str, cal: str, cmd: str) -> None:
        rows.append(
            {
                "bench": bench,
                "case": case,
                "predicted": pred,
                "measured": meas,
                "ratio": meas / pred if pred else None,
                "unit": unit,
                "calibration": cal,
                "command": cmd,
            }
        )

    cals: list[tuple[str, Rates]] = [("probe", probe)]
    z = _load("zero3", results)
    if z is not None:
        mk = setups(z)
        a = z["args"]
        cmd = f"bench_zero3.py --syncs {a['syncs']} --budgets-mib {a['budgets_mib']}"
        shape = bench_shape(a["layers"])
        floors = z["floors"]
        worst_floor = {k: max(float(f[k]) for f in floors.values()) for k in ("all_gather_s", "merge_s", "copy_s")}
        s = mk(world=2, budget_bytes=32 * MiB)
        merged, merges, blocks, unmerged, params = _merge_counts(shape, s)
        gathered = sum(g.gathered for g in plan(shape, s)[1])
        p = predict(shape, s, probe)
        add(
            "zero3",
            "floor: raw all-gather of every parameter",
            params * probe.ag_latency + gathered / 2 / probe.ag_busbw,
            worst_floor["all_gather_s"],
            "s",
            "probe",
            cmd,
        )
        add("zero3", "floor: merges alone", p.stages["merge"], worst_floor["merge_s"], "s", "probe", cmd)
        fl = with_floors(probe, {**worst_floor}, gathered, params, merged, merges, blocks, merged + unmerged)
        cals.append(("zero3 floors", fl))
        for variant, opts, setup in (
            ("lora_stream budget", [], mk(world=2, budget_bytes=32 * MiB)),
            ("lora_stream layer", [], mk(world=2, group_by="layer")),
            ("lora_stream budget", ["no-release"], mk(world=2, budget_bytes=32 * MiB, release_memory=False)),
            ("lora_stream budget", ["prefetch"], mk(world=2, budget_bytes=32 * MiB, prefetch=True)),
        ):
            got = [r for r in z["rows"] if r["variant"] == variant and r["options"] == opts]
            if not got:
                continue
            label = f"{variant.removeprefix('lora_stream ')}{' ' + ','.join(opts) if opts else ''}"
            for cal_name, rates in cals:
                pr = predict(shape, setup, rates)
                add(
                    "zero3",
                    f"sync, {label} (no overlap on 2 cores)",
                    pr.seconds,
                    _worst(got, "median_sync_s"),
                    "s",
                    cal_name,
                    cmd,
                )
            pr = predict(shape, setup, probe)
            add(
                "zero3",
                f"peak gathered, {label}",
                pr.memory_parts["gather_buffer"] / MiB,
                _worst(got, "peak_gathered_bytes") / MiB,
                "MiB",
                "shapes",
                cmd,
            )
            add(
                "zero3",
                f"RSS growth, {label}",
                pr.peak_memory / MiB,
                _worst(got, "rss_growth_bytes") / MiB,
                "MiB",
                "shapes",
                cmd,
            )
        # The default stream timed in turns with the floor parts in the same processes (bench_zero3's default
        # stream, --interleaved-floor), against the model calibrated with those floors: the steadiest comparison.
        turns = [r["floors"] for r in z["rows"] if r["variant"] == "lora_stream budget" and "sync_s" in r["floors"]]
        if turns:
            tf = {k: max(float(f[k]) for f in turns) for k in ("all_gather_s", "merge_s", "copy_s")}
            rates = with_floors(probe, tf, gathered, params, merged, merges, blocks, merged + unmerged)
            add(
                "zero3",
                "sync, budget, timed in turns with its floors",
                predict(shape, s, rates).seconds,
                max(float(f["sync_s"]) for f in turns),
                "s",
                "floors timed in turns",
                cmd,
            )
    d = _load("depth", results)
    if d is not None:
        mk = setups(d)
        a = d["args"]
        cmd = f"bench_depth.py --syncs {a['syncs']} --depths {a['depths']}"
        for depth in sorted({int(r["layers"]) for r in d["rows"]}):
            got = [r for r in d["rows"] if r["layers"] == depth and r["variant"] != "whole_gather"]
            for cal_name, rates in cals:
                pr = predict(bench_shape(depth), mk(world=2, budget_bytes=32 * MiB), rates)
                add("depth", f"sync, {depth} layers", pr.seconds, _worst(got, "median_sync_s"), "s", cal_name, cmd)
            add(
                "depth",
                f"RSS growth, {depth} layers",
                pr.peak_memory / MiB,
                _worst(got, "rss_growth_bytes") / MiB,
                "MiB",
                "shapes",
                cmd,
            )
    f2 = _load("fsdp2", results)
    if f2 is not None:
        mk = setups(f2)
        a = f2["args"]
        cmd = f"bench_fsdp2.py --syncs {a['syncs']} --budgets-mib {a['budgets_mib']}"
        for variant, setup in (
            ("lora_stream budget", mk(world=2, sharding="fsdp2", budget_bytes=32 * MiB)),
            ("lora_stream layer", mk(world=2, sharding="fsdp2", group_by="layer")),
        ):
            got = [r for r in f2["rows"] if r["variant"] == variant and not r["options"]]
            if not got:
                continue
            pr = predict(bench_shape(a["layers"]), setup, probe)
            label = variant.removeprefix("lora_stream ")
            for cal_name, rates in cals:
                t = predict(bench_shape(a["layers"]), setup, rates).seconds
                add("fsdp2", f"sync, {label}", t, _worst(got, "median_sync_s"), "s", cal_name, cmd)
            add(
                "fsdp2",
                f"RSS growth, {label}",
                pr.peak_memory / MiB,
                _worst(got, "rss_growth_bytes") / MiB,
                "MiB",
                "shapes",
                cmd,
            )
    ad = _load("adapter", results)
    if ad is not None:
        mk = setups(ad)
        a = ad["args"]
        cmd = f"bench_adapter.py --syncs {a['syncs']}"
        shape = bench_shape(a["layers"])
        for label, setup, variants in (
            ("merged (ZeRO-3, 128 MiB groups)", mk(world=2), ("lora_stream budget", "merged")),
            ("adapter (ZeRO-3, coalesced)", mk(world=2, mode="adapter"), ("adapter",)),
            (
                "adapter (ZeRO-3, per factor)",
                mk(world=2, mode="adapter", coalesce_bytes=0),
                ("zero3 adapter per-factor", "adapter per-factor"),
            ),
            ("merged (FSDP2, 128 MiB groups)", mk(world=2, sharding="fsdp2"), ("fsdp2 merged",)),
            ("adapter (FSDP2, coalesced)", mk(world=2, sharding="fsdp2", mode="adapter"), ("fsdp2 adapter",)),
        ):
            got = [r for r in ad["trainer"] if r["variant"] in variants]
            if not got:
                continue
            pr = predict(shape, setup, probe)
            for cal_name, rates in cals:
                t = predict(shape, setup, rates).seconds
                add("adapter", f"trainer sync, {label}", t, _worst(got, "median_sync_s"), "s", cal_name, cmd)
            add(
                "adapter",
                f"bytes moved, {label}",
                pr.out_bytes / MiB,
                _worst(got, "bytes_moved") / MiB,
                "MiB",
                "shapes",
                cmd,
            )
        merged_engine = [r for r in ad["vllm"] if r["mode"] == "merged"]
        if merged_engine:
            # One process (the plain gatherer), vLLM in-process; the load rate is the server benchmark's.
            pr = predict(shape, mk(world=1, sharding="ddp", sink="colocated", group_by="layer"), probe)
            add(
                "adapter",
                "vLLM colocated merged sync (plain model, rollback on)",
                pr.seconds,
                float(merged_engine[0]["median_sync_s"]),
                "s",
                "probe + server load rate",
                cmd,
            )
    sv = _load("server", results)
    if sv is not None:
        mk = setups(sv)
        a = sv["args"]
        cmd = f"bench_server.py --syncs {a['syncs']}"
        srv = rates_from_calibration_like(probe, sv)
        shape = bench_shape(a["layers"])
        base = mk(world=1, sharding="ddp", dtype_bytes=4, sink="server", group_by="layer")
        pr = predict(shape, base, srv)
        add(
            "server",
            "end to end, pause + rollback (default)",
            pr.seconds,
            float(sv["median_s"]),
            "s",
            "probe + server stages",
            cmd,
        )
        plain = [t for t in sv.get("transaction", []) if t["variant"] == "plain"]
        if plain:
            pr = predict(shape, dataclasses.replace(base, pause=False, rollback=False), srv)
            add(
                "server",
                "end to end, no pause, no rollback",
                pr.seconds,
                float(plain[0]["median_s"]),
                "s",
                "probe + server stages",
                cmd,
            )
        pr = predict(shape, base, srv)
        add(
            "server",
            "broadcast floor (same bytes, 1 MiB chunks)",
            pr.stages["send"],
            float(sv["broadcast_floor_s"]),
            "s",
            "probe",
            cmd,
        )
    return rows


def rates_from_calibration_like(probe: Rates, server: dict[str, Any]) -> Rates:
    """``probe`` with the engine's load rate and the HTTP costs of this server run (its own stage timings)."""
    load_s = float(server["worker_stages_s"]["load_s"])
    return dataclasses.replace(
        probe,
        load_bps=float(server["bytes"]) / load_s,
        fixed_server=float(server["trainer_stages_s"]["http_s"]),
        sources={**probe.sources, "engine load, HTTP": "stage timings of the same bench_server run"},
    )


#: docs/benchmarks.md's figures from a quiet period (the published tables): a second validation set.
#: The published runs predate coalescing (one all-gather per parameter) and the growth-bound heap trim.
PUBLISHED_FLOORS = {"all_gather_s": 0.485, "merge_s": 0.133, "copy_s": 0.049}
_pub = functools.partial(Setup, world=2, coalesce_bytes=0, trim_policy="every_64mib")
PUBLISHED: dict[str, list[tuple[str, Setup, float]]] = {
    "zero3": [
        ("budget 32 MiB", _pub(budget_bytes=32 * MiB), 0.80),
        ("budget 128 MiB", _pub(), 0.85),
        ("layer", _pub(group_by="layer"), 0.85),
        ("no-release", _pub(budget_bytes=32 * MiB, release_memory=False), 0.76),
    ],
    "fsdp2": [
        ("budget 32 MiB", _pub(sharding="fsdp2", budget_bytes=32 * MiB), 0.82),
        ("layer", _pub(sharding="fsdp2", group_by="layer"), 0.86),
    ],
    "adapter": [("adapter (ZeRO-3)", _pub(mode="adapter"), 0.118)],
}
#: The depth sweep's setup (budget 32 MiB).
PUBLISHED_DEPTH_SETUP = _pub(budget_bytes=32 * MiB)


#: "malloc_trim walks the whole heap (about 9 ms per call here)": docs/memory.md, the same period.
PUBLISHED_TRIM_S = 0.009


def _published_depth() -> list[dict[str, Any]]:
    """The depth plot's rows of lora_stream (docs/images/plot-data.json), or none."""
    plot = Path(__file__).resolve().parent.parent / "docs" / "images" / "plot-data.json"
    rows = json.loads(plot.read_text())["depth"] if plot.exists() else []
    return [r for r in rows if r["variant"] == "stream"]


def published_rates(probe: Rates) -> Rates:
    """The model calibrated with the published run's own floors (the probe's latencies kept), that period's
    ``malloc_trim`` cost (docs/memory.md) and the fixed cost per sync fitted to its depth sweep (fit_per_sync)."""
    shape, s = bench_shape(16), PUBLISHED_DEPTH_SETUP
    merged, merges, blocks, unmerged, params = _merge_counts(shape, s)
    gathered = sum(g.gathered for g in plan(shape, s)[1])
    fl = with_floors(probe, PUBLISHED_FLOORS, gathered, params, merged, merges, blocks, merged + unmerged)
    # malloc_trim's cost depends on the heap and on the machine's load: that run's own figure (docs/memory.md).
    fl = dataclasses.replace(fl, trim_s=PUBLISHED_TRIM_S, per_sync=0.0)
    return dataclasses.replace(fl, per_sync=fit_per_sync(fl))


def fit_per_sync(rates: Rates) -> float:
    """``t_sync``, the fixed cost of one merged pass: the intercept of the least-squares line through the published
    depth sweep (sync time against layers: 4, 8, 16, 32 layers, 0.362, 0.48, 0.811, 1.41 s) less the intercept of
    the same line through the model's own predictions at those depths (``rates`` without ``t_sync``). The model
    already carries the depth-independent work it knows of (embeddings, lm_head, the last status exchange); what
    remains at zero layers is what it lacks. 0 without the sweep."""
    pts = _published_depth()
    if len(pts) < 2:
        return 0.0
    bare = dataclasses.replace(rates, per_sync=0.0)
    xs = [float(r["layers"]) for r in pts]
    measured = [float(r["median_sync_s"]) for r in pts]
    model = [predict(bench_shape(int(x)), PUBLISHED_DEPTH_SETUP, bare).seconds for x in xs]

    def intercept(ys: list[float]) -> float:
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        return my - slope * mx

    return max(0.0, intercept(measured) - intercept(model))


def validate_published(probe: Rates) -> list[dict[str, Any]]:
    """The published quiet-period run (docs/benchmarks.md, docs/images/plot-data.json) against the model calibrated
    with that run's own floors (published_rates)."""
    shape, s = bench_shape(16), PUBLISHED_DEPTH_SETUP
    fl = published_rates(probe)
    rows = []
    for bench in ("zero3", "fsdp2", "adapter"):
        for label, setup, meas in PUBLISHED[bench]:
            p = predict(shape, setup, fl)
            rows.append(
                {
                    "bench": f"{bench} (published)",
                    "case": f"sync, {label}",
                    "predicted": p.seconds,
                    "measured": meas,
                    "ratio": meas / p.seconds,
                    "unit": "s",
                    "calibration": "published floors",
                    "command": "docs/benchmarks.md",
                }
            )
    # The server table of docs/benchmarks.md (before transactions: no pause, no rollback; 1 MiB buffer): the
    # engine's load and the HTTP round trips from that run's stage timings, the transfer from its broadcast floor.
    srv = dataclasses.replace(
        fl,
        merge_fp32_bps=probe.merge_fp32_bps * fl.merge_bps / probe.merge_bps,
        send_bps=673_255_424 / 0.171,
        send_latency=0.0,
        load_bps=673_255_424 / 0.460,
        fixed_server=0.143,
    )
    setup = Setup(world=1, sharding="ddp", dtype_bytes=4, sink="server", group_by="layer", pause=False, rollback=False)
    p = predict(bench_shape(8), setup, srv)
    rows.append(
        {
            "bench": "server (published)",
            "case": "end to end (no pause, no rollback)",
            "predicted": p.seconds,
            "measured": 0.85,
            "ratio": 0.85 / p.seconds,
            "unit": "s",
            "calibration": "published floors + stages",
            "command": "docs/benchmarks.md",
        }
    )
    for r in _published_depth():
        p = predict(bench_shape(int(r["layers"])), s, fl)
        rows.append(
            {
                "bench": "depth (published)",
                "case": f"sync, {r['layers']} layers",
                "predicted": p.seconds,
                "measured": r["median_sync_s"],
                "ratio": r["median_sync_s"] / p.seconds,
                "unit": "s",
                "calibration": "published floors",
                "command": "docs/images/plot-data.json",
            }
        )
        rows.append(
            {
                "bench": "depth (published)",
                "case": f"RSS growth, {r['layers']} layers",
                "predicted": p.peak_memory / MiB,
                "measured": r["rss_growth_mib"],
                "ratio": r["rss_growth_mib"] / (p.peak_memory / MiB),
                "unit": "MiB",
                "calibration": "shapes",
                "command": "docs/images/plot-data.json",
            }
        )
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Projections
# --------------------------------------------------------------------------------------------------------------------
#: (model, trainer world, engine TP, engine replicas) for each projection.
SCENARIOS: list[tuple[str, int, int, int]] = [
    ("Qwen3-4B", 8, 1, 8),
    ("Llama-3-8B", 8, 1, 8),
    ("Qwen3-30B-A3B", 8, 4, 2),
    ("Qwen3-32B", 16, 8, 2),
    ("Llama-3-70B", 16, 8, 2),
    ("Qwen3-235B-A22B", 16, 8, 2),
]


def project(gpu: str) -> list[dict[str, Any]]:
    """Each scenario on ``gpu`` nodes: ZeRO-3 (FSDP2 differs only by one collective per group) into colocated
    engines, into a vLLM server on other nodes (rank 0 sends over NCCL), and the adapter (LoRA r=16, all linear
    layers; attention only on MoE models, since AdapterStream refuses LoRA on experts)."""
    r = GPU_PROFILES[gpu]
    out = []
    for name, world, tp, replicas in SCENARIOS:
        shape = MODELS[name]
        base = Setup(world=world, sharding="zero3", sink="colocated", engine_tp=tp, replicas=replicas, backend="nccl")
        colo = predict(shape, base, r)
        colo_norb = predict(shape, dataclasses.replace(base, rollback=False), r)
        fsdp = predict(shape, dataclasses.replace(base, sharding="fsdp2"), r)
        server = predict(shape, dataclasses.replace(base, sink="server"), r)
        adapter = predict(shape, dataclasses.replace(base, mode="adapter"), r)
        engine_merge = predict(shape, dataclasses.replace(base, sink="server", mode="engine"), r)
        skip: dict[str, float] = {}
        for targets in ("all", "attention"):
            t = dataclasses.replace(base, lora_targets=targets)  # type: ignore[arg-type]
            for sink in ("colocated", "server"):
                full = predict(shape, dataclasses.replace(t, sink=sink), r)  # type: ignore[arg-type]
                part = predict(shape, dataclasses.replace(t, sink=sink, skip_unchanged=True), r)  # type: ignore[arg-type]
                skip[f"{sink}_{targets}_full_s"] = full.seconds
                skip[f"{sink}_{targets}_skip_s"] = part.seconds
                skip[f"{sink}_{targets}_skip_sent_gb"] = part.sent / GB
                skip[f"{sink}_{targets}_full_sent_gb"] = full.sent / GB
                skip[f"{targets}_fingerprint_s"] = part.stages.get("fingerprint", 0.0)
        out.append(
            {
                "gpu": gpu,
                "model": name,
                "params_b": param_count(shape) / 1e9,
                "bf16_gb": param_count(shape) * 2 / GB,
                "trainer": f"ZeRO-3 x{world}",
                "engine": f"TP{tp} x{replicas}",
                "gathered_per_rank_gb": colo.gathered_per_rank / GB,
                "largest_group_gb": colo.peak_gathered / GB,
                "peak_sync_memory_gb": colo.peak_memory / GB,
                "peak_sync_memory_prefetch_gb": predict(shape, dataclasses.replace(base, prefetch=True), r).peak_memory
                / GB,
                "whole_gather_gb": colo.whole_gather_bytes / GB,
                "colocated_s": colo.seconds,
                "colocated_prefetch_s": colo.seconds_prefetch,
                "colocated_no_rollback_s": colo_norb.seconds,
                "colocated_no_rollback_prefetch_s": colo_norb.seconds_prefetch,
                "fsdp2_colocated_s": fsdp.seconds,
                "server_s": server.seconds,
                "server_sent_gb": server.sent / GB,
                "adapter_s": adapter.seconds,
                "adapter_mb": adapter.out_bytes / 1e6,
                "engine_merge_s": engine_merge.seconds,
                "engine_merge_sent_mb": engine_merge.sent / 1e6,
                "stages_engine_merge": engine_merge.stages,
                "stages_colocated": colo.stages,
                "stages_server": server.stages,
                "skip": skip,
            }
        )
    return out


# --------------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------------
def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The docs page's tables (docs/performance.md), from ``cost_model.json``."""
    lines = ["| rate | this machine | H100 (assumed) | H200 (assumed) |", "|---|---|---|---|"]
    cal, gpus = result["calibration"], result["gpu_profiles"]
    for key, label, unit in (
        ("ag_busbw", "all-gather bus bandwidth", "GB/s"),
        ("ag_latency", "latency per all-gather", "us"),
        ("ar_latency", "status exchange (all_reduce)", "us"),
        ("merge_bps", "merge, bf16 outputs", "GB/s"),
        ("merge_fp32_bps", "merge, float32 outputs", "GB/s"),
        ("per_merge", "per merged tensor", "us"),
        ("per_block", "per further 8 MiB block", "us"),
        ("copy_bps", "memory copy", "GB/s"),
        ("send_bps", "send to the engine (broadcast)", "GB/s"),
        ("load_bps", "engine's load_weights", "GB/s"),
        ("load_per_tensor", "engine's load per tensor", "us"),
        ("snapshot_bps", "rollback's host copy", "GB/s"),
        ("trim_s", "malloc_trim", "ms"),
        ("per_sync", "fixed cost per merged sync", "ms"),
    ):
        scale = {"GB/s": 1e-9, "us": 1e6, "ms": 1e3}[unit]
        vals = [cal[key], gpus["H100"][key], gpus["H200"][key]]
        lines.append(f"| {label} ({unit}) | " + " | ".join(_fmt(v * scale) for v in vals) + " |")
    out = ["### Calibration", "", *lines]
    for title, published in (("Validation: the published runs", True), ("Validation: this session's runs", False)):
        out += ["", f"### {title}", ""]
        out += [
            "| benchmark | case | calibration | predicted | measured | measured / predicted |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["validation"]:
            if r["bench"].endswith("(published)") != published:
                continue
            u = r["unit"]
            out.append(
                f"| {r['bench'].removesuffix(' (published)')} | {r['case']} | {r['calibration']} | "
                f"{_fmt(r['predicted'])} {u} | {_fmt(r['measured'])} {u} | {_fmt(r['ratio'])} |"
            )
    out += ["", "### Projections", ""]
    out += [
        "| GPU | model | bf16 GB | trainer | engines | largest group GB | sync peak GB/rank | whole gather GB/rank "
        "| colocated s | + prefetch | no rollback + prefetch | server s | adapter s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["projections"]:
        out.append(
            f"| {p['gpu']} | {p['model']} | {p['bf16_gb']:.0f} | {p['trainer']} | {p['engine']} | "
            f"{p['largest_group_gb']:.2f} | {p['peak_sync_memory_gb']:.2f} | {p['whole_gather_gb']:.0f} | "
            f"{p['colocated_s']:.2f} | {p['colocated_prefetch_s']:.2f} | {p['colocated_no_rollback_prefetch_s']:.2f} | "
            f"{p['server_s']:.2f} | {p['adapter_s']:.3f} |"
        )
    out += ["", "### Skipping unchanged outputs (a sync after the first, `skip_unchanged=True`)", ""]
    out += [
        "| GPU | model | LoRA on | colocated full s | colocated skip s | server full s | server skip s | "
        "server sent GB full / skip | fingerprint s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["projections"]:
        k = p.get("skip")
        if not k:
            continue
        for targets in ("all", "attention"):
            out.append(
                f"| {p['gpu']} | {p['model']} | {targets} | {k[f'colocated_{targets}_full_s']:.2f} | "
                f"{k[f'colocated_{targets}_skip_s']:.2f} | {k[f'server_{targets}_full_s']:.2f} | "
                f"{k[f'server_{targets}_skip_s']:.2f} | {k[f'server_{targets}_full_sent_gb']:.1f} / "
                f"{k[f'server_{targets}_skip_sent_gb']:.1f} | {k[f'{targets}_fingerprint_s']:.4f} |"
            )
    keys = sorted({k for p in result["projections"] for k in p["stages_colocated"]})
    out += ["", "### Stages (H100, colocated, default)", "", "| model | " + " | ".join(keys) + " |"]
    out.append("|---|" + "---|" * len(keys))
    for p in result["projections"]:
        if p["gpu"] == "H100":
            out.append(
                f"| {p['model']} | " + " | ".join(f"{p['stages_colocated'].get(k, 0.0):.3f}" for k in keys) + " |"
            )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calibration", default=str(RESULTS / "calibration.json"))
    ap.add_argument("--out", default=str(RESULTS / "cost_model.json"))
    ap.add_argument("--markdown", help="also write the docs page's tables (markdown) to this file")
    ap.add_argument("--results", default=str(RESULTS), help="the benchmarks' JSON to validate against")
    ap.add_argument(
        "--trim-policy",
        choices=("auto", "growth", "every_64mib"),
        default="auto",
        help="the heap-trim policy those runs measured (auto: growth where zero3_worker recorded heap_trims_per_sync)",
    )
    args = ap.parse_args()
    cal_path = Path(args.calibration)
    if not cal_path.exists():
        raise SystemExit(f"{cal_path} is missing: run benchmarks/calibrate.py first")
    cal = json.loads(cal_path.read_text())
    results = Path(args.results)
    probe = rates_from_calibration(cal, _load("server", results))
    print(f"calibration ({cal_path.name}, measured {cal.get('measured_at', '?')}):")
    for k in (
        "ag_busbw",
        "ag_latency",
        "ar_latency",
        "merge_bps",
        "merge_fp32_bps",
        "per_merge",
        "per_block",
        "copy_bps",
        "send_bps",
        "send_latency",
        "load_bps",
        "fixed_server",
        "trim_s",
        "per_sync",
    ):
        v = getattr(probe, k)
        print(f"  {k:<16} {v / GB:.3f} GB/s" if k.endswith("bps") or k == "ag_busbw" else f"  {k:<16} {v * 1e3:.3f} ms")
    rows = validate(probe, results, args.trim_policy) + validate_published(probe)
    print(f"\n{'bench':<18} {'case':<52} {'cal':<22} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['bench']:<18} {r['case']:<52} {r['calibration']:<22} {_fmt(r['predicted']):>10} "
            f"{_fmt(r['measured']):>10} {_fmt(r['ratio']):>6}  {r['unit']}"
        )
    proj = project("H100") + project("H200")
    print("\nprojections (ASSUMED GPU rates; ZeRO-3, LoRA r=16 all-linear, bf16; seconds per sync):")
    print(
        f"{'gpu':<5} {'model':<16} {'GB':>5} {'trainer':<10} {'engine':<8} {'grp GB':>6} {'peak GB':>7} "
        f"{'whole GB':>8} {'coloc':>6} {'+pf':>6} {'no rb':>6} {'server':>6} {'adapter':>7} {'eng-merge':>9}"
    )
    for p in proj:
        print(
            f"{p['gpu']:<5} {p['model']:<16} {p['bf16_gb']:>5.0f} {p['trainer']:<10} {p['engine']:<8} "
            f"{p['largest_group_gb']:>6.2f} {p['peak_sync_memory_gb']:>7.2f} {p['whole_gather_gb']:>8.0f} "
            f"{p['colocated_s']:>6.2f} {p['colocated_prefetch_s']:>6.2f} {p['colocated_no_rollback_prefetch_s']:>6.2f} "
            f"{p['server_s']:>6.2f} {p['adapter_s']:>7.3f} {p['engine_merge_s']:>9.3f}"
        )
    print("\nwhere the time goes (H100, colocated, default: rollback on, no prefetch), seconds:")
    keys = sorted({k for p in proj for k in p["stages_colocated"]})
    print(f"{'model':<16} " + " ".join(f"{k:>11}" for k in keys))
    for p in proj:
        if p["gpu"] == "H100":
            print(f"{p['model']:<16} " + " ".join(f"{p['stages_colocated'].get(k, 0.0):>11.3f}" for k in keys))
    print("\npeers' published figures:")
    for peer in PEERS:
        print(f"  {peer['system']:<18} {peer['model']:<16} {peer['setup']:<44} {peer['time']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "calibration": dataclasses.asdict(probe),
                "calibration_file": str(cal_path),
                "validation": rows,
                "gpu_profiles": {k: dataclasses.asdict(v) for k, v in GPU_PROFILES.items()},
                "projections": proj,
                "peers": PEERS,
                "models": {k: dataclasses.asdict(v) | {"params": param_count(v)} for k, v in MODELS.items()},
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")
    if args.markdown:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.out).read_text())))
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
