"""GRPO with LoRA in TRL, its vLLM weight sync through lora_stream: the one line is marked below.

Runs on a CPU with the test stack (``python3 -m nox -s example``): a tiny random Llama-shaped model and a
word-level tokenizer are built here, vLLM runs colocated in this process, 3 optimizer steps. Prints one line per
sync (the ``SyncRecord``) and the hook's records at the end.

    python examples/grpo_trl.py              # the hook on
    python examples/grpo_trl.py --trl-sync   # TRL's own sync, for comparison
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_model(path: str) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1000)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def reward(completions: list[str], **_: object) -> list[float]:
    """Prefers completions whose token ids sum to a multiple of 97, a little."""
    return [float(sum(int(t[1:]) for t in c.split() if t[1:].isdigit()) % 97) / 97 for c in completions]


def main() -> None:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import lora_stream.integrations.trl

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lora_stream").setLevel(logging.INFO)
    workdir = tempfile.mkdtemp(prefix="grpo_trl_")
    path = os.path.join(workdir, "model")
    tiny_model(path)
    args = GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        use_cpu=True,
        use_vllm=True,
        vllm_mode="colocate",
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
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"t{i} t{i + 7} t{i + 3}" for i in range(3, 43)]}),
        processing_class=AutoTokenizer.from_pretrained(path),
        peft_config=LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"),
    )
    if "--trl-sync" not in sys.argv:
        hook = lora_stream.integrations.trl.use_lora_stream(trainer)  # <- the one line
    trainer.train()
    if "--trl-sync" not in sys.argv:
        for i, record in enumerate(hook.records):
            print(
                f"sync {i}: {record.tensors} tensors, {record.bytes / 2**20:.2f} MiB in {record.groups} groups, "
                f"{record.seconds:.3f} s, peak gathered {record.peak_gathered_bytes / 2**20:.2f} MiB"
            )


if __name__ == "__main__":
    main()
