"""Draw the documentation's benchmark plots from the benchmarks' JSON: ``python3 -m nox -s plots``.

Reads benchmarks/results/depth.json (``nox -s bench -- depth``) and benchmarks/results/adapter.json
(``nox -s bench -- adapter``) and writes docs/images/*.png, plus docs/images/plot-data.json: the numbers drawn, so
a plot can be checked (or redrawn with ``--data docs/images/plot-data.json``) without rerunning the benchmarks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
IMAGES = HERE.parent / "docs" / "images"
MiB = 2**20
COLORS = {"whole": "#c0392b", "stream": "#2471a3", "adapter": "#27ae60"}
MACHINE = "2 CPU ranks over gloo on a 2-core machine"


def collect(results: Path) -> dict:
    """The numbers the plots draw, from the benchmarks' result files (rank 0's rows)."""
    depth = json.loads((results / "depth.json").read_text())
    adapter = json.loads((results / "adapter.json").read_text())
    rows = [r for r in depth["rows"] if r["rank"] == 0]
    deepest = max(r["layers"] for r in rows)
    trace_layers = 16 if any(r["layers"] == 16 for r in rows) else deepest
    data: dict = {"depth": [], "trace": {}, "adapter": {}}
    for r in rows:
        key = "whole" if r["variant"] == "whole_gather" else "stream"
        data["depth"].append(
            {
                "variant": key,
                "layers": r["layers"],
                "model_mib": r["model_bytes"] / MiB,
                "median_sync_s": r["median_sync_s"],
                "peak_gathered_mib": r["peak_gathered_bytes"] / MiB,
                "rss_growth_mib": r["rss_growth_bytes"] / MiB,
            }
        )
        if r["layers"] == trace_layers:
            data["trace"][key] = {
                "layers": r["layers"],
                "model_mib": r["model_bytes"] / MiB,
                "sync_s": r["trace_sync_s"],
                "syncs": r["syncs"],
                "t_s": [t - 0.05 for t, _ in r["rss_trace"]],  # the window starts 50 ms before the sync
                "rss_mib": [b / MiB for _, b in r["rss_trace"]],
            }
    trainer = {r["variant"]: r for r in adapter["trainer"] if r["rank"] == 0}
    vllm = {r["mode"]: r for r in adapter["vllm"]}
    merged, lora = trainer["lora_stream budget"], trainer["adapter"]
    data["adapter"] = {
        "model_mib": merged["model_bytes"] / MiB,
        "trainer_sync_s": {"merged": merged["median_sync_s"], "adapter": lora["median_sync_s"]},
        "bytes_mib": {"merged": merged["bytes_moved"] / MiB, "adapter": lora["bytes_moved"] / MiB},
        "vllm_sync_s": {"merged": vllm["merged"]["median_sync_s"], "adapter": vllm["adapter"]["median_sync_s"]},
        "tokens_per_s": {"merged": vllm["merged"]["tokens_per_s"], "adapter": vllm["adapter"]["tokens_per_s"]},
    }
    return data


def plot_trace(data: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = {"whole": "whole-model gather (TRL's ZeRO-3 sync)", "stream": "lora_stream, 32 MiB budget"}
    for key in ("whole", "stream"):
        tr = data["trace"][key]
        ax.plot(tr["t_s"], tr["rss_mib"], color=COLORS[key], label=f"{labels[key]}: sync {tr['sync_s']:.2f} s")
        ax.axvline(tr["sync_s"], color=COLORS[key], linestyle=":", linewidth=1)
    model = data["trace"]["whole"]["model_mib"]
    ax.axhline(model, color="grey", linestyle="--", linewidth=1, label=f"model size ({model:.0f} MiB bf16)")
    ax.set_xlabel("time since the sync started (s); dotted: the sync ended")
    ax.set_ylabel("process RSS above its level before the first sync (MiB)")
    ax.set_title(f"Memory of one trainer rank during one sync ({data['trace']['whole']['layers']} layers, ZeRO-3)")
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_ylim(bottom=0)
    fig.text(
        0.01,
        0.01,
        f"The last of {data['trace']['whole'].get('syncs', 5)} syncs; RSS sampled every 2 ms on rank 0; {MACHINE}; "
        "benchmarks/bench_depth.py",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_depth(data: dict, out: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    labels = {"whole": "whole-model gather", "stream": "lora_stream, 32 MiB budget"}
    for key in ("whole", "stream"):
        pts = sorted((p for p in data["depth"] if p["variant"] == key), key=lambda p: p["layers"])
        layers = [p["layers"] for p in pts]
        left.plot(layers, [p["median_sync_s"] for p in pts], "o-", color=COLORS[key], label=labels[key])
        right.plot(
            layers, [p["rss_growth_mib"] for p in pts], "o-", color=COLORS[key], label=f"{labels[key]}: RSS growth"
        )
        right.plot(
            layers,
            [p["peak_gathered_mib"] for p in pts],
            "s--",
            color=COLORS[key],
            alpha=0.6,
            label=f"{labels[key]}: peak gathered",
        )
    pts = sorted((p for p in data["depth"] if p["variant"] == "whole"), key=lambda p: p["layers"])
    ticks = [f"{p['layers']}\n{p['model_mib']:.0f} MiB" for p in pts]
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([p["layers"] for p in pts], ticks)
        ax.minorticks_off()
        ax.set_xlabel("decoder layers, log scale (model size, bf16)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    left.set_ylabel("median sync time (s)")
    left.set_title("Sync time against depth")
    right.set_ylabel("MiB per rank")
    right.set_title("Memory against depth")
    fig.text(0.01, 0.01, f"ZeRO-3, LoRA r=16 on all linear layers; {MACHINE}; benchmarks/bench_depth.py", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_adapter(data: dict, out: Path) -> None:
    a = data["adapter"]
    panels = [
        ("trainer_sync_s", "trainer side, ZeRO-3:\nmedian sync (s)"),
        ("bytes_mib", "bytes moved per sync (MiB)"),
        ("vllm_sync_s", "into vLLM, in-process:\nmedian sync incl. load (s)"),
        ("tokens_per_s", "vLLM generation through\nwhat was synced (tokens/s)"),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(11, 3.8))
    for ax, (key, title) in zip(axes, panels):
        values = [a[key]["merged"], a[key]["adapter"]]
        bars = ax.bar(["merged", "adapter"], values, color=[COLORS["stream"], COLORS["adapter"]])
        ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.margins(y=0.15)
    fig.suptitle(f"Adapter sync against merged sync ({a['model_mib']:.0f} MiB bf16 model, LoRA r=16 all-linear)")
    fig.text(
        0.01,
        0.01,
        f"{MACHINE}; vLLM CPU (bf16); benchmarks/bench_adapter.py; lower is better except tokens/s",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=str(HERE / "results"), help="where the benchmarks wrote their JSON")
    ap.add_argument("--data", help="redraw from a plot-data.json written before, instead of --results")
    ap.add_argument("--out", default=str(IMAGES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = json.loads(Path(args.data).read_text()) if args.data else collect(Path(args.results))
    if not args.data:
        (out / "plot-data.json").write_text(json.dumps(data, indent=1))
    plot_trace(data, out / "rss_over_sync.png")
    plot_depth(data, out / "sync_vs_depth.png")
    plot_adapter(data, out / "adapter_vs_merged.png")
    print(f"wrote {', '.join(sorted(p.name for p in out.glob('*.png')))} to {out}")


if __name__ == "__main__":
    main()
