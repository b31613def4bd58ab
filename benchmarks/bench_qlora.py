"""QLoRA: what streaming a bitsandbytes-quantized base costs against a bf16 base of the same shape (CPU, one process).

Model: Llama-shaped (default 8 layers, hidden 1024, intermediate 2816, vocab 32000), LoRA r=16 on all linear layers,
adapter weights perturbed away from their initialisation. Each variant loads the same checkpoint in a fresh process
(so one variant's freed heap cannot flatter the next one's RSS), runs one untimed pass, then ``--syncs`` full passes,
copying every tensor into a preallocated bf16 destination (what a colocated engine holds anyway). RSS growth is the
peak during the timed passes minus the resident set before them.

Variants:
  bf16          bf16 base (the baseline of the ratios)
  nf4           4-bit nf4 with double quantization, dequantized block by block (lora_stream)
  nf4-packed    the same after an eval no-grad forward repacked the weights into bitsandbytes' CPU layout
  int8          LLM.int8() base
  nf4-peft      what in-place tools do instead: peft's merge_adapter() into the 4-bit layers (which re-quantizes),
                dequantize, unmerge_adapter(); its error is against lora_stream's exact merge

Writes benchmarks/results/qlora.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import Col, MiB, RssSampler, add_model_args, format_table, llama_config, rss, write_json  # noqa: E402

VARIANTS = ["bf16", "nf4", "nf4-packed", "int8", "nf4-peft"]
COLUMNS = (
    Col("variant", "<12"),
    Col("median sync", ">10.2f", "s"),
    Col("x bf16", ">7.2f"),
    Col("RSS growth", ">8.0f", "MiB"),
    Col("x bf16", ">7.2f"),
    Col("merge temps", ">8.1f", "MiB"),
    Col("streamed", ">6.0f", "MiB"),
    Col("max rel error vs exact", ">22"),
)


def build_checkpoint(args: argparse.Namespace, path: str) -> None:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config(args, max_position_embeddings=256)).to(torch.bfloat16).save_pretrained(path)


def load(variant: str, path: str):  # type: ignore[no-untyped-def]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if variant.startswith("nf4"):
        quant = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
    elif variant == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=quant, device_map="cpu" if quant else None
    )
    torch.manual_seed(1)
    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        for p in pm.parameters():
            if p.requires_grad:
                p.mul_(0.1)
    if variant == "nf4-packed":
        pm.eval()
        with torch.no_grad():
            pm(torch.tensor([[1, 2, 3, 4]]))
    return pm


def worker(variant: str, path: str, syncs: int, out: str) -> None:
    import torch

    from lora_stream import ParamStream

    torch.set_num_threads(1)
    pm = load(variant, path)
    stream = ParamStream(pm, dtype=torch.bfloat16, group_by="layer")
    # Written once (fill_, not empty/zeros, whose pages stay unmapped): resident before the baseline RSS is read.
    dest = {m.name: torch.empty(m.shape, dtype=torch.bfloat16).fill_(1) for m in stream.metadata()}
    exact = None
    times, error = [], None
    if variant == "nf4-peft":
        exact = {n: t.clone() for n, t in ParamStream(pm, dtype=torch.float32)}
    # One untimed sync first: a bf16 checkpoint is memory-mapped by from_pretrained, and its pages would otherwise
    # be counted as the first sync's growth.
    with stream.iter_groups() as groups:
        for names, tensors in groups:
            for n, t in zip(names, tensors):
                dest[n].copy_(t)
    start_rss = rss()
    sampler = RssSampler()
    sampler.start()
    for _ in range(syncs):
        t0 = time.perf_counter()
        if variant == "nf4-peft":
            error = peft_in_place(pm, dest, exact)
        else:
            with stream.iter_groups() as groups:
                for names, tensors in groups:
                    for n, t in zip(names, tensors):
                        dest[n].copy_(t)
        times.append(time.perf_counter() - t0)
    peak = sampler.stop()
    stats = stream.last_stats
    result = {
        "variant": variant,
        "median_sync_s": statistics.median(times),
        "rss_growth_bytes": peak - start_rss,
        "streamed_bytes": sum(t.numel() * 2 for t in dest.values()),
        "peak_temp_bytes": stats.peak_temp_bytes,
        "max_rel_error_vs_exact": error,
    }
    Path(out).write_text(json.dumps(result))


def peft_in_place(pm, dest, exact):  # type: ignore[no-untyped-def]
    """In-place tools: merge_adapter() re-quantizes the merged weight into the 4-bit layer; read it, unmerge."""
    from peft.utils.integrations import dequantize_bnb_weight

    pm.merge_adapter()
    worst = 0.0
    for name, module in pm.get_base_model().named_modules():
        if type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes"):
            w = dequantize_bnb_weight(module.weight, None)
            key = name.replace(".base_layer", "") + ".weight"
            dest[key].copy_(w)
            ref = exact[key]
            worst = max(worst, float((w.float() - ref).norm() / ref.norm()))
    pm.unmerge_adapter()
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=8)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "qlora.json"))
    ap.add_argument("--worker", nargs=4, metavar=("VARIANT", "PATH", "SYNCS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        variant, path, syncs, out = args.worker
        worker(variant, path, int(syncs), out)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        build_checkpoint(args, path)
        for variant in VARIANTS:
            out = os.path.join(tmp, f"{variant}.json")
            cmd = [sys.executable, __file__, "--worker", variant, path, str(args.syncs), out]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=3600)
            rows.append(json.loads(Path(out).read_text()))
    base = rows[0]
    lines = [
        [
            r["variant"],
            r["median_sync_s"],
            r["median_sync_s"] / base["median_sync_s"],
            r["rss_growth_bytes"] / MiB,
            r["rss_growth_bytes"] / max(base["rss_growth_bytes"], 1),
            r["peak_temp_bytes"] / MiB,
            r["streamed_bytes"] / MiB,
            "-" if r["max_rel_error_vs_exact"] is None else f"{r['max_rel_error_vs_exact']:.2e}",
        ]
        for r in rows
    ]
    print(format_table(COLUMNS, lines))
    write_json(args.out, {"args": vars(args), "rows": rows}, indent=2)


if __name__ == "__main__":
    main()
