"""``render_conversation``: what SFT trains on is exactly what the model samples in an episode."""

import pytest

from asyncrl.models.hf import render_conversation
from asyncrl.models.local_tokenizers import CHAT_TEMPLATE, build_char_tokenizer

PROMPT = [{"role": "user", "content": "Compute 4*5."}]
EPISODE = [
    {"role": "assistant", "content": "calc: 4*5"},
    {"role": "user", "content": "result: 20"},
    {"role": "assistant", "content": "answer: 20"},
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("ascii_printable")


def spans(tok, ids, mask):
    """The trained and the context text, each as a list of maximal runs."""
    runs: dict[bool, list[str]] = {True: [], False: []}
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs[mask[start]].append(tok.decode(ids[start:i]))
            start = i
    return runs[True], runs[False]


def test_single_turn_is_the_prompt_then_the_whole_reply(tok):
    prompt, completion, mask = render_conversation(tok, PROMPT, [{"role": "assistant", "content": "20"}])
    assert tok.decode(prompt) == "<|user|>Compute 4*5.<|end|><|assistant|>"
    assert tok.decode(completion) == "20<|end|>" and all(mask)


def test_multi_turn_trains_the_replies_and_keeps_the_environment_as_context(tok):
    prompt, completion, mask = render_conversation(tok, PROMPT, EPISODE)
    trained, context = spans(tok, completion, mask)
    assert trained == ["calc: 4*5<|end|>", "answer: 20<|end|>"]
    assert context == ["<|user|>result: 20<|end|><|assistant|>"]
    full = tok.apply_chat_template(PROMPT + EPISODE, tokenize=False)
    assert tok.decode(prompt + completion) == full  # nothing lost or reordered


def test_several_context_messages_between_turns_and_a_separator_after_the_end_token(tok):
    """A ChatML-like template writes a newline after each end token: generation stops at the end token, so
    the newline is context (and dropped after the last reply); two environment messages in a row are one
    span."""
    tok = build_char_tokenizer("ascii_printable")
    tok.chat_template = CHAT_TEMPLATE.replace("<|end|>", "<|end|>\n")
    episode = EPISODE[:2] + [{"role": "system", "content": "1 call left"}] + EPISODE[2:]
    prompt, completion, mask = render_conversation(tok, PROMPT, episode)
    trained, context = spans(tok, completion, mask)
    assert trained == ["calc: 4*5<|end|>", "answer: 20<|end|>"]
    assert context == ["\n<|user|>result: 20<|end|>\n<|system|>1 call left<|end|>\n<|assistant|>"]
    assert tok.decode(completion).endswith("answer: 20<|end|>")


def test_end_ids_name_where_generation_stops(tok):
    _, completion, mask = render_conversation(
        tok, PROMPT, EPISODE[:1], end_ids=[tok.convert_tokens_to_ids(":")]
    )
    assert tok.decode([t for t, m in zip(completion, mask, strict=True) if m]) == "calc:"


def test_a_template_that_does_not_keep_prefixes_is_refused(tok):
    tok = build_char_tokenizer("ascii_printable")
    # the last message rendered without its end token: each turn is no longer a prefix of the next
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last %}<|end|>{% endif "
        "%}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix"):
        render_conversation(tok, PROMPT, EPISODE)


@pytest.mark.parametrize("episode", [[], EPISODE[1:], EPISODE[:2]])
def test_a_demonstration_starts_and_ends_with_the_model(tok, episode):
    with pytest.raises(ValueError, match="starts and ends with an assistant message"):
        render_conversation(tok, PROMPT, episode)
