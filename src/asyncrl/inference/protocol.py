"""Request schemas of the sidecar's OpenAI-compatible routes, with vLLM's extensions.

Unknown fields are accepted and ignored (OpenAI clients send ``user``, ``metadata``...), but a field we know
and cannot honour (penalties, ``logit_bias``, ``response_format``, ``best_of``, ``suffix``, vLLM's
``repetition_penalty``...) is rejected with a 400 naming it unless it has its neutral value, rather than
silently sampling from a different distribution than the caller asked for. ``/inference/v1/generate`` (vLLM's
token-in/token-out route) takes the same sampling fields inside ``sampling_params``. Strings that cannot be
UTF-8 (a lone UTF-16 surrogate such as ``"\\ud800"``, valid JSON) are rejected with a 400 too: no tokenizer
can encode them.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 256
# one past the largest integer a sampling field may hold: the engines keep seeds and top-k as int64 (a
# generator's seed, a tensor of each row's top-k)
INT64_END = 2**63

# known parameters (OpenAI's, and vLLM's sampling extensions) this server does not implement: refused with a
# 400 naming them unless their value is one of the neutral ones listed here
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "prediction": (None,),
    "repetition_penalty": (None, 1, 1.0),
    "min_tokens": (None, 0),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "structured_outputs": (None,),
    "ignore_eos": (None, False),
    "include_stop_str_in_output": (None, False),
    "prompt_logprobs": (None,),  # /v1/completions declares it (CompletionRequest); elsewhere refused
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
}


def refused_fields(body: dict[str, Any]) -> list[str]:
    """The fields of :data:`UNSUPPORTED` that ``body`` gives a value other than a neutral one."""
    return [k for k, neutral in UNSUPPORTED.items() if k in body and not _is_neutral(body[k], neutral)]


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` that UTF-8 cannot encode (a lone surrogate), or ``None``."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if isinstance(k, str) and _surrogate_path(k) is not None:
            return f"{path}.{k!r}".lstrip(".")
        if (found := _surrogate_path(v, f"{path}.{k}".lstrip("."))) is not None:
            return found
    return None


class _Request(BaseModel):
    """Every request body: no string that UTF-8 cannot encode."""

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data: Any) -> Any:
        if (where := _surrogate_path(data)) is not None:
            raise ValueError(
                f"{where}: a lone UTF-16 surrogate (such as \\ud800) is not text; send valid Unicode"
            )
        return data


class _Sampling(_Request):
    """The sampling fields every generating route shares (OpenAI's, and vLLM's ``stop_token_ids``)."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, lt=INT64_END)  # vLLM's extension: 0 or -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's extension: 0 = off
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=INT64_END)
    stop_token_ids: list[int] | None = None
    # asyncrl's extension: each choice's routed_experts, [prompt + completion - 1][MoE layers][top_k] expert
    # ids
    return_routed_experts: bool = False

    @model_validator(mode="after")
    def _unsupported(self):
        if refused := refused_fields(self.model_extra or {}):
            raise ValueError(
                f"not supported by this server: {', '.join(refused)}; leave them out (or at their defaults)"
            )
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Sampling):
    model: str | None = None
    # stream=true answers server-sent events in OpenAI's chunk format (see
    # asyncrl.inference.builtin.streaming)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be given with stream=true")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    # vLLM's extension: each prompt token's logprob (0: that token's only, no alternatives; what distillation
    # asks)
    prompt_logprobs: int | None = Field(None, ge=0, le=0)

    @model_validator(mode="after")
    def _prompt(self):
        if self.echo:
            raise ValueError("echo=true is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [cast(list[int], p)]  # a single prompt given as token ids
        return cast(list[str | list[int]], list(p))


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; some clients send the object


class ToolCall(BaseModel):
    """A call in an assistant message's ``tool_calls`` (OpenAI's shape)."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str = Field(pattern="^(system|user|assistant|tool|developer)$")
    content: str | list[dict[str, Any]] | None = None  # None: an assistant message of tool calls only
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class FunctionTool(BaseModel):
    """One of a chat request's ``tools``: OpenAI's ``{"type": "function", "function": {name, description,
    parameters}}``."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: dict[str, Any]

    @model_validator(mode="after")
    def _named(self):
        if not isinstance(self.function.get("name"), str) or not self.function["name"]:
            raise ValueError("a function tool needs a name (function.name)")
        return self


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # asyncrl's compact logprobs (asyncrl.rollouts.answers.encode_logprobs), when no top logprobs are asked
    logprobs_encoding: Literal["base64"] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    # OpenAI's function tools: rendered by the chat template, calls read back from the reply
    # (asyncrl.models.tool_calls); tool_choice "none" or "auto" (the model decides)
    tools: list[FunctionTool] | None = None

    @model_validator(mode="after")
    def _chat(self):
        for m in self.messages:
            m.text()  # raises on non-text parts
        return self

    def chat_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: role, text, and the tool fields where present."""
        return [
            {"role": m.role, "content": m.text()}
            | (
                {"tool_calls": [c.model_dump(exclude_none=True) for c in m.tool_calls]}
                if m.tool_calls
                else {}
            )
            | ({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})
            for m in self.messages
        ]

    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and (self.model_extra or {}).get("tool_choice") != "none"


class GenerateSampling(_Sampling):
    """vLLM's ``SamplingParams`` as ``/inference/v1/generate`` takes them (the fields this server
    honours)."""

    max_tokens: int | None = Field(16, ge=1)  # vLLM's default; null = the rest of the context
    # top logprobs per token; the sampled token's always comes
    logprobs: int | None = Field(None, ge=0, le=20)
    # the route answers token ids, never text: these change nothing here and are accepted at any value
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True


class GenerateRequest(_Request):
    """vLLM's token-in/token-out request (``POST /inference/v1/generate``), as verifiers' TrainClient sends
    it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)  # type: ignore[arg-type]
    request_id: str | None = Field(None, max_length=256)
    stream: bool = False
    cache_salt: str | None = None  # isolates prefix caches; this server shares no KV across requests
    priority: int = 0

    @model_validator(mode="after")
    def _generate(self):
        if self.stream:
            raise ValueError("stream=true is not supported on /inference/v1/generate by this server")
        if self.priority != 0:
            raise ValueError("priority scheduling is not supported by this server; send priority=0")
        extra = self.model_extra or {}
        refused = [
            k for k in ("features", "kv_transfer_params", "content_parts") if extra.get(k) is not None
        ]
        if refused:
            raise ValueError(
                f"not supported by this server: {', '.join(refused)} (text-only model, one server)"
            )
        return self


class UpdateWeightsRequest(_Request):
    path: str = Field(
        min_length=1,
        pattern=r"^[^\x00]*$",  # no file system takes a NUL in a path (os.stat raises ValueError)
        description="a weights directory with *.safetensors in HF names, or one holding the manifest "
        "of a transport that sends the weights itself (weights.transport)",
    )
    version: int = Field(ge=0, description="the policy version these weights are")


class RolloutSampling(BaseModel):
    """The sampling settings a rollout imposes on each of its calls (``None``: the agent's own);
    ``max_tokens`` bounds what a call asks for."""

    model_config = ConfigDict(extra="forbid")

    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=INT64_END)
    min_p: float | None = Field(None, ge=0, le=1)
    max_tokens: int | None = Field(None, ge=1)


class OpenRollout(_Request):
    """``POST /rollouts``: open a rollout-scoped endpoint (:mod:`asyncrl.inference.recording`)."""

    ttl_s: float = Field(
        3600.0, gt=0, le=7 * 86400, description="seconds after which a rollout never ended is dropped"
    )
    sampling: RolloutSampling | None = Field(None, description="imposed on every call")
    seed: int | None = Field(
        None, ge=0, description="call k of the rollout, if unseeded, samples with seed + k"
    )
