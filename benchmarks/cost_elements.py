"""A cost model of one element sync (``elements=True``, full fine-tuning) against a full sync of the same weights, at
GPU scale: Llama-3-8B and Llama-3-70B on H100 nodes, beside verl's published figures.

    python benchmarks/cost_elements.py                 # the table, and benchmarks/results/cost_elements.json
    python benchmarks/cost_elements.py --fractions 0.011,0.07 --gpu H200

Where each rate comes from, kept apart in the JSON:

* **measured on the host here** (:data:`HOST`): the host passes an engine worker makes on the element path's
  rebuild (decode, rebuild of every touched tensor from its host copy, NH over it), per element and per thread,
  from the floors of ``bench_elements.py``'s model on this machine (docs/performance.md, "Element syncs"). They
  are the same passes on a GPU node's host, so they carry over, up to the host's speed per thread.
* **assumed for GPUs** (``cost_model.GPU_PROFILES``): HBM, NVLink, InfiniBand and PCIe figures, as the full-sync
  projections use. Nothing here has been measured on a GPU; ``benchmarks/gpu_check.py`` (check 8) times the trainer's
  diff on the first device it meets.
* **the full sync**: ``cost_model.predict`` of the same setup with nothing to merge (``lora_targets="none"``).

Three engine paths, per stage (equations in :func:`predict_elements`; docs/performance.md gives the tables); the
trainer's side is the same in all three (its read on the device, one pass a chunk):

* ``rebuild``: each engine worker rebuilds every tensor holding a changed element whole, from a host copy of the
  whole model it keeps, fingerprints it on the host (NH), copies it to the device and reloads its module through
  vLLM (``load_weights`` and the layer's processing). What lora_stream does for a module not served in its own
  layout: every module of a tensor-parallel worker (it holds slices), a repacked or quantized one.
* ``in place``: what lora_stream does where the engine serves a tensor in its own layout (one tensor-parallel
  worker, bf16 dense weights on CUDA): the changed elements written where they are served, old values kept, the
  proof one read of the served bytes on the device, no host copy; the state digest reads the engine's weights on
  the device three times per sync (the pre-flight's check, the reload bracket's check, the commit's record).
* ``in place, O(k) proof``: the proof updated from the changes alone between full re-reads (the linear fingerprint,
  ``lora_stream.linear_fingerprint``, as element syncs prove today), and the state digests the same way (not built
  yet), which would also prove a tensor-parallel worker's slices.

Generation is paused for the whole of a full sync into a server (the gather, the send, the load), and for an element
sync for the engine's apply, its proof, the commit's digest, the vote and the commit; ``rebuild`` also pauses
through the rebuild and the reload.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from cost_model import GB, GPU_PROFILES, MODELS, RESULTS, SCENARIOS, ModelShape, Rates, Setup, param_count, predict

Route = Literal["server", "colocated"]
Path_ = Literal["rebuild", "in place", "in place, O(k) proof"]
PATHS: tuple[Path_, ...] = ("rebuild", "in place", "in place, O(k) proof")

#: Host rates of the engine's rebuild path, measured on this machine's CPU (docs/performance.md, "Element syncs", and
#: the floors behind it: one thread unless said), seconds per element or per byte.
HOST = {
    # NH (lora_stream.fingerprint) over a rebuilt tensor: 0.034 s for the 17M-element model, 2 threads.
    "nh_s_per_element": 0.034 / 17e6 * 2,
    # A whole-tensor clone from the host copy (what a rebuild allocates and fills): 3.4 ms per 8.5M bf16 elements.
    "clone_s_per_element": 3.4e-3 / 8.5e6,
    # Decoding indices (int32) and scattering the values into the host copy, old values kept: per changed element.
    "decode_scatter_s_per_changed": (0.6e-3 + 1.0e-3 + 1.0e-3) / (8.5e6 * 0.011),
}
#: Host threads an engine worker's host passes may use on a GPU node (vLLM's workers: one process per GPU; the
#: passes are torch ops, which take the process's intra-op threads).
HOST_THREADS = 8
#: Host <-> device copies of pageable memory (PCIe Gen5), bytes per second: assumed, as cost_model's snapshot.
PCIE_BPS = 20e9
#: Kernel launches and host syncs: one launch, and one host sync (the ``nonzero`` of each chunk), in seconds.
LAUNCH_S = 10e-6
HOST_SYNC_S = 30e-6
#: The trainer's diff reads its shard a chunk at a time (lora_stream.element_diff.DIFF_CHUNK_BYTES).
DIFF_CHUNK_BYTES = 4 * 2**20
#: Kernels per chunk of the diff: cast, compare, nonzero, the values' gather, the write over the baseline, and NH's
#: passes (lora_stream.fingerprint: about six torch ops over the chunk's words).
DIFF_KERNELS = 11
#: Bytes each element of the shard costs the diff in device memory traffic: read the parameter (2: bf16 under
#: ZeRO-3's mixed precision), read and write the baseline (2 + 2), NH's passes over the chunk's words (about 6 x 2,
#: mostly from cache on a GPU: counted in full, an upper bound).
DIFF_BYTES_PER_ELEMENT = 2 + 2 + 2 + 12
#: Bytes that travel per changed element: a bf16 value and an int32 index.
CHANGED_BYTES = 2 + 4

#: Peers' published element-sync figures (their hardware and models), beside the projections.
PEERS = [
    {"system": "verl delta_sharded", "model": "Qwen2.5-72B", "setup": "H100, FSDP", "element": "12.0-13.0 s",
     "full": "28.5-29.1 s", "ratio": "0.43x"},
    {"system": "verl delta_sharded", "model": "Llama-3-8B (TorchTitan)", "setup": "H100", "element": "3.3 s",
     "full": "34.3 s", "ratio": "0.10x"},
    {"system": "verl delta_sharded", "model": "Qwen3-0.6B", "setup": "H100, one node, NVLink", "element": "0.59 s",
     "full": "0.61 s", "ratio": "0.97x"},
    {"system": "TRL AsyncGRPO", "model": "(blog)", "setup": "H100, vLLM server", "element": "paused 1.1 s of 9.4 s",
     "full": "-", "ratio": "-"},
]  # fmt: skip


@dataclass
class ElementPrediction:
    """One element sync, per stage (seconds), with the pause it causes and each engine worker's memory for it."""

    stages: dict[str, float]
    seconds: float
    paused: float
    sent_bytes: float
    engine_host_bytes: float


def predict_elements(
    shape: ModelShape, s: Setup, r: Rates, fraction: float, path: Path_, route: Route
) -> ElementPrediction:
    """An element sync of ``shape`` with ``fraction`` of its served elements changed, on ``r``'s nodes.

    ``s.world`` ZeRO-3 ranks each read their shard once on the device; the ranks all-gather the encoded changes (two
    all-gathers: sizes, then bytes); a server route sends them from rank 0 to each of ``s.replicas`` engines over
    the NIC (colocated: each rank hands them to its own engine, a host-to-device copy). Each engine worker holds
    ``1 / s.engine_tp`` of the model and applies its share of the changes by ``path``; colocated, the changes reach it
    as one host-to-device copy (the same device as the rank's).
    """
    n = param_count(shape)
    world, tp = s.world, max(1, s.engine_tp)
    shard = n / world
    changed = fraction * n
    payload = changed * CHANGED_BYTES
    stages: dict[str, float] = {}
    # Trainer, each rank in parallel: one pass over its shard a chunk at a time, on the device.
    chunks = math.ceil(shard * 2 / DIFF_CHUNK_BYTES)
    stages["trainer diff"] = shard * DIFF_BYTES_PER_ELEMENT / r.copy_bps + chunks * (
        DIFF_KERNELS * LAUNCH_S + HOST_SYNC_S
    )
    stages["changes to host"] = fraction * shard * CHANGED_BYTES / PCIE_BPS
    inter = r.ag_busbw_inter is not None and world > r.gpus_per_node
    busbw = (r.ag_busbw_inter if inter else r.ag_busbw) or r.ag_busbw
    lat = (r.ag_latency_inter if inter else r.ag_latency) or r.ag_latency
    stages["exchange"] = 2 * lat + payload * (world - 1) / world / busbw + 4 * r.ar_latency  # and the agreements
    if route == "server":
        # As a full sync's bytes: one broadcast from rank 0 to every engine worker (cost_model.predict), and the
        # HTTP round trips of a server sync.
        stages["send"] = payload / r.send_bps + r.send_latency + r.fixed_server + r.fixed_pause
    worker_elements = n / tp
    worker_changed = changed / tp
    checked = path != "in place, O(k) proof"
    if checked:  # the pre-flight's check of the engine's state: a read of its weights, before the pause
        stages["state check (pre-flight)"] = worker_elements * 2 / r.copy_bps
    tensors = 7 * shape.layers + 3  # checkpoint tensors a dense Llama holds that an element sync touches
    apply: dict[str, float] = {}
    if checked:  # the reload bracket's check, the last moment before a byte is written: under the pause
        apply["state check (bracket)"] = worker_elements * 2 / r.copy_bps
    if path == "rebuild":
        host = HOST_THREADS
        apply["decode and scatter (host)"] = worker_changed * HOST["decode_scatter_s_per_changed"] / host
        apply["rebuild touched tensors (host)"] = worker_elements * HOST["clone_s_per_element"] / host
        apply["NH of rebuilt tensors (host)"] = worker_elements * HOST["nh_s_per_element"] / host
        apply["rebuilt tensors to device"] = worker_elements * 2 / PCIE_BPS
        apply["reload (load_weights)"] = worker_elements * 2 / r.load_bps + tensors * r.load_per_tensor
        apply["state digest (commit's record)"] = worker_elements * 2 / r.copy_bps
        host_bytes = worker_elements * 2
    else:
        apply["changes to device"] = worker_changed * CHANGED_BYTES / PCIE_BPS
        # Keep the old values, then write the new: index_select and index_copy_, O(k), a kernel each per tensor.
        apply["index_copy_ (old kept)"] = worker_changed * 2 * 3 / r.copy_bps + tensors * 2 * LAUNCH_S
        if path == "in place":
            apply["proof: one read of the served bytes"] = worker_elements * 2 / r.copy_bps
            apply["state digest (commit's record)"] = worker_elements * 2 / r.copy_bps
        else:
            apply["proof: O(k) update"] = worker_changed * 2 * 4 / r.copy_bps + tensors * LAUNCH_S
            apply["state digest (O(k) update)"] = worker_changed * 2 * 2 / r.copy_bps + tensors * LAUNCH_S
        host_bytes = worker_changed * CHANGED_BYTES
    stages.update(apply)
    vote = 2 * r.ar_latency + (r.fixed_pause if route == "server" else 0.0)
    stages["vote and commit"] = vote
    total = sum(stages.values())
    paused = sum(apply.values()) + vote
    return ElementPrediction(stages, total, paused, payload, host_bytes)


def project(gpu: str, fractions: list[float]) -> list[dict[str, Any]]:
    """Llama-3-8B and Llama-3-70B on ``gpu`` nodes (the full-sync projections' scenarios), each route, fraction and
    path, beside the full sync of the same setup."""
    r = GPU_PROFILES[gpu]
    rows = []
    for name, world, tp, replicas in SCENARIOS:
        if name not in ("Llama-3-8B", "Llama-3-70B"):
            continue
        shape = MODELS[name]
        base = Setup(
            world=world, sharding="zero3", engine_tp=tp, replicas=replicas, backend="nccl", lora_targets="none"
        )
        for route in ("server", "colocated"):
            full = predict(shape, dataclasses.replace(base, sink=route), r)
            # A full sync pauses generation for all of it into a server (the gather, the send, the load); colocated,
            # the engine shares the rank's device, so the whole sync blocks it.
            for fraction in fractions:
                for path in PATHS:
                    el = predict_elements(shape, base, r, fraction, path, route)  # type: ignore[arg-type]
                    rows.append(
                        {
                            "gpu": gpu,
                            "model": name,
                            "trainer": f"ZeRO-3 x{world}",
                            "engine": f"TP{tp} x{replicas}",
                            "route": route,
                            "fraction": fraction,
                            "path": path,
                            "element_s": el.seconds,
                            "full_s": full.seconds,
                            "x_full": el.seconds / full.seconds,
                            "paused_s": el.paused,
                            "x_full_pause": el.paused / full.seconds,
                            "sent_gb": el.sent_bytes / GB,
                            "full_sent_gb": full.out_bytes / GB,
                            "engine_host_gb_per_worker": el.engine_host_bytes / GB,
                            "stages": el.stages,
                            "full_stages": full.stages,
                        }
                    )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table docs/performance.md shows."""
    out = [
        "| model | route | changed | path | element s | full s | x full | paused s (x full) | engine host GB/worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rows:
        out.append(
            f"| {p['model']} | {p['route']} | {p['fraction']:.1%} | {p['path']} | {p['element_s']:.3f} | "
            f"{p['full_s']:.3f} | {p['x_full']:.2f} | {p['paused_s']:.3f} ({p['x_full_pause']:.2f}) | "
            f"{p['engine_host_gb_per_worker']:.3g} |"
        )
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", default="H100", choices=sorted(GPU_PROFILES))
    ap.add_argument("--fractions", default="0.011,0.07", help="changed fractions, comma-separated")
    ap.add_argument("--out", default=str(RESULTS / "cost_elements.json"))
    args = ap.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    rows = project(args.gpu, fractions)
    print(f"element syncs projected on {args.gpu} nodes (ASSUMED GPU rates; host rates measured here), seconds:")
    print(markdown(rows))
    print("where an element sync's time goes (the first fraction), seconds:")
    for p in rows:
        if p["fraction"] == fractions[0]:
            stages = ", ".join(f"{k} {v:.4f}" for k, v in p["stages"].items())
            print(f"  {p['model']:<12} {p['route']:<9} {p['path']:<21} {stages}")
    print("\npeers' published figures:")
    for peer in PEERS:
        print(f"  {peer['system']:<20} {peer['model']:<24} {peer['setup']:<26} {peer['element']} vs {peer['full']}"
              f" ({peer['ratio']})")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "gpu": args.gpu,
                "gpu_profile": dataclasses.asdict(GPU_PROFILES[args.gpu]),
                "host_rates_measured_here": HOST,
                "host_threads": HOST_THREADS,
                "pcie_bps_assumed": PCIE_BPS,
                "projections": rows,
                "peers": PEERS,
            },
            indent=1,
        )
    )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
