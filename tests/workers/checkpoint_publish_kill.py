"""Saves over a checkpoint and SIGKILLs itself at a named publish step, once per request, without re-importing torch.

Usage: checkpoint_publish_kill.py REF

Builds the "new" model, saves it normally into REF (the reference the test compares against) and prints READY.
Then, for each line ``{"out": DIR, "step": STEP, "fallback": BOOL}`` read from stdin, forks a child that saves the
same model over DIR (``overwrite=True``, renameat2 disabled by ``LORA_STREAM_NO_RENAME_EXCHANGE=1`` when
``fallback``) and sends itself SIGKILL from ``SafetensorsSink.on_publish`` when the step is STEP; the parent prints
``RESULT {"signal": N, "code": M}`` for how the child ended. The fork keeps each kill a real, separate process that
dies without any cleanup, while the imports are paid once. The process is single-threaded when it forks.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback

import torch
from helpers import lora, report, tiny_llama

from lora_stream import ParamStream, SafetensorsSink
from lora_stream.sinks.durable_files import NO_RENAME_EXCHANGE_ENV

SHARD = 20_000


def save_killed_at(out: str, step: str, fallback: bool) -> None:
    if fallback:
        os.environ[NO_RENAME_EXCHANGE_ENV] = "1"
    else:
        os.environ.pop(NO_RENAME_EXCHANGE_ENV, None)

    def hook(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)

    sink = SafetensorsSink(out, max_shard_size=SHARD, overwrite=True, progress=False)
    sink.on_publish = hook
    sink.sync(ParamStream(model))


torch.set_num_threads(1)
model = lora(tiny_llama(seed=13), target_modules="all-linear", seed=14)
SafetensorsSink(sys.argv[1], max_shard_size=SHARD, progress=False).sync(ParamStream(model))
print("READY", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            save_killed_at(request["out"], request["step"], request["fallback"])
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(3)  # the step never came: the test sees code 3, not a kill
    _, status = os.waitpid(pid, 0)
    report(
        signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
        code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
    )
