"""The adder agent with pydantic-ai (``pydantic-ai-slim[openai]``), pointed at the episode's endpoint."""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from asyncrl_tool_agents import INSTRUCTIONS, add, demonstration_with


async def agent(task: dict, endpoint) -> str:
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        model = OpenAIChatModel(endpoint.model, provider=OpenAIProvider(openai_client=client))
        adder = Agent(model, instructions=INSTRUCTIONS, tools=[add])
        result = await adder.run(task["prompt"])
    return str(result.output)


# the tool as pydantic-ai offers it (recorded from its requests): what a demonstration must render for SFT to
# match
ARGS = {"a": {"type": "integer"}, "b": {"type": "integer"}}
PARAMETERS = {"additionalProperties": False, "properties": ARGS, "required": ["a", "b"], "type": "object"}
ADD = {"name": "add", "description": "Add two integers.", "parameters": PARAMETERS, "strict": True}
TOOLS = [{"type": "function", "function": ADD}]


def demonstration(task: dict) -> dict:
    return demonstration_with(task, TOOLS)
