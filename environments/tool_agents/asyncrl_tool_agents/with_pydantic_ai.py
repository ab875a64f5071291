"""The adder agent with pydantic-ai (``pydantic-ai-slim[openai]``), pointed at the episode's endpoint."""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from asyncrl_tool_agents import INSTRUCTIONS, add


async def agent(task: dict, endpoint) -> str:
    async with AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key) as client:
        model = OpenAIChatModel(endpoint.model, provider=OpenAIProvider(openai_client=client))
        adder = Agent(model, instructions=INSTRUCTIONS, tools=[add])
        result = await adder.run(task["prompt"])
    return str(result.output)
