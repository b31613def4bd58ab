"""GRPO with LoRA in TRL, its vLLM weight sync through lora_stream: the one change is marked below.

Runs on a CPU with the test stack (``python3 -m nox -s example``): a tiny random Llama-shaped model and a
word-level tokenizer are built here, vLLM runs colocated in this process, 3 optimizer steps. lora_stream logs one
line per sync (the ``SyncRecord``); the hook's records are printed at the end.

    python examples/grpo_trl.py              # the builder: GRPOTrainer(...) becomes use_lora_stream(GRPOTrainer)(...)
    python examples/grpo_trl.py --adapter    # adapter sync: only the LoRA factors, into vLLM's LoRA manager
    python examples/grpo_trl.py --full       # full fine-tuning: element syncs, each one verified
    python examples/grpo_trl.py --trl-sync   # TRL's own sync, for comparison
    python examples/grpo_trl.py --model DIR --server http://127.0.0.1:8000   # server mode (docs/trl.md)
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_model import write_tiny_model


def reward(completions: list[str], **_: object) -> list[float]:
    """Prefers completions whose token ids sum to a multiple of 97, a little."""
    return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) / 97 for c in completions]


def option(flag: str) -> str | None:
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else None


def main() -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    workdir = tempfile.mkdtemp(prefix="grpo_trl_")
    model_dir = option("--model") or write_tiny_model(os.path.join(workdir, "model"))
    server_url = option("--server")  # a vLLM server started on model_dir, as docs/trl.md shows
    dataset = Dataset.from_dict({"prompt": [f"t{i} t{i + 7} t{i + 3}" for i in range(3, 43)]})

    # --8<-- [start:config]
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        use_cpu=True,
        use_vllm=True,
        vllm_mode="server" if server_url else "colocate",
        vllm_server_base_url=server_url,  # None in colocate mode
        vllm_gpu_memory_utilization=0.5,
        vllm_max_model_length=128,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    peft_config = LoraConfig(r=4, lora_alpha=16, target_modules="all-linear")
    # --8<-- [end:config]

    if "--trl-sync" in sys.argv:
        # --8<-- [start:trl]
        trainer = GRPOTrainer(
            model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
        )
        trainer.train()
        # --8<-- [end:trl]
        return
    if "--full" in sys.argv:
        # --8<-- [start:full]
        from lora_stream.integrations.trl import use_lora_stream

        # Full fine-tuning: no peft_config, and a step small enough that most bfloat16 values stay. Each sync sends
        # only the elements that changed (in the engine's dtype) and checks the engine against the trainer's forward.
        args.learning_rate = 2e-5
        trainer = use_lora_stream(GRPOTrainer, sink_options={"elements": True, "verify": True})(
            model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset
        )
        trainer.train()
        # --8<-- [end:full]
    elif "--adapter" in sys.argv:
        # --8<-- [start:adapter]
        from lora_stream.integrations.trl import use_lora_stream

        # Only the LoRA factors, every step; in colocate mode TRL's engine is built with LoRA (max_lora_rank 8 here)
        trainer = use_lora_stream(GRPOTrainer, adapter=True, lora_name="policy")(
            model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
        )
        trainer.train()
        # --8<-- [end:adapter]
    else:
        # --8<-- [start:trainer]
        from lora_stream.integrations.trl import use_lora_stream

        trainer = use_lora_stream(GRPOTrainer)(  # <- the one change: was GRPOTrainer(...)
            model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
        )
        trainer.train()
        # --8<-- [end:trainer]
    for i, record in enumerate(trainer.lora_stream.records):
        print(
            f"sync {i}: {record.tensors} tensors, {record.bytes / 2**20:.2f} MiB in {record.groups} groups, "
            f"{record.seconds:.3f} s, peak gathered {record.peak_gathered_bytes / 2**20:.2f} MiB"
        )
        if record.elements.get("tensors"):
            print(f"  elements: {record.elements['tensors']} tensors, {record.element_fraction:.2%} changed")
        if record.verification is not None:
            check = record.verification
            print(f"  verified: max |diff| {check.max_abs_diff:.4f} <= {check.tolerance:.4f}")


if __name__ == "__main__":
    main()
