"""Tool calls in chat templates: Hermes' format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
in the reply, what Qwen's templates and vLLM's ``hermes`` parser use), the same for the built-in sidecar, SFT
and vLLM.

A template that renders tools itself (it names ``tools``, as Qwen3's does) is given them. One that does not
(the micro models' role-token template, SmolLM2's) is run behind a Jinja preamble (:func:`tool_template`)
that rewrites a conversation with tools or calls into messages it can render, in the same format: the tools
listed in a system message, an assistant's calls as ``<tool_call>`` text after its content, and a tool's
result as a user message in ``<tool_response>`` tags. Either way, what the sidecar renders for a request and
what SFT renders for a demonstration (``render_conversation(..., tools=...)``) are the same tokens, and vLLM
is given the same template (``--chat-template``). :func:`parse_tool_calls` reads a reply's calls back out of
its text; a call whose JSON does not parse stays text, so a malformed call is an answer the agent sees, never
a silently dropped one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import uuid
from typing import Any

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def native_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


# Jinja put before a template that does not render tools: when the conversation has tools or calls, it
# rewrites ``messages`` (top-level ``set`` shadows the caller's variable for the rest of the template) as the
# module's docstring says, in the template engine both transformers and vLLM render with, so the two sidecars
# and SFT give the same text. ``tojson`` there is transformers' (no HTML escaping, ``ensure_ascii=False``).
PREAMBLE = """\
{%- if tools or (messages | selectattr("tool_calls") | list) -%}
{%- set ns = namespace(out=[], text="") -%}
{%- for m in messages -%}
{%- set ns.text = m.content or "" -%}
{%- if m.role == "assistant" and m.tool_calls -%}
{%- for c in m.tool_calls -%}
{%- set f = c.function -%}
{%- set body = {"name": f.name or "", "arguments": f.arguments or {}} -%}
{%- set ns.text = ns.text ~ "<tool_call>" ~ (body | tojson(separators=(",", ":"))) ~ "</tool_call>" -%}
{%- endfor -%}
{%- endif -%}
{%- if m.role == "tool" -%}
{%- set ns.out = ns.out + [{"role": "user", "content": "<tool_response>" ~ ns.text ~ "</tool_response>"}] -%}
{%- else -%}
{%- set ns.out = ns.out + [{"role": m.role, "content": ns.text}] -%}
{%- endif -%}
{%- endfor -%}
{%- if tools -%}
{%- set ns.listed = [] -%}
{%- for t in tools -%}
{%- set ns.listed = ns.listed + [t.function if t.function is defined else t] -%}
{%- endfor -%}
{%- set listed = "<tools>" ~ (ns.listed | tojson(separators=(",", ":"))) ~ "</tools>" -%}
{%- if ns.out and ns.out[0].role == "system" -%}
{%- set ns.out = [{"role": "system", "content": ns.out[0].content ~ "\n" ~ listed}] + ns.out[1:] -%}
{%- else -%}
{%- set ns.out = [{"role": "system", "content": listed}] + ns.out -%}
{%- endif -%}
{%- endif -%}
{%- set messages = ns.out -%}
{%- endif %}{{ "" }}"""  # the empty expression keeps trim_blocks off the template's first newline


def tool_template(tokenizer: Any) -> str | None:
    """The tokenizer's chat template with tools rendered as the module's docstring says (``None`` if the
    template renders tools itself, or there is no template): what SFT, the built-in sidecar and vLLM
    (``--chat-template``) render with."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or native_tools(tokenizer):
        return None
    return PREAMBLE + template


def _parsed_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each call's ``arguments`` JSON string parsed, as vLLM hands them to templates; one
    that does not parse stays the string the model sampled."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    with contextlib.suppress(ValueError):
                        fn["arguments"] = json.loads(fn["arguments"])
                calls.append({**c, "function": fn})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool
) -> str:
    """The chat template's text of ``messages`` with ``tools`` (see the module's docstring). A conversation
    with neither tools nor calls is the template's own rendering, whatever the template."""
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    if (template := tool_template(tokenizer)) is not None:
        extra["chat_template"] = template
    return tokenizer.apply_chat_template(
        _parsed_arguments(messages), add_generation_prompt=generation_prompt, tokenize=False, **extra
    )


def parse_tool_calls(text: str, key: bytes | None = None) -> tuple[str, list[dict[str, Any]]]:
    """A reply's text without its well-formed ``<tool_call>`` blocks, and those calls in OpenAI's form.

    ``key`` (the sidecar's: the request's prompt and the reply's token ids) makes each call's id a digest of
    it and of the call's place, so the same reply to the same prompt gets the same ids (a seeded run's
    samples reproduce to the byte) and a later turn, whose prompt holds the earlier ones, gets others;
    ``None``: random ids."""
    calls: list[dict[str, Any]] = []
    kept, last = [], 0
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
        # as plain_messages writes them back
        arguments = json.dumps(body["arguments"], separators=(",", ":"))
        calls.append({"id": call_id(key, len(calls)), "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})  # fmt: skip
    kept.append(text[last:])
    if not calls:
        return text, []
    content = "".join(kept)  # as sampled around the calls, so that the next prompt renders the same tokens
    return ("" if not content.strip() else content), calls


def call_id(key: bytes | None, index: int) -> str:
    """OpenAI's ``call_`` and 24 hex digits: of ``key`` and ``index`` (see :func:`parse_tool_calls`), or
    random."""
    if key is None:
        return f"call_{uuid.uuid4().hex[:24]}"
    return "call_" + hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=12).hexdigest()
