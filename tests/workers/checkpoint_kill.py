"""Saves a checkpoint slowly over OUT (overwrite=True) and prints WRITING once shards are being written, so that
the test can SIGKILL it in the middle. Usage: checkpoint_kill.py OUT"""

from __future__ import annotations

import sys
import time

from helpers import lora, tiny_llama

from lora_stream import ParamStream, SafetensorsSink

written: list[str] = []


def slow(name: str) -> None:
    written.append(name)
    if len(written) == 3:
        print("WRITING", flush=True)
    time.sleep(0.2)


sink = SafetensorsSink(sys.argv[1], max_shard_size=20_000, overwrite=True)
sink.on_tensor = slow
sink.sync(ParamStream(lora(tiny_llama(layers=4), target_modules="all-linear")))
print("FINISHED (should have been killed)", flush=True)
