"""Training data (offline/training/data.py): chat conversations rendered with a chat template, the loss mask
on exactly the assistant turns, both JSONL shapes, the server's plain template, plain text; where the
regeneration tool resumes."""

import json

import pytest

from offline.training import data
from offline.training.regenerate import completed_lines
from tests.helpers import tiny_tokenizer

# ChatML written as text: the tiny tokenizer has no special tokens for it, so the markers are ordinary tokens
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

CONVERSATION = [{"role": "system", "content": "You write Python"},
                {"role": "user", "content": "add two numbers"},
                {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                {"role": "user", "content": "and a point"},
                {"role": "assistant", "content": "class Point:\n    def __init__(self, x, y):\n        self.x = x"}]


@pytest.fixture
def chat_tokenizer():
    tok = tiny_tokenizer()
    tok = tok.__class__(tokenizer_object=tok.backend_tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                        pad_token="<|pad|>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML
    return tok


def masked_runs(ids, mask):
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    return runs + ([cur] if cur else [])


def test_the_mask_covers_exactly_the_assistant_turns(chat_tokenizer):
    tok = chat_tokenizer
    ids, mask = data.chat_example(tok, CONVERSATION)
    assert ids == data.encode(tok, tok.apply_chat_template(CONVERSATION, tokenize=False))  # as the server encodes it
    # each assistant turn is learned with its end-of-turn marker (what the target writes after the generation
    # prompt), nothing else: the system and user turns and the template's headers are not
    replies = [m["content"] + "<|im_end|>\n" for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(r) for r in masked_runs(ids, mask)] == replies
    assert sum(mask) == sum(len(tok(r, add_special_tokens=False)["input_ids"]) for r in replies)


def test_sharegpt_and_openai_shapes_give_the_same_example(chat_tokenizer, tmp_path):
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in CONVERSATION]}
    openai = {"messages": CONVERSATION}
    assert data.normalise(sharegpt) == data.normalise(openai) == CONVERSATION
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [sharegpt, openai, {"text": "x = 1\n"}] * 4) + "\n")
    train, held, held_records = data.load([path], chat_tokenizer, held_out_percent=30)
    assert len(held_records) >= 1 and len(train.ids) > len(held.ids) > 0
    assert train.starts is not None and train.starts[0] == 0
    with pytest.raises(ValueError, match="unknown speaker"):
        data.normalise({"conversations": [{"from": "robot", "value": "hi"}]})


def test_without_a_chat_template_the_servers_plain_template(chat_tokenizer):
    tok = tiny_tokenizer()
    assert not tok.chat_template
    text, spans = data.assistant_spans(tok, CONVERSATION)
    assert text == "".join(f"{m['role']}: {m['content']}\n" for m in CONVERSATION)
    # the reply after the server's generation prompt "assistant:", its line end included
    assert [text[a:b] for a, b in spans] == [" " + m["content"] + "\n" for m in CONVERSATION if m["role"] == "assistant"]
    ids, mask = data.chat_example(tok, CONVERSATION)
    learned = tok.decode([t for t, m in zip(ids, mask) if m])
    assert learned.replace(" ", "") == "".join(m["content"] + "\n" for m in CONVERSATION
                                               if m["role"] == "assistant").replace(" ", "")
    prompt = data.prompts(tok, [CONVERSATION], 1)[0]
    assert tok.decode(prompt).endswith("user: add two numbers\nassistant:")


def test_plain_text_is_learned_everywhere():
    tok = tiny_tokenizer()
    ids, mask = data.text_example(tok, "def add(a, b):\n    return a + b\n")
    assert all(mask) and tok.decode(ids, skip_special_tokens=True) == "def add(a, b):\n    return a + b\n"


def test_a_regenerated_file_resumes_after_its_last_complete_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"messages": []}\n{"messages": []}\n{"messa')  # a run killed while writing line 3
    assert completed_lines(out) == 2
    assert out.read_text() == '{"messages": []}\n{"messages": []}\n'
