"""TRL in one line: build a TRL trainer whose vLLM weight sync goes through lora_stream.

>>> trainer = use_lora_stream(GRPOTrainer)(
...     model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset, peft_config=peft_config
... )  # doctest: +SKIP
>>> trainer.train()

with ``args = GRPOConfig(use_vllm=True, ...)``, in colocate or server mode (examples/grpo_trl.py runs it). Given the
trainer's class, :func:`use_lora_stream` returns a builder that checks a server before TRL contacts it, builds the
trainer without TRL's own transfer group, and installs the hook (``trainer.lora_stream``). Given a trainer already
built, it installs the hook on it (``hook = use_lora_stream(trainer)``).

TRL's trainers that generate with vLLM (``GRPOTrainer``, ``RLOOTrainer``, ...) hold a ``VLLMGeneration`` as
``trainer.vllm_generation`` and call its ``sync_weights()`` whenever the step changed. TRL's own sync gathers every
parameter of a ZeRO-3 model at once, merges the adapter into the training weights in place and unmerges it again,
then hands vLLM one tensor at a time outside vLLM's reload bracket. :func:`use_lora_stream` replaces that one method
on that one object; everything else TRL does (when to sync, sleep mode, generation, the prefix cache) stays TRL's.

Why this shape and not a callback: TRL syncs from inside its generation step, not at a callback point, so a
``TrainerCallback`` could only add a second sync after TRL's own (the memory peak and the in-place merge would
remain). A subclass of ``GRPOTrainer`` would not reach users' own subclasses or the other trainers that share
``VLLMGeneration``. Replacing the instance's ``sync_weights`` is one line for every such trainer, and reversible.

The package, by what a reader looks for: :mod:`.install` (:func:`use_lora_stream`), :mod:`.hook` (what a sync does
while the hook is installed), :mod:`.server_check` (server mode's command and the check before TRL contacts the
server), :mod:`.builder` (building a trainer for the hook), :mod:`.guard` (the releases and trainers it accepts).
"""

from __future__ import annotations

from .builder import trl_vllm_with_lora, without_trl_transfer_group
from .guard import TESTED_TRL, UnsupportedTrlError
from .hook import TrlSyncHook
from .install import use_lora_stream
from .server_check import SERVER_FLAGS, SERVER_MODULE, server_command, trainer_address

__all__ = [
    "SERVER_FLAGS",
    "SERVER_MODULE",
    "TESTED_TRL",
    "TrlSyncHook",
    "UnsupportedTrlError",
    "trl_vllm_with_lora",
    "without_trl_transfer_group",
    "use_lora_stream",
    "server_command",
    "trainer_address",
]
