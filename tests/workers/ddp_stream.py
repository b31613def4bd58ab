"""Rank worker: a LoRA model under DDP (gloo), one training step, then every rank's stream equals the oracle."""

import torch
import torch.distributed as dist
from helpers import assert_matches, finish, lora, oracle, report, tiny_llama
from torch.nn.parallel import DistributedDataParallel as DDP

from lora_stream import ParamStream, PlainGatherer


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    pm = lora(tiny_llama(tie=True), target_modules="all-linear", modules_to_save=["lm_head"])
    ddp = DDP(pm)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
    ddp(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    stream = ParamStream(ddp)
    assert isinstance(stream.gatherer, PlainGatherer)
    got = list(stream)
    assert got[0][0] == "model.embed_tokens.weight"
    assert_matches(got, oracle(pm))
    # Replicas agree after the step, so every rank streams the same tensors.
    for _, t in got:
        ref = t.clone()
        dist.broadcast(ref, 0)
        assert torch.equal(ref, t)
    report(rank=rank, event="match", tensors=len(got))
    finish()


if __name__ == "__main__":
    main()
