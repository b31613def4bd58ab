"""Write a tiny random Llama-shaped checkpoint with a word-level tokenizer, to try the recipes on a CPU.

    python examples/tiny_model.py /tmp/tiny-llama        # then: python examples/quickstart.py /tmp/tiny-llama

Two decoder layers, hidden size 64, 1000 tokens named ``t0`` .. ``t999`` (so prompts are words like "t5 t17"): the
smallest Llama vLLM's CPU attention runs. Nothing is downloaded. Every recipe takes a model directory; point it at a
real checkpoint on a machine that can hold one.
"""

from __future__ import annotations

import sys


def write_tiny_model(path: str, *, seed: int = 0) -> str:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger than the default init, so that greedy generation varies with the weights
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(1000)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)
    return path


if __name__ == "__main__":
    print(write_tiny_model(sys.argv[1]))
