"""One rank of the verl benchmark (started by bench_verl.py in verl's environment; not meant to be run by hand).

Builds verl's FSDP engine through verl's config and ``model.external_lib`` (the test's ``build_engine``), then
times both exports on the same engine and weights, interleaved: lora_stream's (``engine.get_per_tensor_param()``)
and verl's own in-place merge (``FSDPEngineWithLMHead.get_per_tensor_param(engine)``). The consumer copies every
tensor into a preallocated bf16 destination, as an inference engine's load does.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent / "tests_verl" / "workers"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import RssSampler, add_model_args, llama_config, rss  # noqa: E402
from helpers import save_tokenizer  # noqa: E402
from verl_engine import build_engine, local_shards, perturb_adapters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_model_args(ap, layers=12)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--model-dtype", default="fp32")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    path = os.path.join(args.dir, "model")
    if dist.get_rank() == 0:
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(llama_config(args)).save_pretrained(path)
        save_tokenizer(path, vocab=args.vocab, pad_token="t3")
    dist.barrier()
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    engine = build_engine(
        path,
        "actor_rollout_ref.model.lora.merge=True",
        f"actor_rollout_ref.model.lora_rank={args.rank}",
        f"actor_rollout_ref.model.lora_alpha={2 * args.rank}",
        f"actor_rollout_ref.actor.fsdp_config.model_dtype={args.model_dtype}",
    )
    perturb_adapters(engine, seed=1)
    exports = {
        "lora_stream": lambda: engine.get_per_tensor_param(),
        "verl_in_place": lambda: FSDPEngineWithLMHead.get_per_tensor_param(engine),
    }
    gen, _ = exports["lora_stream"]()
    # The engine's weights, allocated and touched once: their pages must not count as either export's growth.
    dest = {name: torch.zeros_like(t) for name, t in gen}
    libc = ctypes.CDLL("libc.so.6")
    before = local_shards(engine)
    times: dict[str, list[float]] = {k: [] for k in exports}
    growth: dict[str, list[int]] = {k: [] for k in exports}
    for _ in range(args.syncs):
        for variant, export in exports.items():  # interleaved: the machine drifts
            libc.malloc_trim(0)
            dist.barrier()
            start_rss = rss()
            sampler = RssSampler()
            sampler.start()
            t0 = time.perf_counter()
            gen, _ = export()
            for name, tensor in gen:
                dest[name].copy_(tensor)
            seconds = time.perf_counter() - t0
            growth[variant].append(sampler.stop() - start_rss)
            times[variant].append(seconds)
    after = local_shards(engine)
    drifted = sum(int((before[n] != after[n]).sum()) for n in before)
    stats = engine._stream.last_stats
    model_bytes = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    rows = [
        {
            "variant": v,
            "rank": dist.get_rank(),
            "median_sync_s": statistics.median(times[v]),
            "median_rss_growth_bytes": statistics.median(growth[v]),
            "peak_rss_growth_bytes": max(growth[v]),
            "peak_gathered_bytes": stats.peak_gathered_bytes if v == "lora_stream" else None,
            "model_bytes": model_bytes,
            "model_dtype": args.model_dtype,
            "drifted_elements_after_all_syncs": drifted,
        }
        for v in exports
    ]
    Path(f"{args.out}.rank{dist.get_rank()}.json").write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
