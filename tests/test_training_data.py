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


def learned(examples):
    """Per example, its learned runs and the tokens before each run."""
    out = []
    for ids, mask in examples:
        for run in masked_runs(ids, mask):
            out.append(run)
    return out


def test_each_reply_is_learned_after_its_served_prompt_with_a_template(chat_tokenizer):
    tok = chat_tokenizer
    examples = data.chat_examples(tok, CONVERSATION)
    # each assistant turn with its end-of-turn marker (what the target writes after the generation prompt), tokenised
    # on its own as the target writes it; the system and user turns and the template's headers are not learned
    replies = [m["content"] + "<|im_end|>\n" for m in CONVERSATION if m["role"] == "assistant"]
    assert [tok.decode(r) for r in learned(examples)] == replies
    assert learned(examples) == [tok(r, add_special_tokens=False)["input_ids"] for r in replies]
    # and each reply follows its served prompt (the conversation so far with the generation prompt), from an
    # example's start: here the second prompt extends the first turn, so one example holds both
    for i, reply in zip([2, 4], learned(examples)):
        prompt = data.encode(tok, data.render(tok, CONVERSATION[:i], add_generation_prompt=True))
        n = len(prompt) + len(reply)
        assert any(ids[:n] == prompt + reply and all(mask[len(prompt): n]) for ids, mask in examples)


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


def test_without_a_chat_template_replies_are_learned_as_the_target_writes_them(chat_tokenizer):
    """The server's plain template prompts with ``...assistant:`` and the target writes the reply from there: no
    space before it (the history's ``assistant: {content}`` rendering is not what the target wrote), EOS after."""
    tok = tiny_tokenizer()
    assert not tok.chat_template
    examples = data.chat_examples(tok, CONVERSATION)
    replies = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    assert learned(examples) == [tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for r in replies]
    # every turn is an example of its own (the next prompt re-renders the reply as history), led by its served prompt
    assert len(examples) == 2
    for (ids, mask), i in zip(examples, [2, 4]):
        prompt = data.encode(tok, data.render(tok, CONVERSATION[:i], add_generation_prompt=True))
        assert tok.decode(prompt).endswith("assistant:")
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)]) and all(mask[len(prompt):])
    prompt = data.prompts(tok, [CONVERSATION], 1)[0]
    assert tok.decode(prompt).endswith("user: add two numbers\nassistant:")


@pytest.mark.parametrize("template", [False, True])
def test_a_regenerated_reply_is_learned_as_its_served_token_ids(chat_tokenizer, template):
    """A reply the server returned ids for (``regenerate`` writes them as ``token_ids``) is learned as exactly those
    ids, even where its text would tokenise otherwise, in both record shapes."""
    tok = chat_tokenizer if template else tiny_tokenizer()
    served = tok("    return", add_special_tokens=False)["input_ids"][::-1] + [tok.eos_token_id]  # not the text's own
    record = {"conversations": [{"from": "human", "value": "def f():"},
                                {"from": "gpt", "value": tok.decode(served, skip_special_tokens=True),
                                 "token_ids": served}]}
    (ids, mask), = data.chat_examples(tok, data.normalise(record))
    prompt = data.encode(tok, data.render(tok, [{"role": "user", "content": "def f():"}], add_generation_prompt=True))
    assert ids == prompt + served and mask == [False] * len(prompt) + [True] * len(served)


def test_a_small_datasets_held_out_split_holds_several_conversations(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"def f{i}():"},
                                                     {"role": "assistant", "content": f"    return {i}"}]}) + "\n"
                            for i in range(28)))
    train, held, records = data.load([path], tiny_tokenizer())
    assert len(records) == 4 and len(train.starts) == 24  # 5% of 28 is one; at least 4 are held out
    assert [data.min_held_out(n) for n in (1, 2, 3, 4, 8, 100)] == [0, 1, 1, 2, 4, 4]


def test_plain_text_is_learned_everywhere():
    tok = tiny_tokenizer()
    ids, mask = data.text_example(tok, "def add(a, b):\n    return a + b\n")
    assert all(mask) and tok.decode(ids, skip_special_tokens=True) == "def add(a, b):\n    return a + b\n"


def test_a_regenerated_file_resumes_after_its_last_complete_line(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"messages": []}\n{"messages": []}\n{"messa')  # a run killed while writing line 3
    assert completed_lines(out) == 2
    assert out.read_text() == '{"messages": []}\n{"messages": []}\n'
