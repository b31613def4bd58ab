"""What re-checking the plan costs per pass: ``ParamStream.check_plan()`` against the pass itself.

    python3 -m nox -s bench -- recheck        # or, inside the stack: python benchmarks/bench_recheck.py

Every pass (and every sink's pre-flight) reads again what the plan read from the model (adapter state, structure,
parameter objects and shapes; :mod:`lora_stream.witness`). Its cost grows with the number of modules, not with
their size, so the model here has real depth (``--layers``, LoRA on every linear layer) and small matrices, which
makes the ratio to a pass an upper bound. Reports the facts checked, the median check time, and a pass's median
time, interleaved. Writes benchmarks/results/recheck.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import interleave, median_seconds, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results" / "recheck.json"))
    args = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lora_stream import ParamStream

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    model = get_peft_model(
        LlamaForCausalLM(config), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False)
    )
    stream = ParamStream(model, group_by="layer")
    facts = len(stream._witness)

    def ten_checks(_: int) -> None:
        for _ in range(10):
            stream.check_plan()

    def one_pass(_: int) -> None:
        for _ in stream:  # includes one check
            pass

    runs = interleave(args.rounds, {"check": ten_checks, "pass": one_pass})
    check, pass_s = statistics.median(s.seconds / 10 for s in runs["check"]), median_seconds(runs["pass"])
    modules = sum(1 for _ in model.modules())
    print(f"\nmodel: {args.layers} layers, hidden {args.hidden}, LoRA r=8 on every linear layer: {modules} modules")
    print(f"  facts re-checked per pass: {facts}")
    print(f"  check_plan():  {check * 1e3:.2f} ms  ({check / facts * 1e6:.2f} us per fact)")
    print(f"  one pass:      {pass_s * 1e3:.1f} ms  (the check is {check / pass_s:.2%} of it)")
    write_json(args.out, {"args": vars(args), "modules": modules, "facts": facts, "check_s": check, "pass_s": pass_s})


if __name__ == "__main__":
    main()
