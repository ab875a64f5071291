"""Tool calls on templates without tools of their own: rendered in Hermes' format, read back from replies, and a
conversation that goes on after a call renders as an extension of what was sampled."""

from __future__ import annotations

import json

from asyncrl.inference.builtin.engine import Completion
from asyncrl.inference.builtin.rendering import chat_response
from asyncrl.inference.builtin.streaming import stream_events
from asyncrl.inference.protocol import ChatRequest
from asyncrl.models.local_tokenizers import build_char_tokenizer
from asyncrl.models.tool_calls import parse_tool_calls, plain_messages, render_chat

ADD = {"type": "function", "function": {"name": "add", "description": "a+b", "parameters": {"type": "object"}}}


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
    """What the model sampled (a call), handed back by the agent as OpenAI's tool_calls, renders as the same text,
    so the next prompt extends the last one's prompt and reply: one training stream."""
    tok = build_char_tokenizer("ascii_printable")
    messages = [{"role": "user", "content": "add 2 and 3"}]
    prompt = render_chat(tok, messages, [ADD], generation_prompt=True)
    sampled = '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call>'
    content, calls = parse_tool_calls(sampled)
    history = [*messages, {"role": "assistant", "content": content or None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"}]  # fmt: skip
    following = render_chat(tok, history, [ADD], generation_prompt=True)
    assert following.startswith(prompt + sampled + tok.eos_token)
    assert "<tools>" in prompt and json.loads(prompt.split("<tools>")[1].split("</tools>")[0])[0]["name"] == "add"
    assert "<tool_response>5</tool_response>" in following


def test_plain_messages_put_the_tools_into_an_existing_system_message():
    out = plain_messages([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}], [ADD])
    assert out[0]["role"] == "system" and out[0]["content"].startswith("be brief\n<tools>") and len(out) == 2


class Engine:
    model_name, version, tokenizer = "m", 3, None


def response(body: dict, text: str) -> dict:
    c = Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], text=text, finish_reason="stop", versions=[3, 3])
    return chat_response(Engine(), ChatRequest(**body), [5], [c])


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
        assert choice["message"] == {"role": "assistant", "content": call} and choice["finish_reason"] == "stop"


def test_sft_renders_a_tool_using_demonstration_as_the_sidecar_renders_the_episode():
    """A demonstration with a call (``tools`` given) trains exactly the tokens the sampler produces for the call, and
    its prompt is the sidecar's rendering of the same request; without tools or calls nothing changes."""
    from asyncrl.models.hf import render_conversation

    tok = build_char_tokenizer("ascii_printable")
    prompt = [{"role": "user", "content": "add 2 and 3"}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
    demo = [{"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "content": "5"}]  # fmt: skip
    prompt_ids, ids, mask = render_conversation(tok, prompt, demo, tools=[ADD])
    assert tok.decode(prompt_ids) == render_chat(tok, prompt, [ADD], generation_prompt=True)
    trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == '<tool_call>{"name":"add","arguments":{"a":2,"b":3}}</tool_call><|end|>5<|end|>'
    plain = [{"role": "assistant", "content": "5"}]
    assert render_conversation(tok, prompt, plain) == render_conversation(tok, prompt, plain, tools=None)
    assert tok.decode(render_conversation(tok, prompt, plain)[0]) == tok.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=False
    )
