"""Tiny models and a tokenizer built on the fly, so tests need no download."""

from __future__ import annotations

import copy
from functools import lru_cache

import torch

TINY_TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
             "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i, 'é', \"日本\")\n") * 4


@lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer with BOS/EOS/PAD, like the shipped one but tiny."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|bos|>", "<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TINY_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", clean_up_tokenization_spaces=False)


def tiny_llama(vocab_size: int, layers: int = 2, hidden: int = 64, seed: int = 0, peak: float = 1.0,
               max_len: int = 256, eos_token_id: int = 1):
    """A random Llama. ``peak`` scales the output layer: random models predict nearly
    uniform distributions, where float noise decides the argmax; scaling makes them peaked."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_len, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=eos_token_id, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    model.generation_config.pad_token_id = 2
    return model


def noisy_copy(model, noise: float, seed: int = 1):
    """A drafter that agrees with ``model`` often but not always."""
    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    return draft


class LocalHandle:
    """A Serve deployment handle, in process: ``handle.<method>.remote(*args)`` awaits that method of
    ``server`` (a ``DrafterServer``), as Serve would call it on a replica."""

    class _Method:
        def __init__(self, server, name: str):
            self.server, self.name = server, name

        async def remote(self, *args):
            return await getattr(self.server, self.name)(*args)

    def __init__(self, server):
        self.server = server

    def __getattr__(self, name: str):
        return self._Method(self.server, name)
