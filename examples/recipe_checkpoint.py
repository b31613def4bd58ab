"""Recipe: save a merged Hugging Face checkpoint (LoRA merged in) from the trainer, without a full copy anywhere.

    python examples/tiny_model.py /tmp/tiny-llama
    python examples/recipe_checkpoint.py /tmp/tiny-llama /tmp/merged
    torchrun --nproc-per-node 2 ...      # under ZeRO-3 / FSDP: every rank calls save_merged, rank 0 writes

The directory holds sharded safetensors, the config and the tokenizer; transformers and vLLM load it as the base
model with the adapter merged in. It appears atomically: a crash never leaves a half-written checkpoint under the
final name.
"""

from __future__ import annotations

import sys

# --8<-- [start:save]
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_stream import save_merged

model_dir, out_dir = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = get_peft_model(
    AutoModelForCausalLM.from_pretrained(model_dir),
    LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),  # a non-zero adapter
)
# ... training ...
record = save_merged(model, out_dir, dtype=torch.bfloat16, max_shard_size="2GB", tokenizer=tokenizer, overwrite=True)
print(f"wrote {record.tensors} tensors, {record.bytes} bytes to {out_dir}")
# --8<-- [end:save]

# --8<-- [start:check]
merged = AutoModelForCausalLM.from_pretrained(out_dir)  # a plain transformers model: no peft needed to load it
expected = model.merge_and_unload()  # peft's own merge, in place, for the comparison only
for name, tensor in merged.state_dict().items():
    assert torch.equal(tensor, expected.state_dict()[name].to(torch.bfloat16)), name
print("the checkpoint equals peft's merge_and_unload(), rounded to bfloat16")
# --8<-- [end:check]
