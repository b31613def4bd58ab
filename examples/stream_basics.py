"""The stream's API on a tiny random model, one process, no engine: what docs/usage.md shows, run.

python examples/stream_basics.py
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules="all-linear", init_lora_weights=False))

# --8<-- [start:one_line]
from lora_stream import stream_merged_params  # noqa: E402

with stream_merged_params(model) as weights:  # PeftModel or plain; DDP / DeepSpeed / FSDP / compiled / QLoRA
    for name, tensor in weights:  # names are the base model's Hugging Face names
        ...
# --8<-- [end:one_line]

# --8<-- [start:param_stream]
from lora_stream import ParamStream  # noqa: E402

stream = ParamStream(model, dtype=torch.bfloat16, group_by="layer")
stream.metadata()  # [ParamMeta(name, dtype, shape), ...]  -- no gather, no communication
stream.groups()  # [[names of group 0], [names of group 1], ...]
for names, tensors in stream.iter_groups():  # one batch per group
    ...
for name, tensor in stream:  # a fresh pass each time
    ...
stream.last_stats  # StreamStats(groups, tensors, bytes, computed, peak_gathered_bytes, peak_temp_bytes, seconds, ...)
# --8<-- [end:param_stream]
assert stream.last_stats is not None and stream.last_stats.complete
assert [m.name for m in stream.metadata()] == [n for group in stream.groups() for n in group]


class Engine:
    """Stands for an inference engine's loader."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        self.loaded.update((n, t.clone()) for n, t in zip(names, tensors))  # clone: a tensor is valid for its group


engine = Engine()
# --8<-- [start:with_pass]
with stream.iter_groups() as groups:  # or: with iter(stream) as weights / with stream_merged_params(m) as weights
    for names, tensors in groups:
        engine.load(names, tensors)  # if this raises, the other ranks are told before the error goes on
# --8<-- [end:with_pass]
assert len(engine.loaded) == len(stream.metadata())

# --8<-- [start:renames]
ParamStream(model, renames={"model.layers": "model.decoder.layers"})  # anchored prefixes, whole segments
ParamStream(model, renames=lambda name: name.replace(".mlp.", ".feed_forward.", 1))
# --8<-- [end:renames]
renamed = ParamStream(model, renames={"model.layers": "model.decoder.layers"}).metadata()
assert renamed[1].name.startswith("model.decoder.layers.0."), renamed[1]


class MyTrainerWrapper(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner


# --8<-- [start:wrapper]
from lora_stream import register_wrapper  # noqa: E402

register_wrapper(MyTrainerWrapper, "inner")  # drop the `inner.` segment when MyTrainerWrapper holds the model there
# --8<-- [end:wrapper]
wrapped = [m.name for m in ParamStream(MyTrainerWrapper(model)).metadata()]
assert wrapped == [m.name for m in ParamStream(model).metadata()]
print(f"ok: {len(wrapped)} tensors, {len(stream.groups())} layer groups")
