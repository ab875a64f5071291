"""``asyncrl-calculator``: multi-turn arithmetic with a calculator tool the model must call (verifiers
0.4.0).

The model gets an expression such as ``Compute 47*18-9.`` and a calculator it calls by replying
``calc: <expression>``; the environment evaluates it and answers ``result: <value>`` as the next user
message, until the model replies ``answer: <number>`` (or runs out of turns).

**A text protocol, not OpenAI ``tools``/``tool_calls``**: a tool call needs a chat template and a tool-call
format the model knows, and asyncrl's models have neither (the CPU default's character-level template, and
SmolLM2-135M-Instruct's, render no tools; verifiers' default renderer has no tool support), so the
environment states the protocol in the system prompt and parses the replies itself. The environment's
messages are context in the trace: only the model's tokens are trained on.

Rewards: ``correct`` (weight 1) = the answer is the expression's value; ``tool_use`` (weight 0.5) = the
model called the calculator, every call was a valid expression, and its answer is the result of its last
call, i.e. it used the tool correctly rather than guessing. Metrics: ``calls_made``, ``bad_calls``.
Each task carries a reference episode in ``completion`` (call the tool on the expression, answer its result;
the calculator's reply from :func:`respond`): ``asyncrl sft`` warms a model up on it.
Taskset id ``asyncrl-calculator``; arguments ``num_tasks``, ``seed``, ``max_operand``, ``operators``,
``instructions`` (the system message; verifiers' own ``system_prompt`` field is a file that overrides it).
"""

from __future__ import annotations

import ast
import operator
import random
import re

import verifiers.v1 as vf
from pydantic import Field
from verifiers.v1.types import content_text

SYSTEM = (
    "You have a calculator. Call it by replying exactly `calc: <expression>` (integers, + - * and "
    "parentheses); it answers `result: <value>`. When you know the answer, reply `answer: <number>`."
)
CALL = re.compile(r"^\s*calc:\s*(.+?)\s*$", re.S)
ANSWER = re.compile(r"^\s*answer:\s*(-?\d+)\s*$", re.S)
HINT = "Reply `calc: <expression>` or `answer: <number>`."
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
MAX_CHARS, MAX_ABS = 64, 10**12


def evaluate(expression: str) -> int:
    """The value of an integer expression with + - * and parentheses; ``ValueError`` for anything else
    (names, calls, division, powers, huge numbers): the model's text is never executed."""
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError("not an expression") from None

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            result = node.value
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            result = -value(node.operand)
        elif isinstance(node, ast.BinOp) and type(node.op) in OPS:
            result = OPS[type(node.op)](value(node.left), value(node.right))
        else:
            raise ValueError(f"unsupported: {type(node).__name__}")
        if abs(result) > MAX_ABS:
            raise ValueError("number too large")
        return result

    return value(tree.body)


def respond(reply: str) -> str | None:
    """The environment's answer to a model turn: a calculator result, an error, a hint; ``None`` =
    answered."""
    if ANSWER.match(reply):
        return None
    if m := CALL.match(reply):
        try:
            return f"result: {evaluate(m.group(1))}"
        except ValueError as e:
            return f"error: {e}"
    return HINT


class CalculatorConfig(vf.TasksetConfig):
    num_tasks: int = Field(2000, ge=1, description="tasks")
    seed: int = Field(0, description="seed of the generated expressions")
    max_operand: int = Field(99, ge=2, le=10**4, description="largest operand")
    operators: int = Field(2, ge=1, le=4, description="operators per expression")
    instructions: str | None = Field(
        SYSTEM, description="the system message stating the protocol (null: none)"
    )


class CalcData(vf.TaskData):
    expression: str
    value: int
    completion: list[dict[str, str]]  # the reference episode after the prompt (PRIME-RL's SFT format)


def demonstration(expression: str) -> list[dict[str, str]]:
    """The reference episode: call the calculator on the expression, then answer with its result."""
    call = f"calc: {expression}"
    result = respond(call) or ""
    answer = f"answer: {result.removeprefix('result: ')}"
    return [{"role": "assistant", "content": call}, {"role": "user", "content": result},
            {"role": "assistant", "content": answer}]  # fmt: skip


class CalcTask(vf.Task[CalcData]):
    def conversation(self, trace: vf.Trace) -> list[tuple[str, str]]:
        nodes = trace.branches[-1].nodes if trace.branches else []
        return [(n.message.role, content_text(n.message.content)) for n in nodes]

    def calls(self, trace: vf.Trace) -> list[tuple[str, str | None]]:
        """Each calculator call of the model, with the environment's result (``None`` if it was refused)."""
        turns, out = self.conversation(trace), []
        for i, (role, text) in enumerate(turns):
            if role == "assistant" and (m := CALL.match(text)):
                nxt = turns[i + 1][1] if i + 1 < len(turns) else ""
                out.append((m.group(1), nxt[len("result: ") :] if nxt.startswith("result: ") else None))
        return out

    def answer(self, trace: vf.Trace) -> int | None:
        m = ANSWER.match(trace.last_reply or "")
        return int(m.group(1)) if m else None

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.answer(trace) == self.data.value)

    @vf.reward(weight=0.5)
    async def tool_use(self, trace: vf.Trace) -> float:
        calls, answer = self.calls(trace), self.answer(trace)
        ok = bool(calls) and all(r is not None for _, r in calls) and answer is not None
        return float(ok and str(answer) == calls[-1][1])

    @vf.metric
    async def bad_calls(self, trace: vf.Trace) -> float:
        return float(sum(r is None for _, r in self.calls(trace)))

    @vf.metric
    async def calls_made(self, trace: vf.Trace) -> float:
        return float(len(self.calls(trace)))


class CalculatorTaskset(vf.Taskset[CalcTask, CalculatorConfig]):
    def load(self):
        c = self.config
        rng = random.Random(f"calculator:{c.seed}")
        for i in range(c.num_tasks):
            terms = [str(rng.randint(2, c.max_operand)) for _ in range(c.operators + 1)]
            ops = [rng.choice("+-*") for _ in range(c.operators)]
            expression = terms[0] + "".join(o + t for o, t in zip(ops, terms[1:], strict=True))
            data = CalcData(
                id=f"calc-{i}",
                prompt=f"Compute {expression}.",
                system_prompt=c.instructions,
                expression=expression,
                value=evaluate(expression),
                completion=demonstration(expression),
            )
            yield CalcTask(data)


class CalculatorEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class CalculatorEnv(vf.Env[CalculatorEnvConfig]):
    """The loop between the model and the calculator: each model turn gets the environment's reply as the
    next user message, until the model answers or its ``max_turns`` run out."""

    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as exchange:
            segment = await exchange.turn()
            while not segment.terminated:
                reply = respond(segment.last_reply or "")
                if reply is None:
                    break
                segment = await exchange.turn(reply)


__all__ = ["CalculatorEnv", "CalculatorTaskset", "demonstration", "evaluate", "respond"]
