"""vLLM server sink throughput on CPU: a trainer process pushes a model into a vLLM server over the gloo backend.

    python3 -m nox -s bench -- server          # or, inside the stack: python benchmarks/bench_server.py

Starts a vLLM OpenAI server (dev mode, gloo weight transfer) on 127.0.0.1 with a random Llama-shaped model, then
pushes the same model with a non-zero LoRA adapter merged, `--syncs` times, from one trainer process. Reports the
median sync time and GB/s (merged bytes per second, end to end: merge, pack, broadcast, load in vLLM). The first
sync, which also sets up the transfer group, is reported separately. Writes benchmarks/results/server.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import add_model_args, free_port, llama_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, layers=8)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=256)
    ap.add_argument("--out", default=str(HERE / "results" / "server.json"))
    args = ap.parse_args()

    import requests
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from lora_stream import ParamStream, VLLMServerSink

    torch.manual_seed(0)
    base = LlamaForCausalLM(llama_config(args))
    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        port = free_port()
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                tmp,
                "--dtype",
                "float32",
                "--max-model-len",
                "128",
                "--enforce-eager",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--skip-tokenizer-init",
                "--weight-transfer-config",
                '{"backend": "gloo"}',
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                try:
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("vLLM server did not start")
                time.sleep(1)
            model = get_peft_model(
                base, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", init_lora_weights=False)
            )
            sink = VLLMServerSink(url, rank=0, buffer_bytes=args.buffer_mib * 2**20, timeout=300)
            records = [sink.sync(ParamStream(model, group_by="layer"), version=f"v{i}") for i in range(args.syncs)]
        finally:
            server.terminate()
            server.wait(timeout=60)
    first, rest = records[0], records[1:]
    median = statistics.median(r.seconds for r in rest)
    gbps = rest[0].bytes / median / 1e9
    print(
        f"\nmodel: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}: {first.bytes / 2**20:.0f} MiB "
        f"float32, {first.tensors} tensors; buffer {args.buffer_mib} MiB; 1 trainer process -> vLLM server (gloo)"
    )
    print(f"  first sync (with group setup): {first.seconds:.2f} s")
    print(f"  median of the next {len(rest)}:     {median:.2f} s  ({gbps:.3f} GB/s end to end)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {"args": vars(args), "first_s": first.seconds, "median_s": median, "bytes": first.bytes, "gbps": gbps},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
