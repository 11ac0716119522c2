"""Tiny models and a tokenizer built on the fly, so tests need no download."""

from __future__ import annotations

import copy
from functools import cache

import torch

TINY_TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
             "        self.x = x\n        self.y = y\n\nfor i in range(10):\n    print(i, 'é', \"日本\")\n") * 4


@cache
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


# The published chat templates (tests/data/chat_templates/README.md says where each came from), with the
# special tokens each family's template writes and its parsers read (as the published tokenizers have them:
# Qwen3's <think> and <tool_call> are added tokens that decoding keeps, its turn markers special ones).
CHAT_FAMILIES = {
    "qwen3": {"template": "qwen3.jinja", "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              "added": ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
              "bos": None, "eos": "<|im_end|>"},
    "llama3.1": {"template": "llama3_1.jinja", "added": [],
                 "special": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                             "<|eom_id|>", "<|python_tag|>", "<|end_of_text|>"],
                 "bos": "<|begin_of_text|>", "eos": "<|eot_id|>"},
    "gpt-oss": {"template": "gptoss.jinja"},  # harmony's own token ids: harmony_bytes_tokenizer
}


@cache
def chat_tokenizer(family: str):
    """The tiny tokenizer with the family's special tokens and its published chat template."""
    from pathlib import Path

    from transformers import AddedToken

    spec = CHAT_FAMILIES[family]
    if family == "gpt-oss":  # harmony is read by token id: the tokenizer must have harmony's
        tok = harmony_bytes_tokenizer()
        tok.chat_template = (Path(__file__).parent / "data" / "chat_templates" / spec["template"]).read_text()
        return tok
    tok = copy.deepcopy(tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": spec["special"]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    tok.bos_token, tok.eos_token = spec["bos"], spec["eos"]
    tok.chat_template = (Path(__file__).parent / "data" / "chat_templates" / spec["template"]).read_text()
    return tok


HARMONY_SPECIAL = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|return|>": 200002, "<|constrain|>": 200003,
                   "<|channel|>": 200005, "<|start|>": 200006, "<|end|>": 200007, "<|message|>": 200008,
                   "<|call|>": 200012}
HARMONY_VOCAB = 201088  # gpt-oss's vocabulary size


def harmony_bytes_tokenizer():
    """gpt-oss's tokenizer cut down to its 256 byte tokens and harmony's special tokens, each under its
    id in o200k_harmony (the byte tokens are o200k's first 256 ranks, in byte-level order): text
    tokenizes byte by byte, not as gpt-oss's merges would, but into ids openai-harmony reads as the
    same text, so vLLM's harmony parser reads this tokenizer's output as it reads gpt-oss's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_char = bytes_to_unicode()
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    order = printable + [b for b in range(256) if b not in printable]
    vocab = {to_char[b]: rank for rank, b in enumerate(order)} | HARMONY_SPECIAL
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|return|>", pad_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    out.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL)})
    return out


def chat_model_dir(family: str, path):
    """A tiny random model of the family (transformers' config class), peaked, with its chat tokenizer, saved
    to ``path``."""
    import transformers as T

    tok = chat_tokenizer(family)
    # head_dim 32: vLLM's CPU attention serves it (not 16), so either verifier backend can run the model
    common = {"vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "eos_token_id": tok.eos_token_id, "pad_token_id": 2}
    torch.manual_seed(0)
    if family == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**common))
    elif family == "llama3.1":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common, bos_token_id=tok.bos_token_id, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}))
    else:  # gpt-oss's vocabulary is o200k's: its config and tokenizer only (a scripted verifier stands in)
        common.update(vocab_size=HARMONY_VOCAB,
                      eos_token_id=[HARMONY_SPECIAL["<|return|>"], HARMONY_SPECIAL["<|call|>"]])
        T.GptOssConfig(**common, num_local_experts=4, num_experts_per_tok=2, sliding_window=16).save_pretrained(path)
        tok.save_pretrained(path)
        return path
    with torch.no_grad():  # peaked: greedy picks far from ties, so both backends pick alike
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class ScriptedVerifier:
    """A verifier replica whose output is scripted: ``script`` maps a text the prompt holds to the text
    the model writes (the first that matches; tokenized, then EOS). It streams it as the real replica's
    ``speculate`` does, each step a list of (token ids, logprobs, ``StepInfo``): k drafts a step, all
    accepted inside the reasoning (before ``</think>``) and one after it, so each part's acceptance is known."""

    def __init__(self, model_dir: str, script: list[tuple[str, str]]):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.script = script
        self.think_end = self.tok.convert_tokens_to_ids("</think>")

    def output(self, prompt_ids: list[int]) -> list[int]:
        prompt = self.tok.decode(prompt_ids)
        text = next(out for trigger, out in self.script if trigger in prompt)
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]

    async def speculate(self, prompt_ids, params, seq_id, k=0, max_len=None, logprobs=None, output_ids=(),
                        k_policy="fixed", prediction=(), interval_s=None, constraint=None, cache_salt=None):
        from core.protocol import StepInfo

        # the script is the output: a constraint (the verifier's grammar) and a cache salt are taken, as the real
        # replica's signature, and not used
        script, at = self.output(prompt_ids), len(output_ids)
        end = min(len(script), len(output_ids) + params.max_tokens) if params.max_tokens else len(script)
        while at < end:
            accepted = min(k if self.think_end not in script[:at] else min(k, 1), end - at - 1)
            ids = script[at:at + accepted + 1]
            at += len(ids)
            yield [(ids, None, StepInfo(k=k, accepted=accepted, done=at >= end))]

    async def release(self, seq_ids):
        return len(seq_ids)
