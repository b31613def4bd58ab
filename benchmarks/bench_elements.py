"""Element syncs against full syncs, full fine-tuning: float32 master weights trained with AdamW, served as bfloat16.

    python3 -m nox -s bench -- elements        # or, inside the stack: python benchmarks/bench_elements.py

A random Llama (4 layers, hidden 512, vocabulary 4096 by default: 17M parameters, 32.5 MiB as bfloat16) saved as a
bfloat16 checkpoint. The trainer loads it as float32 (its master weights), trains every parameter with AdamW on
random token batches, and streams ``ParamStream(model, dtype=torch.bfloat16)``. At each learning rate (``--lrs``),
``--warmup`` steps then ``--steps`` measured ones; after every step the same weights are synced by an
``elements=True`` sink and by a full one (``skip_unchanged=False``). Three cases:

* ``server``: 2 ZeRO-3 ranks (gloo) feed two vLLM servers (``--dtype bfloat16``, gloo weight transfer) that hold the
  same weights, one per sink: a full sink's write would make the element sink's next sync full, so each sink writes
  a server of its own; the two syncs of a step run in alternating order. After each learning rate, what the two
  servers serve is compared (greedy tokens and logprobs, ``==``).
* ``colocated``: one process, one in-process ``vllm.LLM`` (bfloat16, eager) fed by both sinks in turn: after each
  step the element sync, then the full sync of the same weights, then one more element-sink sync with nothing trained
  in between (full: another sink wrote the engine) that re-establishes its baseline for the next step; only the first
  two are compared.
* ``lora``: in the same process, LoRA r=16 on every linear layer, merged, synced into the same engine by an
  ``elements=True`` sink: what its record says (merged outputs are computed from gathered tensors, so none travels as
  elements), and how many merged bfloat16 elements changed per step (consecutive merged outputs compared bit for bit
  in the worker), with the bytes the element codec would have needed for them.

Reported per case and learning rate (medians over the measured steps; seconds the slowest rank's): the changed
fraction (every element compared by the worker itself, bit for bit, against the previous step), bytes sent by the
element sync and by the full one, the element bytes against the changed elements' values plus a 4-byte index each,
time and its ratio, the trainer's diff seconds, the server workers' load seconds, how long each kept the servers'
generation paused (``stages["paused_s"]``), the trainer's peak gathered bytes,
the element baseline in host memory per rank, the encodings used, and whether both engines served the same. Also the
trainer's element path on one thread (cast, compare, encode, fingerprint) as a floor. ``--cases`` picks ``server``
and/or ``colocated`` (which includes ``lora``). Writes benchmarks/results/elements.json (a run: about 2.5 minutes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    Col,
    MiB,
    add_model_args,
    format_table,
    interleave,
    llama_config,
    median_seconds,
    run_ranks,
    vllm_servers,
    write_json,
)

COLUMNS = (
    Col("case", "<9"),
    Col("lr", "<6"),
    Col("changed", ">8.2%"),
    Col("sent MiB el/full", ">17"),
    Col("el/(val+idx)", ">12.2f"),
    Col("s elements", ">10.3f"),
    Col("s full", ">7.3f"),
    Col("x full", ">6.2f"),
    Col("diff s", ">6.3f"),
    Col("engine s el/full", ">16"),
    Col("paused s el/full", ">16"),
    Col("gathered MiB el/full", ">21"),
    Col("baseline MiB/rank", ">17.1f"),
    Col("encodings", "<28"),
    Col("served ==", "<9"),
)
LORA_COLUMNS = (
    Col("lr", "<6"),
    Col("merged changed", ">14.2%"),
    Col("sent MiB", ">9.1f"),
    Col("as elements", ">11"),
    Col("would-be element MiB", ">20.2f"),
    Col("factors MiB", ">11.2f"),
    Col("s", ">6.3f"),
    Col("refused", "<60"),
)
#: What one changed element costs at the least, carried as itself: its bfloat16 value and an int32 index.
VALUE_AND_INDEX = 2 + 4


def med(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(float(r[key] or 0) for r in rows))


def summarize(case: str, ranks: list[list[dict[str, Any]]], equal: dict[str, bool]) -> list[dict[str, Any]]:
    """Per learning rate: the element and full syncs of the measured steps, medians; seconds the slowest rank's."""
    out = []
    lrs = sorted({r["lr"] for r in ranks[0] if r["lr"] > 0})
    for lr in lrs:

        def of(kind: str, rank: int = 0, lr: float = lr) -> list[dict[str, Any]]:
            return [r for r in ranks[rank] if r["kind"] == kind and r["lr"] == lr and not r["warmup"]]

        el, full = of("elements"), of("full")
        seconds = {k: max(med(of(k, q), "seconds") for q in range(len(ranks))) for k in ("elements", "full")}
        encodings: dict[str, int] = {}
        for r in el:
            for k, v in r["elements"].get("encodings", {}).items():
                encodings[k] = encodings.get(k, 0) + v
        changed = [r["changed"] for r in el]
        el_bytes = [r["elements"].get("bytes", 0) for r in el]
        out.append(
            {
                "case": case,
                "lr": lr,
                "steps": len(el),
                "changed_fraction": statistics.median(r["changed"] / r["compared"] for r in el),
                "record_element_fraction": med(el, "element_fraction"),
                "element_tensors": med(el, "tensors"),
                "elements_full_because": sorted({str(r["full_because"]) for r in el if r["full_because"]}),
                "elements_refused": sorted(
                    {str(r["elements"].get("refused")) for r in el if r["elements"].get("refused")}
                ),
                "sent_bytes_elements": med(el, "bytes"),
                "sent_bytes_full": med(full, "bytes"),
                "element_bytes": statistics.median(el_bytes),
                "element_over_value_index": statistics.median(
                    b / max(1, c * VALUE_AND_INDEX) for b, c in zip(el_bytes, changed, strict=True)
                ),
                "seconds_elements": seconds["elements"],
                "seconds_full": seconds["full"],
                "x_full": seconds["elements"] / seconds["full"],
                "peak_gathered_bytes_elements": max(
                    med(of("elements", q), "peak_gathered_bytes") for q in range(len(ranks))
                ),
                "peak_gathered_bytes_full": max(med(of("full", q), "peak_gathered_bytes") for q in range(len(ranks))),
                "gathered_bytes_elements": max(med(of("elements", q), "gathered_bytes") for q in range(len(ranks))),
                "baseline_bytes_per_rank": max(
                    med([{"b": r["elements"].get("baseline_bytes", 0)} for r in of("elements", q)], "b")
                    for q in range(len(ranks))
                ),
                "encodings": encodings,
                "served_equal": equal.get(str(lr)),
                "stages_elements": _worst([_median_stages(of("elements", q)) for q in range(len(ranks))]),
                "stages_full": _worst([_median_stages(of("full", q)) for q in range(len(ranks))]),
                "worker_elements": _median_dict([r["worker"] for r in el]),
                "worker_full": _median_dict([r["worker"] for r in full]),
            }
        )
    return out


def _median_dict(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for d in ds for k in d})
    return {k: statistics.median(float(d.get(k) or 0) for d in ds) for k in keys}


def _worst(ds: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the largest of the ranks' values (the slowest rank's seconds)."""
    return {k: max(d.get(k, 0.0) for d in ds) for k in sorted({k for d in ds for k in d})}


def _median_stages(rows: list[dict[str, Any]]) -> dict[str, float]:
    return _median_dict([r["stages"] for r in rows])


def summarize_lora(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for lr in sorted({r["lr"] for r in rows if r["lr"] > 0}):
        rs = [r for r in rows if r["lr"] == lr and not r["warmup"]]
        out.append(
            {
                "lr": lr,
                "steps": len(rs),
                "merged_changed_fraction": statistics.median(r["merged_changed"] / r["merged_elements"] for r in rs),
                "sent_bytes": med(rs, "bytes"),
                "element_tensors": med([{"t": r["elements"].get("tensors", 0)} for r in rs], "t"),
                "refused": sorted({str(r["elements"].get("refused")) for r in rs}),
                "full_because": sorted({str(r["full_because"]) for r in rs if r["full_because"]}),
                "merged_whole_bytes": med(rs, "merged_whole_bytes"),
                "would_be_element_bytes": med(rs, "would_be_element_bytes"),
                "factor_bytes": med(rs, "factor_bytes"),
                "seconds": med(rs, "seconds"),
                "peak_gathered_bytes": med(rs, "peak_gathered_bytes"),
            }
        )
    return out


def checkpoint(args: argparse.Namespace, path: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(args, max_position_embeddings=256)).to(torch.bfloat16).save_pretrained(path)


def worker_args(args: argparse.Namespace) -> list[str]:
    return [args.lrs, str(args.warmup), str(args.steps), str(args.batch), str(args.seq)]


#: ``--linear torch``: every Python process an engine runs in takes vLLM's torch-linear path for the CPU (what vLLM
#: does where oneDNN and sgl-kernel are unavailable), so that it serves every weight as loaded, as CUDA does.
TORCH_LINEAR = """\
try:
    import vllm._custom_ops as _ops
    import vllm.model_executor.layers.utils as _utils

    _ops._supports_onednn = False
    _utils.check_cpu_sgl_kernel = lambda *args: False
except Exception as exc:
    raise SystemExit(f"--linear torch could not select vLLM's torch-linear path: {exc}")
"""


def engine_env(args: argparse.Namespace, tmp: str) -> dict[str, str]:
    """The environment of the engines' processes (a ``sitecustomize`` that selects vLLM's torch-linear path)."""
    if args.linear == "default":
        return {}
    site = Path(tmp) / "torch-linear"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(TORCH_LINEAR)
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


def run_server(args: argparse.Namespace, path: str, tmp: str) -> dict[str, Any]:
    env = engine_env(args, tmp)
    with vllm_servers(path, 2, timeout=600, dtype="bfloat16", one_by_one=True, env=env) as [(_, url_e), (_, url_f)]:
        out = str(Path(tmp) / "server-out")
        cmd = [sys.executable, str(HERE / "elements_worker.py"), "server", path, url_e, url_f, out, *worker_args(args)]
        ranks = run_ranks(cmd, out, timeout=3600, failure="the server case failed:\n", tail=6000)
    return {"ranks": [r["rows"] for r in ranks], "served_equal": ranks[0]["served_equal"]}


def run_colocated(args: argparse.Namespace, path: str, tmp: str) -> dict[str, Any]:
    out = str(Path(tmp) / "colocated-out")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "TOKENIZERS_PARALLELISM": "false",
        **engine_env(args, tmp),
    }
    cmd = [sys.executable, str(HERE / "elements_worker.py"), "colocated", path, out, *worker_args(args), args.lora_lrs]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    if p.returncode:
        raise SystemExit(f"the colocated case failed:\n{p.stdout[-6000:]}")
    import json

    return json.loads(Path(f"{out}.json").read_text())


def engine_pair(r: dict[str, Any]) -> str:
    """The server worker's own seconds (load and finish) of the element and the full sync; '-' where the engine is
    in the trainer's process (its time is the sync's)."""
    el, full = r["worker_elements"], r["worker_full"]
    if not el:
        return "-"
    return f"{el.get('load_s', 0) + el.get('finish_s', 0):.3f} / {full.get('load_s', 0) + full.get('finish_s', 0):.3f}"


def paused_pair(r: dict[str, Any]) -> str:
    """How long the element and the full sync kept generation paused on the servers (the feeding rank's
    ``stages["paused_s"]``: its first /pause sent until its last /resume returned); '-' for an engine in the
    trainer's process, which generates nothing during any sync."""
    el, full = r["stages_elements"].get("paused_s"), r["stages_full"].get("paused_s")
    if el is None or full is None:
        return "-"
    return f"{el:.3f} / {full:.3f}"


def element_floor(args: argparse.Namespace, rounds: int = 5) -> dict[str, Any]:
    """What the trainer's part of an element sync costs at the least, per rank, one thread (as each rank runs): on a
    float32 shard of half the model's parameters, one AdamW-sized step (``lr * sign``) at the first learning rate,
    the cast to bfloat16, the bit comparison with the previous cast (and the changed indices), the encoding and the
    fingerprint of the new cast shard. Medians of ``rounds`` after a warm-up."""
    import torch
    from transformers import LlamaForCausalLM

    from lora_stream.element_codec import bits, encode
    from lora_stream.fingerprint import fingerprint

    with torch.device("meta"):
        n = sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters()) // 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=g) * 0.02
    old = master.to(torch.bfloat16)
    lr = float(args.lrs.split(",")[0])
    master += lr * torch.sign(torch.randn(n, generator=g))
    state: dict[str, Any] = {}
    fns = {
        "cast": lambda _: state.__setitem__("new", master.to(torch.bfloat16)),
        "compare": lambda _: state.__setitem__("index", (bits(state["new"]) != bits(old)).nonzero().reshape(-1)),
        "encode": lambda _: encode(state["new"], state["index"]),
        "fingerprint": lambda _: fingerprint(state["new"]),
    }
    runs = interleave(rounds + 1, fns)
    torch.set_num_threads(before)
    out: dict[str, Any] = {k: median_seconds(v[1:]) for k, v in runs.items()}
    out.update(elements=n, lr=lr, changed_fraction=state["index"].numel() / n)
    out["total"] = sum(out[k] for k in fns)
    return out


def mib_pair(a: float, b: float) -> str:
    return f"{a / MiB:.2f} / {b / MiB:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=4)
    ap.set_defaults(hidden=512, intermediate=1408, vocab=4096)
    ap.add_argument("--lrs", default="1e-6,3e-6,1e-5")
    ap.add_argument("--lora-lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--warmup", type=int, default=2, help="training steps per learning rate before those measured")
    ap.add_argument("--steps", type=int, default=5, help="measured steps per learning rate")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--cases", default="server,colocated")
    ap.add_argument(
        "--linear",
        choices=("default", "torch"),
        default="default",
        help="the engines' linear layers: vllm-cpu's default (oneDNN or sgl-kernel: served from packed copies) or "
        "vLLM's torch-linear path (served as loaded, as on CUDA: element syncs write them in place)",
    )
    ap.add_argument("--out", default=str(HERE / "results" / "elements.json"))
    args = ap.parse_args()
    start, load = time.monotonic(), os.getloadavg()[0]
    results: dict[str, Any] = {"floor": element_floor(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "ckpt")
        checkpoint(args, path)
        if "server" in args.cases:
            raw = run_server(args, path, tmp)
            results["server"] = summarize("server", raw["ranks"], raw["served_equal"])
            results["server_raw"] = raw
            print("  server: done", flush=True)
        if "colocated" in args.cases:
            raw = run_colocated(args, path, tmp)
            results["colocated"] = summarize("colocated", [raw["rows"]], raw["served_equal"])
            results["lora"] = summarize_lora(raw["lora"])
            results["colocated_raw"] = raw
            print("  colocated: done", flush=True)
    wall = time.monotonic() - start
    lines = []
    for case in ("server", "colocated"):
        for r in results.get(case, []):
            enc = ", ".join(f"{k} {v}" for k, v in sorted(r["encodings"].items())) or "-"
            lines.append(
                [
                    case,
                    f"{r['lr']:g}",
                    r["changed_fraction"],
                    mib_pair(r["sent_bytes_elements"], r["sent_bytes_full"]),
                    r["element_over_value_index"],
                    r["seconds_elements"],
                    r["seconds_full"],
                    r["x_full"],
                    r["stages_elements"].get("element_diff_s", 0.0),
                    engine_pair(r),
                    paused_pair(r),
                    mib_pair(r["peak_gathered_bytes_elements"], r["peak_gathered_bytes_full"]),
                    r["baseline_bytes_per_rank"] / MiB,
                    enc,
                    str(r["served_equal"]),
                ]
            )
    print(f"\nelement sync against full sync of the same weights, medians of {args.steps} steps per lr")
    print(format_table(COLUMNS, lines))
    if results.get("lora"):
        lora_lines = [
            [
                f"{r['lr']:g}",
                r["merged_changed_fraction"],
                r["sent_bytes"] / MiB,
                f"{r['element_tensors']:.0f}",
                r["would_be_element_bytes"] / MiB,
                r["factor_bytes"] / MiB,
                r["seconds"],
                "; ".join(r["refused"])[:60],
            ]
            for r in results["lora"]
        ]
        print("\nmerged LoRA r=16 (every linear layer), colocated, elements=True sink")
        print(format_table(LORA_COLUMNS, lora_lines))
    floor = results["floor"]
    print(
        f"\nthe trainer's element path at the least, per rank, one thread: {floor['elements'] / 1e6:.1f}M float32 "
        f"elements, an lr {floor['lr']:g} step ({floor['changed_fraction']:.2%} of the bfloat16 elements changed): "
        + ", ".join(f"{k} {floor[k]:.3f} s" for k in ("cast", "compare", "encode", "fingerprint", "total"))
    )
    print(f"\nwall {wall:.0f} s; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    meta = {"wall_s": wall, "load_start": load, "load_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    write_json(args.out, {"args": vars(args), "run": meta, **results})


if __name__ == "__main__":
    main()
