"""Demo, end to end on 2 CPU ranks: a ZeRO-3 LoRA model -> lora_stream -> a colocated vLLM engine in each rank.

    python3 -m nox -s demo          # sets up everything on a fresh machine
    python benchmarks/demo.py       # inside an environment that has the stack

Each rank trains a tiny random Llama with a non-zero LoRA adapter under DeepSpeed ZeRO-3 and runs a vLLM engine
(tensor parallel across the two ranks, `external_launcher`). After one optimizer step the weights are streamed
into vLLM, and vLLM's greedy output is compared with a transformers model holding peft's merge_and_unload().
Then the same merged weights are saved as a Hugging Face checkpoint with save_merged and loaded back.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
warnings.filterwarnings("ignore")


def build_model(seed: int = 0):  # type: ignore[no-untyped-def]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=2000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return model


def rank_main(path: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import deepspeed
    import torch
    import torch.distributed as dist
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    from vllm import LLM, SamplingParams

    from lora_stream import ParamStream, VLLMColocatedSink, save_merged

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    llm = LLM(
        model=path,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
        gpu_memory_utilization=0.5,
    )
    torch.manual_seed(0)
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(path),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False),
    )
    template = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ids = torch.randint(0, 2000, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()

    stream = ParamStream(engine, group_by="layer")
    record = VLLMColocatedSink(llm).sync(stream)

    # The reference: peft's merge_and_unload() of the trainer's current weights, unsharded, float32.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        src = dict(engine.module.named_parameters())
        with torch.no_grad():
            for n, p in template.named_parameters():
                p.copy_(src[n].data)
    reference = template.float().merge_and_unload().eval()
    prompts = [[1, 17, 42, 99, 5], [7, 300, 2, 11, 64, 8, 900]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=12, logprobs=1),
        use_tqdm=False,
    )
    worst, tokens_match = 0.0, True
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        with torch.no_grad():
            lp = torch.log_softmax(reference(torch.tensor([p + list(c.token_ids)])).logits[0], -1)
        for i, tok in enumerate(c.token_ids):
            tokens_match &= int(lp[len(p) - 1 + i].argmax()) == tok
            worst = max(worst, abs(c.logprobs[i][tok].logprob - float(lp[len(p) - 1 + i, tok])))
    model_bytes = sum(math.prod(m.shape) * m.dtype.itemsize for m in stream.metadata())

    # The same merged weights, saved as a Hugging Face checkpoint without gathering the model on any rank.
    saved_dir = path + "-merged"
    saved = save_merged(engine, saved_dir, max_shard_size="2MB", overwrite=True, progress=False)
    saved_ok, shards = True, 0
    if rank == 0:
        loaded = dict(LlamaForCausalLM.from_pretrained(saved_dir).named_parameters())
        ref_params = dict(reference.named_parameters())
        saved_ok = set(loaded) == set(ref_params) and all(
            torch.allclose(loaded[n], ref_params[n], atol=1e-6) for n in ref_params
        )
        shards = len([f for f in os.listdir(saved_dir) if f.endswith(".safetensors")])
        shutil.rmtree(saved_dir, ignore_errors=True)
    ok = tokens_match and worst < 2e-3 and saved_ok
    if rank == 0:
        rows = [
            ("ranks", "2 (DeepSpeed ZeRO-3 trainer + vLLM TP=2 engine in each, gloo)"),
            ("groups / tensors", f"{record.groups} / {record.tensors}"),
            ("bytes streamed", f"{record.bytes / 2**20:.2f} MiB"),
            ("sync time", f"{record.seconds:.3f} s"),
            (
                "peak gathered per rank",
                f"{record.peak_gathered_bytes / 2**20:.2f} MiB of {model_bytes / 2**20:.2f} "
                f"MiB model ({record.peak_gathered_bytes / model_bytes:.0%})",
            ),
            ("vLLM greedy tokens == merged reference", str(tokens_match)),
            ("max |logprob diff| vs merged reference", f"{worst:.2e} (tolerance 2e-3)"),
            (
                "save_merged checkpoint",
                f"{shards} shards, {saved.bytes / 2**20:.2f} MiB in {saved.seconds:.3f} s; "
                f"from_pretrained == merged reference: {saved_ok}",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        print("\nlora_stream demo: ZeRO-3 LoRA model -> ParamStream -> colocated vLLM")
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        print("MATCH" if ok else "MISMATCH", flush=True)
    dist.barrier()
    raise SystemExit(0 if ok else 1)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model")
        build_model().save_pretrained(path)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "OMP_NUM_THREADS": "1",
                "VLLM_LOGGING_LEVEL": "ERROR",
                "TRANSFORMERS_VERBOSITY": "error",
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank", path],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        outputs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    table = outputs[0][outputs[0].find("\nlora_stream demo") :] if "lora_stream demo" in outputs[0] else ""
    print(table or "no result table; the ranks' output follows")
    if max(codes) != 0 and not table.strip().endswith("MISMATCH"):
        for rank, out in enumerate(outputs):
            print(f"--- rank {rank} (exit {codes[rank]}) ---\n{out[-4000:]}")
    raise SystemExit(max(codes))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--rank":
        rank_main(sys.argv[2])
    else:
        main()
