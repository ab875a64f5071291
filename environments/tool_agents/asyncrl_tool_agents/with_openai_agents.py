"""The adder agent with the OpenAI Agents SDK (``openai-agents``), pointed at the episode's endpoint."""

from __future__ import annotations

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from asyncrl_tool_agents import INSTRUCTIONS, add, demonstration_with

set_tracing_disabled(True)  # the SDK sends traces to OpenAI's servers otherwise; this machine is offline


async def agent(task: dict, endpoint) -> str:
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        adder = Agent(
            name="adder",
            instructions=INSTRUCTIONS,
            tools=[function_tool(add)],
            model=OpenAIChatCompletionsModel(model=endpoint.model, openai_client=client),
            # the endpoint imposes the run's sampling either way
            model_settings=ModelSettings(temperature=1.0),
        )
        result = await Runner.run(adder, task["prompt"], max_turns=4)
    return str(result.final_output)


# the tool as this SDK offers it (recorded from its requests): what a demonstration must render for SFT to
# match
ARGS = {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}
PARAMETERS = {
    "properties": ARGS,
    "required": ["a", "b"],
    "title": "add_args",
    "type": "object",
    "additionalProperties": False,
}
ADD = {"name": "add", "description": "Add two integers.", "parameters": PARAMETERS, "strict": True}
TOOLS = [{"type": "function", "function": ADD}]


def demonstration(task: dict) -> dict:
    return demonstration_with(task, TOOLS)
