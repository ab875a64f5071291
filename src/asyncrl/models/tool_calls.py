"""Tool calls in chat templates: Hermes' format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the
reply, what Qwen's templates and vLLM's ``hermes`` parser use), for the built-in sidecar and SFT alike.

A template that renders tools itself (it names ``tools``, as Qwen3's does) is given them. One that does not (the
micro models' role-token template) gets a conversation that has tools or calls rewritten into messages it can
render, in the same format: the tools listed in a system message, an assistant's calls as ``<tool_call>`` text
after its content, and a tool's result as a user message in ``<tool_response>`` tags. Either way, what the sidecar
renders for a request and what SFT renders for a demonstration (``render_conversation(..., tools=...)``) are the
same tokens. :func:`parse_tool_calls` reads a reply's calls back out of its text; a call whose JSON does not parse
stays text, so a malformed call is an answer the agent sees, never a silently dropped one.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def native_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def plain_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """``messages`` (OpenAI's: ``tool_calls`` on assistant messages, ``tool`` results) as role-and-text messages a
    template without tools renders, with ``tools`` listed in the first system message."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            content = "".join([content, *calls])
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{content}</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        listed = "<tools>" + json.dumps([t.get("function", t) for t in tools], separators=(",", ":")) + "</tools>"
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n{listed}"}
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    arguments = fn.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # written as it came: what the model sampled, if it sampled it
    body = {"name": fn.get("name", ""), "arguments": arguments}
    return f"<tool_call>{json.dumps(body, separators=(',', ':'))}</tool_call>"


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool) -> str:
    """The chat template's text of ``messages`` with ``tools`` (see the module's docstring). A conversation with
    neither tools nor calls is the template's own rendering, whatever the template."""
    if native_tools(tokenizer) or not (tools or any(m.get("tool_calls") for m in messages)):
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **extra)
    return tokenizer.apply_chat_template(
        plain_messages(messages, tools), add_generation_prompt=generation_prompt, tokenize=False
    )


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """A reply's text without its well-formed ``<tool_call>`` blocks, and those calls in OpenAI's form."""
    calls, kept, last = [], [], 0
    for match in TOOL_CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            continue
        if not isinstance(body.get("arguments"), dict):
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        arguments = json.dumps(body["arguments"], separators=(",", ":"))  # as plain_messages writes them back
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})  # fmt: skip
    kept.append(text[last:])
    if not calls:
        return text, []
    content = "".join(kept)  # as sampled around the calls, so that the next prompt renders the same tokens
    return ("" if not content.strip() else content), calls
