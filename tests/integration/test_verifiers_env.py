"""verifiers environments through the token route, in-process, against a real sidecar (the micro model).

The central check: every token the trace trains on is a token the sidecar sampled, with the sidecar's
logprob, after exactly the prompt the sidecar was given; every sampled span is trained once; the
environment's messages between turns are context (mask False).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from helpers import zygote
from helpers.launch import MICRO_MODEL, asyncrl, rl_args, serve_sidecar
from helpers.metrics import read_jsonl
from helpers.vf_support import check_trained_tokens, record_generate_calls, run_env

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vf_tasksets"


@pytest.fixture(scope="module", autouse=True)
def verifiers_preloaded():
    """This file's commands build verifiers environments, whose module imports verifiers (~6 s of CPU): the
    worker's zygote imports it once for them all."""
    zygote.preload("asyncrl.envs.vf_env")


@pytest.fixture
def sidecar(micro_sidecar):
    return micro_sidecar


@pytest.fixture
def recorded(monkeypatch):
    return record_generate_calls(monkeypatch)


def test_multi_turn_trace_trains_exactly_the_sampled_tokens_with_the_sidecars_logprobs(
    sidecar, tmp_path, recorded
):
    # no system prompt: the micro model's context is 128 characters
    calc = {"num_tasks": 8, "instructions": None}
    args = {"taskset": "asyncrl-calculator", "taskset_args": calc, "num_eval": 2, "max_turns": 2}
    per_row, counts = run_env(sidecar, tmp_path, args, n=3, max_tokens=6)
    rollouts = [r for rows in per_row for r in rows]
    assert len(rollouts) == 6 and counts["rollout/reward_errors"] == 0
    # a random micro model never writes `calc:`/`answer:`: the environment hints back, every episode runs 2
    # turns
    assert all(r.info["turns"] == 2 for r in rollouts), [r.info for r in rollouts]
    # the whole episode is readable: the task, each reply, the environment's answer between them, why it
    # stopped
    for r in rollouts:
        assert [m["role"] for m in r.info["transcript"]] == ["user", "assistant", "user", "assistant"], (
            r.info
        )
        assert r.info["transcript"][0]["content"].startswith("Compute ") and r.info["stop"] == "max_turns"
    assert all(r.branches and r.reward == 0.0 for r in rollouts)
    # the environment's reward functions and metrics, per episode (reported per environment by rl and eval)
    assert all(
        r.info["metrics"] == {"bad_calls": 0, "calls_made": 0, "correct": 0, "tool_use": 0} for r in rollouts
    )
    # between the model's turns the environment's hint is in each stream, untrained
    assert all(sum(not m for m in b.completion_mask) > 0 for r in rollouts for b in r.branches)
    check_trained_tokens(rollouts, recorded)  # every model turn trained, with the sidecar's logprobs, once
    assert len(recorded) == 6 * 2


def test_a_lost_turn_response_is_retried_and_the_turn_trained_once(sidecar, tmp_path, recorded, monkeypatch):
    """The harness's hop to the interception server loses the response of every turn's first attempt after
    the server committed the turn (the hard case for a retry; the CI run that prompted the retries lost a
    request's body instead): every episode still runs both its turns, and each turn is one sampled answer
    trained once. The SDKs' retry marker is stripped, so only the harness's Idempotency-Key can make the
    server replay."""
    lost: list[tuple] = []  # (rollout's bearer, body): one logical turn
    send = httpx.AsyncHTTPTransport.handle_async_request

    async def dropping(self, request):
        # (it alone would turn on verifiers' body replay)
        request.headers.pop("x-stainless-retry-count", None)
        response = await send(self, request)
        turn = (request.headers.get("Authorization"), request.content)
        # a committed turn (not the third post, refused at max_turns), the first time it is sent
        if (
            request.url.path.endswith("/chat/completions")
            and response.status_code == 200
            and turn not in lost
        ):
            await response.aread()  # the server committed the turn; its answer never arrives
            lost.append(turn)
            raise httpx.ReadError("connection reset (injected)", request=request)
        return response

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", dropping)
    calc = {"num_tasks": 8, "instructions": None}
    args = {"taskset": "asyncrl-calculator", "taskset_args": calc, "num_eval": 2, "max_turns": 2}
    per_row, counts = run_env(sidecar, tmp_path, args, n=2, max_tokens=6)
    rollouts = [r for rows in per_row for r in rows]
    assert "rollout/episode_errors" not in counts and all(not r.info["errors"] for r in rollouts), counts
    assert all(r.info["turns"] == 2 and r.branches for r in rollouts), [r.info for r in rollouts]
    assert len(lost) == 4 * 2  # every turn's first response was lost
    check_trained_tokens(rollouts, recorded)
    assert len(recorded) == 4 * 2  # one sampled answer per turn: the retries sampled nothing


def test_single_turn_verifiers_reverse_text_renders_the_builtin_prompt(sidecar, tmp_path, recorded):
    """verifiers' renderer (client side) and the sidecar's chat template give the same prompt ids: the same
    task through either path trains on the same tokens."""
    from asyncrl.envs.vf_env import VerifiersEnv

    task = {"num_tasks": 10, "min_len": 3, "max_len": 6}
    args = {"taskset": "asyncrl-reverse-text", "taskset_args": task, "num_eval": 2}
    per_row, _ = run_env(sidecar, tmp_path, args, n=2, max_tokens=6)
    rows = VerifiersEnv("vf", tmp_path, args).generate("train", 0)[:2]
    assert len(recorded) == 4
    for k, (req, _resp) in enumerate(recorded):
        body = {
            "messages": [{"role": "user", "content": rows[k // 2]["prompt"]}],
            "max_tokens": 1,
            "return_token_ids": True,
        }
        chat = httpx.post(f"{sidecar['url']}/v1/chat/completions", json=body, timeout=60).json()
        assert req["token_ids"] == chat["prompt_token_ids"]
    for rollouts in per_row:
        for r in rollouts:
            (b,) = r.branches  # single-turn: one branch, every completion token trained
            assert all(b.completion_mask) and 0.0 <= r.reward <= 1.0


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "env-worker"])
def test_a_reward_that_raises_or_hangs_scores_zero_and_is_counted(sidecar, tmp_path, monkeypatch, workers):
    """One run over tasks whose rewards raise and tasks whose rewards hang (an env worker's start-up is
    seconds of CPU: one run shows both)."""
    from asyncrl.envs.registry import env_class

    monkeypatch.syspath_prepend(str(FIXTURES))  # (a worker takes this process's sys.path)
    args = {"taskset": "asyncrl-test-faulty", "taskset_args": {"mode": "raise,hang"}, "num_eval": 1}
    first = env_class("verifiers")("vf", tmp_path, args).generate("train", 0)[:3]
    modes = [row["prompt"].split(":")[0] for row in first]  # the taskset's order, shuffled by the split
    assert sorted(set(modes)) == ["hang", "raise"], modes
    per_row, counts = run_env(sidecar, tmp_path, args, n=2, timeout_s=1.0, workers=workers, tasks=3)
    assert [r.reward for rows in per_row for r in rows] == [0.0] * 6, counts
    assert counts["rollout/reward_errors"] == 2 * modes.count("raise"), counts
    assert counts["rollout/reward_timeouts"] == 2 * modes.count("hang"), counts
    # the control (the same taskset without its fault scores 1.0, nothing counted) in this process: it is
    # about the taskset, and a worker's start-up would double the test's time
    ok_args = {**args, "taskset_args": {"mode": "ok"}}
    ok_rows, ok_counts = run_env(sidecar, tmp_path, ok_args, n=2)
    ok = [r for rows in ok_rows for r in rows]
    assert [r.reward for r in ok] == [1.0] * 4, [r.info for r in ok]
    assert ok_counts["rollout/reward_errors"] == ok_counts["rollout/reward_timeouts"] == 0, ok_counts


def test_a_reward_that_blocks_its_event_loop_stalls_an_env_worker_not_the_orchestrator(
    sidecar, tmp_path, monkeypatch
):
    """verifiers runs rewards on the event loop of the episode: an ``async def`` reward that sleeps 1 s
    synchronously stops that loop for 1 s. In an env worker it is the worker's loop; run in this process (the
    measurement's control), it is this one's."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    args = {"taskset": "asyncrl-test-faulty", "taskset_args": {"mode": "block"}, "num_eval": 1}
    lag: list[float] = []
    per_row, counts = run_env(sidecar, tmp_path, args, n=2, workers=1, lag=lag)
    assert [r.reward for rows in per_row for r in rows] == [1.0] * 4 and counts["rollout/reward_errors"] == 0
    assert lag[0] < 0.3, lag
    stalled: list[float] = []
    run_env(sidecar, tmp_path, args, n=1, tasks=1, workers=0, lag=stalled)
    assert stalled[0] >= 0.9, stalled  # the control: in this process the reward stops this loop


def test_a_changed_taskset_is_refused_not_trained_on(tmp_path):
    from asyncrl.envs.vf_env import VerifiersEnv

    env = VerifiersEnv(
        "vf", tmp_path, {"taskset": "asyncrl-calculator", "taskset_args": {"num_tasks": 5}, "num_eval": 1}
    )
    row = env.generate("train", 0)[0]
    other = VerifiersEnv(
        "vf", tmp_path, {"taskset": "asyncrl-calculator", "taskset_args": {"num_tasks": 5, "seed": 1}}
    )
    with pytest.raises(ValueError, match="run `asyncrl prepare` again"):
        other.task(row)


def test_bad_verifiers_config_names_the_key(tmp_path):
    from asyncrl.config.fields import ConfigError
    from asyncrl.envs.vf_env import VerifiersEnv

    with pytest.raises(ConfigError, match="env.vf.args.taskset"):
        VerifiersEnv("vf", tmp_path, {})
    with pytest.raises(ConfigError, match="env.vf.args"):
        VerifiersEnv("vf", tmp_path, {"taskset": "no-such-taskset-anywhere"})
    with pytest.raises(ConfigError, match="env.vf.args"):
        VerifiersEnv("vf", tmp_path, {"taskset": "asyncrl-calculator", "taskset_args": {"operators": 99}})


@pytest.mark.slow
def test_rl_on_a_mixture_of_builtin_and_verifiers_environments_end_to_end(setup, tmp_path):
    """`asyncrl prepare` + `asyncrl rl` + `asyncrl eval` on a mixture of the built-in reverse_text and the
    same task through verifiers (the shipped taskset): three processes, one rollout path, groups from both
    kinds in every step. (Whether the verifiers path learns as the built-in does is measured side by side
    over whole runs: benchmarks/vf_vs_builtin.sh.)"""
    import json

    data = tmp_path / "data"
    task = "{min_len: 3, max_len: 6, num_tasks: 2024, seed: 0}"
    env = [
        "env=[reverse_text,vf_reverse_text]",
        f"env.vf_reverse_text.args.taskset_args={task}",
        "env.vf_reverse_text.args.num_eval=24",
    ]
    # the built-in's task overrides stay
    common = [a for a in setup["common"] if not a.startswith("data_dir=")]
    asyncrl("prepare", f"data_dir={data}", *common, *env, "model.init.build=false", check=True)
    run = tmp_path / "rl"
    # 8 prompts x 4 samples a step: both kinds in every step at an eighth of rl_args' rollouts; one env
    # worker (the pool's growth has tests of its own, and each worker imports verifiers: seconds of CPU
    # apiece)
    one_worker = "orchestrator.env_workers.max=1"
    small = ("max_steps=8", "orchestrator.prompts_per_step=8", "orchestrator.group_size=4", one_worker)
    args = [a for a in rl_args(setup, run, *small) if not a.startswith("data_dir=")]
    proc = asyncrl("rl", *args, f"data_dir={data}", *env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    assert [r["step"] for r in orch] == list(range(8))
    warned = [
        line for line in (run / "logs" / "orchestrator.log").read_text().splitlines() if "WARNING" in line
    ]
    assert all(r["rollout/reward_errors"] == 0 and "rollout/episode_errors" not in r for r in orch), warned
    # the SFT model half-reverses already, through either path
    for name in ("reverse_text", "vf_reverse_text"):
        rewards = [r[f"rollout/{name}/reward_mean"] for r in orch if f"rollout/{name}/reward_mean" in r]
        assert len(rewards) >= 6 and 0.1 < sum(rewards) / len(rewards) < 1, (name, rewards)
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    assert [r["step"] for r in train] == list(range(8)) and train[0]["train/mismatch_kl"] < 1e-3
    samples = [s for step in range(8) for s in read_jsonl(run / "samples" / f"step_{step}.jsonl")]
    assert {s["env"] for s in samples} == {"reverse_text", "vf_reverse_text"}
    assert all(s["turns"] == 1 for s in samples if s["env"] == "vf_reverse_text")
    # a verifiers episode's line holds its messages (here one turn: the task, the reply) and why it stopped
    for s in samples:
        if s["env"] == "vf_reverse_text":
            assert [m["role"] for m in s["transcript"]][-2:] == ["user", "assistant"] and s["stop"], s
            assert s["transcript"][-1]["content"].strip() == s["completion"]
        else:  # a single-turn environment's line is its prompt and completion
            assert "transcript" not in s and "stop" not in s
    # the taskset's own reward function, per step and per sample
    assert all(
        r["rollout/vf_reverse_text/lcs_mean"] == r["rollout/vf_reverse_text/reward_mean"] for r in orch
    )
    assert all(s["metrics"]["lcs"] == s["reward"] for s in samples if s["env"] == "vf_reverse_text")
    # `asyncrl eval` runs both kinds the same way
    out = tmp_path / "eval"
    evalargs = [
        f"data_dir={data}",
        *common,
        *env,
        one_worker,
        "orchestrator.max_tokens=10",
        "eval.n=2",
        "eval.num_examples=8",
    ]
    proc = asyncrl("eval", *evalargs, f"model.name={run / 'model'}", f"eval.out_dir={out}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = json.loads((out / "metrics.json").read_text())
    for name in ("reverse_text", "vf_reverse_text"):
        assert m[f"{name}/num_examples"] == 8 and 0.0 < m[f"{name}/greedy/reward_mean"] <= 1.0
    assert m["vf_reverse_text/greedy/lcs_mean"] == m["vf_reverse_text/greedy/reward_mean"]
    evaluated = read_jsonl(out / "samples.jsonl")
    assert len(evaluated) == 2 * 8 * 3
    assert all(
        s["transcript"][-1]["role"] == "assistant" for s in evaluated if s["env"] == "vf_reverse_text"
    )


@pytest.mark.slow
def test_sft_on_multi_turn_demonstrations_trains_what_episodes_then_sample(tmp_path, tmp_path_factory):
    """`asyncrl sft` on the calculator's reference episodes (multi-turn: call the tool, read its result,
    answer) teaches the micro model the protocol, and what SFT trained on is, token for token, what an
    episode through verifiers' TrainClient then samples: the same stream (the renderer's turns = the chat
    template's), the same trained mask (the model's replies up to their end token; the calculator's messages
    are context)."""
    from transformers import AutoTokenizer

    from asyncrl.envs.vf_env import VerifiersEnv
    from asyncrl.models.hf import render_conversation

    calc = {"num_tasks": 600, "max_operand": 9, "operators": 1, "instructions": None}
    args = {"taskset": "asyncrl-calculator", "taskset_args": calc, "num_eval": 8, "max_turns": 3}
    keys = [
        f"{'+' if k == 'instructions' else ''}env.vf_calculator.args.taskset_args.{k}={v}"
        for k, v in calc.items()
    ]
    env = ["env=[vf_calculator]", *(k.replace("None", "null") for k in keys)]
    common = [f"data_dir={tmp_path / 'data'}", *env, "env.vf_calculator.args.num_eval=8", "seq_len=128"]
    model, sft = tmp_path / "model", tmp_path / "sft"
    # digits and operators need the printable charset (the micro model's default is lowercase letters)
    asyncrl(
        "prepare",
        *common,
        *MICRO_MODEL,
        "model.init.charset=ascii_printable",
        f"model.name={model}",
        check=True,
    )
    # 120 steps: all 16 tasks below solved (100 steps: 11 of them, 150: 16), at 0.33 s of CPU a step
    asyncrl("sft", *common, f"model.name={model}", f"sft.run_dir={sft}", "sft.max_steps=120", check=True)
    with serve_sidecar(sft / "model", tmp_path_factory) as server:
        per_row, counts = run_env(server, tmp_path, args, n=1, temperature=0.0, max_tokens=12, tasks=16)
    assert counts["rollout/reward_errors"] == counts.get("rollout/episode_errors", 0) == 0, counts
    vf, tok = VerifiersEnv("vf", tmp_path, args), AutoTokenizer.from_pretrained(sft / "model")
    solved = 0
    for row, (rollout,) in zip(vf.generate("train", 0), per_row, strict=False):
        if rollout.reward < 1.5:  # not solved: the model's replies are not the reference ones
            continue
        solved += 1
        (branch,) = rollout.branches
        prompt, completion, mask = render_conversation(tok, vf.prompt(row), vf.demonstration(row))
        assert (branch.prompt_ids, branch.completion_ids, branch.completion_mask) == (
            prompt,
            completion,
            mask,
        )
    assert solved >= 8, [r.reward for (r,) in per_row]  # SFT taught it to call the tool and copy its result


def test_vf_eval_runs_offline_against_the_sidecar(sidecar, tmp_path):
    """verifiers' own CLI, pointed at `asyncrl serve`: its EvalClient streams chat completions (SSE)."""
    import json
    import os
    import subprocess

    out = tmp_path / "out"
    cmd = [
        str(Path(sys.executable).parent / "vf-eval"),
        "asyncrl-reverse-text",
        "-m",
        sidecar["model"],
        "--client.base-url",
        f"{sidecar['url']}/v1",
        "--env.agent.harness.id",
        "asyncrl_chat",
        "--env.agent.runtime.type",
        "subprocess",
        "--env.taskset.num-tasks",
        "4",
        "--env.taskset.min-len",
        "3",
        "--env.taskset.max-len",
        "6",
        "--sampling.max-tokens",
        "8",
        "-n",
        "4",
        "--no-push",
        "--no-rich",
        "-o",
        str(out),
    ]
    env = {**os.environ, "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (traces,) = out.glob("*/traces.jsonl")
    episodes = [json.loads(line) for line in traces.read_text().splitlines() if line.strip()]
    assert len(episodes) == 4
    for e in episodes:
        (trace,) = e["traces"]
        assert trace["ok"] and not trace["errors"] and trace["stop_condition"] == "agent_completed"
        assert 0.0 <= trace["rewards"]["lcs"]["score"] <= 1.0  # the random micro model's reply, scored
        assert [n["message"]["role"] for n in trace["nodes"]] == ["user", "assistant"]


def test_every_agent_of_a_paired_env_runs_offline_and_keeps_its_own_settings(tmp_path):
    """verifiers' user-sim env over our taskset: its `user` role names the network-bound `null` harness and
    its own turn cap; both roles get the offline harness and runtime, and the cap survives (under ours)."""
    from asyncrl.envs.vf_env import VerifiersEnv

    args = {
        "taskset": "asyncrl-reverse-text",
        "taskset_args": {"num_tasks": 4},
        "env_id": "user-sim",
        "num_eval": 1,
    }
    cfg = VerifiersEnv("vf", tmp_path, {**args, "max_turns": 20}).vf_env.config
    for role in (cfg.assistant, cfg.user):
        assert role.harness.id == "asyncrl_chat" and role.runtime.type == "subprocess"
    assert cfg.user.max_turns == 8 and cfg.assistant.max_turns == 20
    assert VerifiersEnv("vf", tmp_path, {**args, "max_turns": 3}).vf_env.config.user.max_turns == 3
