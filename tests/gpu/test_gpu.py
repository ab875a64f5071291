"""On the lent GPU: the vLLM sidecar, RL with it, and FSDP2 on two GPUs (run: pytest -m gpu tests/gpu)."""

from __future__ import annotations

import concurrent.futures
import json
import math
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.utils.process import free_port
from gpu.conftest import GPU_COMMON, record
from helpers.inputs import staggered_sampling
from helpers.launch import asyncrl
from helpers.metrics import read_jsonl

pytestmark = pytest.mark.gpu


def greedy_tokens(
    url: str, model: Path, content: str = "hello", max_tokens: int = 12, digits: int | None = 3
) -> tuple[list[int], list[float]]:
    """One greedy completion of a fixed prompt: its token ids and logprobs (rounded to ``digits``; None:
    exact)."""
    body = {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    logprobs = [x["logprob"] for x in c["logprobs"]["content"]]
    return c["token_ids"], logprobs if digits is None else [round(x, digits) for x in logprobs]


def start_vllm(model: Path, log: Path, *extra: str, env: dict[str, str] | None = None):
    from asyncrl.utils.children import spawn, wait_healthy

    port = free_port()
    proc = spawn(
        "vllm",
        [
            sys.executable,
            "-m",
            "asyncrl",
            "serve",
            "inference.backend=vllm",
            "model=gpu_small",
            f"model.name={model}",
            f"inference.port={port}",
            "inference.vllm.enforce_eager=true",
            "inference.vllm.gpu_memory_utilization=0.3",
            *extra,
        ],
        log,
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=300)
    return proc, url


def test_varlen_attention_matches_sdpa_on_gpu(tmp_path):
    """torch's flash varlen kernel on packed rows == sdpa's math kernel on each sample (bf16, grouped-query
    attention): logits, and every parameter's gradient."""
    import inspect

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.varlen import varlen_attn
    from transformers import AutoModelForCausalLM

    from asyncrl.config.compose import compose_config
    from asyncrl.models.attention import register
    from asyncrl.models.hf import build_tiny_model
    from helpers.launch import MICRO_MODEL

    record("torch_varlen_attn_signature", str(inspect.signature(varlen_attn)))
    register()
    # 4 query heads share 2
    init = compose_config([*MICRO_MODEL, "model.init.num_key_value_heads=2"]).model.init
    model = build_tiny_model(init, tmp_path / "model", seed=0)
    kw = dict(dtype=torch.bfloat16)
    ref = AutoModelForCausalLM.from_pretrained(model, attn_implementation="sdpa", **kw).cuda()
    var = AutoModelForCausalLM.from_pretrained(model, attn_implementation="varlen", **kw).cuda()
    lens = [37, 120, 5, 64]
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = [torch.randint(6, 30, (n,), device="cuda", generator=g) for n in lens]
    row = torch.cat(ids)[None]
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
    out = var(input_ids=row, position_ids=pos, use_cache=False).logits[0]
    # the reference on sdpa's math kernel: its flash kernel is the one varlen calls, and could not tell it
    # wrong
    with sdpa_kernel(SDPBackend.MATH):
        singles = [ref(input_ids=x[None]).logits[0] for x in ids]
    at = 0
    for single, n in zip(singles, lens, strict=True):
        torch.testing.assert_close(out[at : at + n].float(), single.float(), atol=3e-2, rtol=3e-2)
        at += n
    # backward: the same loss over the packed row and over each sample alone gives the same gradients (only
    # the attention kernel differs, so bf16 rounding; a wrong query/key/value gradient moves them by orders
    # more)
    out.float().logsumexp(-1).sum().backward()
    sum(single.float().logsumexp(-1).sum() for single in singles).backward()
    errors = {
        name: float((p.grad.float() - q.grad.float()).norm() / q.grad.float().norm())
        for (name, p), q in zip(var.named_parameters(), ref.parameters(), strict=True)
        if q.grad is not None and q.grad.abs().max() > 0
    }
    record("varlen_vs_sdpa_grad_rel_err", errors)
    assert errors and all(math.isfinite(e) and e < 3e-2 for e in errors.values()), errors  # NaN fails too


def packed_kernel(name: str):
    """``fn(q, k, v, cu, max_len)`` for a packed attention kernel the trainer can use; skips if not
    installed."""
    if name == "varlen":
        from asyncrl.models.attention import packed_attention

        return packed_attention
    if name == "varlen_fa4":  # flash-attn-4 through asyncrl's custom ops (models/fa4.py)
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed")
        from asyncrl.models.fa4 import packed_attention_fa4

        return packed_attention_fa4
    fa4 = pytest.importorskip(
        "flash_attn.cute", reason="flash-attn-4 is not installed"
    ).flash_attn_varlen_func

    # as transformers 5.17 calls it for attn_implementation=flash_attention_4
    def flash_attention_4(q, k, v, cu, m):
        out = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return flash_attention_4


# flash-attn-4 lives in the trainer's own environment only (beside vLLM it breaks the engine's start): the
# lanes run these cases under $TRAINER_PYTHON (benchmarks/gpu_suite_lanes.sh)
FA4 = pytest.mark.trainer_env


@pytest.mark.parametrize(
    "kernel",
    ["varlen", pytest.param("flash_attention_4", marks=FA4), pytest.param("varlen_fa4", marks=FA4)],
)
def test_packed_attention_kernel_matches_exact_attention(kernel):
    """A packed causal attention kernel on Qwen3-0.6B's attention shape (16 query, 8 key/value heads, dim
    128), bf16, against the exact answer (fp32, each sample alone): output and the query, key and value
    gradients."""
    from asyncrl.models.attention import per_sample_attention

    fn = packed_kernel(kernel)
    lens = [1, 300, 1024, 77, 2047]
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(sum(lens), h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (16, 8, 8)
    )
    grad = torch.randn(sum(lens), 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*leaves, cu, max(lens))
    out.backward(grad)
    exact = [x.float().requires_grad_(True) for x in (q, k, v)]
    truth = per_sample_attention(*exact, cu)
    truth.backward(grad.float())
    errors = {
        name: float((a.float() - b).abs().max() / b.abs().max())
        for name, a, b in [("out", out.detach(), truth.detach())]
        + [(f"grad_{n}", x.grad, y.grad) for n, x, y in zip("qkv", leaves, exact, strict=True)]
    }
    record(f"{kernel}_rel_err_vs_exact", errors)
    # bf16 rounding is ~4e-3 of the largest value; NaN fails too
    assert all(math.isfinite(e) and e < 2e-2 for e in errors.values()), errors


def test_vllm_weight_update_changes_outputs_and_restores(gpu_setup, tmp_path):
    # the base model lies outside the sidecar's default weights roots (its run directory and starting model)
    proc, url = start_vllm(
        gpu_setup["sft_model"], tmp_path / "vllm.log", f"inference.weights_roots=[{gpu_setup['root']}]"
    )
    try:
        greedy = partial(greedy_tokens, url, gpu_setup["sft_model"])
        before = greedy()
        assert len(before[0]) > 0
        r = httpx.post(
            f"{url}/update_weights", json={"path": str(gpu_setup["base_model"]), "version": 1}, timeout=300
        )
        assert r.status_code == 200, r.text
        record("vllm_update_weights_s_small_model", r.json()["seconds"])
        assert httpx.get(f"{url}/policy").json() == {"version": 1}
        assert greedy() != before
        # the random-init weights sample near uniformly: 8 samples that stop on different steps all come back
        # (vLLM 0.26's token route answered only those still running at its last step:
        # final_only_unless_streamed)
        chat = {
            "model": str(gpu_setup["sft_model"]),
            "messages": [{"role": "user", "content": "abc"}],
            "max_tokens": 1,
        }
        prompt = httpx.post(
            f"{url}/v1/chat/completions", json={**chat, "return_token_ids": True}, timeout=60
        ).json()
        body = {"model": chat["model"], "token_ids": prompt["prompt_token_ids"]}
        r = httpx.post(
            f"{url}/inference/v1/generate",
            json={**body, "sampling_params": staggered_sampling(chat["model"])},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        lengths = {c["index"]: len(c["token_ids"]) for c in r.json()["choices"]}
        record("vllm_generate_staggered_lengths", lengths)
        assert sorted(lengths) == list(range(8)) and len(set(lengths.values())) > 1
        r = httpx.post(
            f"{url}/update_weights", json={"path": str(gpu_setup["sft_model"]), "version": 2}, timeout=300
        )
        assert r.status_code == 200
        assert greedy() == before  # token for token
        missing = {"path": str(gpu_setup["root"] / "nope"), "version": 3}
        assert httpx.post(f"{url}/update_weights", json=missing).status_code == 404
        assert httpx.post(f"{url}/update_weights", json={"path": "/etc", "version": 3}).status_code == 403
        bad = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
        assert 400 <= bad.status_code < 500
    finally:
        from asyncrl.utils.children import stop

        stop([proc], timeout_s=60)


def rl_with_vllm(gpu_setup, run: Path, *extra: str) -> tuple[list[dict], list[dict]]:
    """`asyncrl rl` from the GPU SFT model with the vLLM sidecar; the orchestrator's and trainer's
    metrics."""
    proc = asyncrl(
        "rl",
        *gpu_setup["common"],
        f"model.name={gpu_setup['sft_model']}",
        f"run_dir={run}",
        "inference.backend=vllm",
        "inference.vllm.enforce_eager=true",
        "inference.vllm.gpu_memory_utilization=0.3",
        "orchestrator.max_tokens=10",
        "orchestrator.prompts_per_step=16",
        "orchestrator.group_size=16",
        "launcher.progress=false",
        *extra,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(run / "metrics" / "orchestrator.jsonl"), read_jsonl(run / "metrics" / "trainer.jsonl")


def test_rl_with_vllm_reward_rises(gpu_setup, tmp_path):
    run = tmp_path / "rl"
    # lr 3e-4 over 40 steps: at 1e-3 over 25 steps one run rose (0.82 -> 0.85) and the next stayed flat
    # within noise; at 3e-4 the first-10 vs last-10 means went 0.846 -> 0.894 (benchmarks/results/)
    orch, train = rl_with_vllm(
        gpu_setup, run, "max_steps=40", "trainer.optim.lr=3e-4", "model.attn_implementation=varlen"
    )
    rewards = [r["rollout/reward_mean"] for r in orch]
    record("vllm_rl_rewards", [round(x, 4) for x in rewards])
    record("vllm_step0_mismatch_kl_bf16", train[0]["train/mismatch_kl"])
    record(
        "vllm_update_weights_s_median", sorted(r["time/update_weights_s"] for r in orch[1:])[len(orch) // 2]
    )
    record("vllm_rl_masked_frac", [round(r["train/masked_frac"], 4) for r in train])
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.01, rewards
    assert train[0]["train/mismatch_kl"] < 1e-2  # trainer (bf16 autocast) vs vLLM (bf16) at the same weights


@pytest.mark.parametrize("level,strategy", [(0, "auto"), (1, "auto"), (1, "fsdp2")])
def test_bitwise_mode_trainer_logprobs_are_vllms(gpu_setup, tmp_path, level, strategy):
    """numerics=bitwise: the trainer's logprobs of every sample, under the policy that sampled it, equal the
    sidecar's bit for bit, so mismatch_kl is exactly 0 on-policy and behavior_kl after every update, async
    too (and under FSDP2, whose gathered copies the kept policies must not outlive)."""
    orch, train = rl_with_vllm(
        gpu_setup,
        tmp_path / "rl",
        "numerics=bitwise",
        "max_steps=5",
        f"async_level={level}",
        f"trainer.fabric.strategy={strategy}",
        "trainer.behavior_kl=true",
        "trainer.optim.lr=3e-4",
    )
    mismatch = [r["train/mismatch_kl"] for r in train]
    behavior = [r["train/behavior_kl"] for r in train]
    record(f"bitwise_async{level}_{strategy}_mismatch_kl", mismatch)
    record(f"bitwise_async{level}_{strategy}_behavior_kl", behavior)
    assert len(train) == 5 and behavior == [0.0] * 5
    if level == 0:
        assert mismatch == [0.0] * 5
    else:  # mismatch_kl also sees the policy's change since sampling: not 0 once the policy moved
        assert mismatch[0] == 0.0 and all(m > 0 for m in mismatch[1:])


def synthetic_train_args(model, strategy: str) -> list[str]:
    """``asyncrl train`` for 3 steps on the micro model over synthetic rollouts (tests/helpers/synthetic.py),
    on the GPU."""
    return [
        f"model.name={model}",
        "max_steps=3",
        "async_level=0",
        "strict_async=false",
        "seq_len=64",
        "orchestrator.max_tokens=16",
        "trainer.optim.lr=1e-3",
        *GPU_COMMON,
        f"trainer.fabric.strategy={strategy}",
    ]


@pytest.mark.parametrize("strategy", ["fsdp2", "auto"])
def test_compiled_trainer_learns_as_eager(micro_model, tmp_path, strategy):
    """trainer.fabric.compile=true (compiled decoder layers, fused logprob head) on packed varlen rows gives
    the eager trainer's losses and gradient norms, step after step (bf16: the fusions round differently)."""
    from helpers.synthetic import write_synthetic_rollouts

    common = [*synthetic_train_args(micro_model, strategy), "model.attn_implementation=varlen"]
    metrics = {}
    for compiled in (False, True):
        run_dir = tmp_path / f"compile{int(compiled)}"
        write_synthetic_rollouts(run_dir, steps=3, ranks=1)
        proc = subprocess.run(
            [sys.executable, "-m", "asyncrl", "train", *common, f"run_dir={run_dir}",
             f"trainer.fabric.compile={str(compiled).lower()}"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = [json.loads(x) for x in (run_dir / "metrics" / "trainer.jsonl").read_text().splitlines()]
        metrics[compiled] = {k: [r[f"train/{k}"] for r in rows] for k in ("loss", "grad_norm")}
    record(f"compile_vs_eager_{strategy}", {str(k): v for k, v in metrics.items()})
    for key in ("loss", "grad_norm"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=2e-2, abs=1e-3)


@pytest.mark.two_gpus
def test_fsdp2_two_gpus_matches_one(micro_model, tmp_path):
    from helpers.synthetic import write_synthetic_rollouts

    common = synthetic_train_args(micro_model, "fsdp2")
    runs = {
        "one": ["trainer.fabric.devices=1", "trainer.fabric.gpus=0"],
        "two": ["trainer.fabric.devices=2", "trainer.fabric.gpus='0,1'"],
    }
    for name, extra in runs.items():
        write_synthetic_rollouts(tmp_path / name, steps=3, ranks=2)
        env_gpus = extra[-1].split("=")[1].strip("'")
        proc = subprocess.run(
            [sys.executable, "-m", "asyncrl", "train", *common, f"run_dir={tmp_path / name}", *extra],
            capture_output=True,
            text=True,
            timeout=600,
            env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": env_gpus},
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    losses = {
        n: [
            json.loads(x)["train/loss"]
            for x in (tmp_path / n / "metrics" / "trainer.jsonl").read_text().splitlines()
        ]
        for n in runs
    }
    record("fsdp2_losses_1gpu_vs_2gpu", losses)
    # bf16 compute, sharded reductions
    assert losses["one"] == pytest.approx(losses["two"], rel=2e-2, abs=1e-3)


@pytest.mark.two_gpus
def test_rl_nccl_transport_two_gpus(gpu_setup, tmp_path):
    """weights.transport=nccl: the trainer (GPU 1) broadcasts every policy into vLLM (GPU 0). On-policy
    (async_level 0) the trainer and the sidecar must hold the same weights at every step, so mismatch_kl
    stays at bf16 noise only if each broadcast really landed (a stale sidecar lags one lr=1e-3 step)."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(
        gpu_setup,
        run,
        "max_steps=10",
        "async_level=0",
        "weights.transport=nccl",
        "inference.gpus=['0']",
        "trainer.fabric.gpus=1",
        "trainer.optim.lr=1e-3",
    )
    mismatch = [r["train/mismatch_kl"] for r in train]
    updates = [r["time/update_weights_s"] for r in orch[1:]]
    record("nccl_mismatch_kl_per_step", mismatch)
    record("nccl_update_weights_s", updates)
    # versions 1..9 went over NCCL (a manifest, no safetensors); 10, the final one, as files
    manifests = [s for s in range(1, 11) if (run / "weights" / f"step_{s}" / "nccl.json").is_file()]
    assert [r["async/policy_version"] for r in orch] == list(range(10))
    assert max(mismatch) < 1e-3, mismatch
    assert not list((run / "weights").glob("step_[1-9]/*.safetensors"))
    assert list((run / "weights").glob("step_10/*.safetensors"))
    record("nccl_manifest_versions_on_disk", manifests)


@pytest.mark.parametrize("reload", ["direct", "layerwise"])
def test_rl_ipc_transport_one_gpu(gpu_setup, tmp_path, reload):
    """weights.transport=ipc: the trainer and vLLM share one GPU and every policy is copied from the
    trainer's buffer through a CUDA IPC handle. On-policy, mismatch_kl stays at bf16 noise only if each copy
    landed (a stale sidecar lags one lr=1e-3 step)."""
    run = tmp_path / "rl"
    orch, train = rl_with_vllm(
        gpu_setup, run, "max_steps=10", "async_level=0", "weights.transport=ipc", f"weights.reload={reload}",
        "trainer.optim.lr=1e-3",
    )  # fmt: skip
    mismatch = [r["train/mismatch_kl"] for r in train]
    record(f"ipc_{reload}_mismatch_kl_per_step", mismatch)
    record(f"ipc_{reload}_update_weights_s", [r["time/update_weights_s"] for r in orch[1:]])
    record(f"ipc_{reload}_publish_s", [r["time/publish_s"] for r in train if "time/publish_s" in r])
    assert [r["async/policy_version"] for r in orch] == list(range(10))
    assert max(mismatch) < 1e-3, mismatch
    loaded = [s for s in range(1, 10) if (run / "weights" / f"step_{s}" / "ipc.loaded").is_file()]
    assert not list((run / "weights").glob("step_[1-9]/*.safetensors"))  # 1-9 went through the buffer
    assert loaded and list((run / "weights").glob("step_10/*.safetensors"))


def test_deferred_logprobs_are_the_per_step_ones(gpu_setup, tmp_path):
    """inference.vllm.defer_logprobs: a non-streamed request's logprobs (held in the engine core, sent once)
    equal those of the same request streamed (sent every step, which the plugin leaves alone), number for
    number; and requests of several samples get one logprob per token each; a request vLLM aborts while its
    client waits (vLLM's own dev-mode ``/pause?mode=abort``) answers 200 with no tokens and finish reason
    ``abort``, not 500."""
    import openai

    from asyncrl.inference.vllm.logprobs import LOG_LINE
    from asyncrl.inference.vllm.sampled import LOG_LINE as KERNEL_LINE
    from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD, logprob_values

    log = tmp_path / "vllm.log"
    # no prefix caching: the second request's prefill must not start from the first one's cached blocks
    proc, url = start_vllm(
        gpu_setup["sft_model"],
        log,
        "inference.vllm.defer_logprobs=true",
        "inference.vllm.enable_prefix_caching=false",
        # vLLM's /pause with mode=abort, in place of asyncrl's (mode=keep)
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    model = str(gpu_setup["sft_model"])
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        ask = dict(
            model=model,
            messages=[{"role": "user", "content": "abcdef"}],
            max_tokens=24,
            temperature=1.0,
            seed=7,
            logprobs=True,
        )
        once = client.chat.completions.create(**ask).choices[0]
        streamed = [c.choices[0] for c in client.chat.completions.create(**ask, stream=True) if c.choices]
        per_step = [e.logprob for c in streamed if c.logprobs for e in c.logprobs.content]
        record("deferred_vs_streamed_logprobs", {"deferred": [e.logprob for e in once.logprobs.content],
                                                  "streamed": per_step})  # fmt: skip
        assert "".join(c.delta.content or "" for c in streamed) == once.message.content
        assert [e.logprob for e in once.logprobs.content] == per_step and len(per_step) > 0

        body = {
            "model": model,
            "max_tokens": 32,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        # asyncrl's compact logprobs: the numbers of vLLM's per-token form, one base64 array a choice
        seeded = {**body, "messages": ask["messages"], "n": 3, "seed": 11}
        forms = [
            httpx.post(f"{url}/v1/chat/completions", json={**seeded, **extra}, timeout=120)
            for extra in (
                {},
                {LOGPROBS_ENCODING_FIELD: LOGPROBS_ENCODING},
                {LOGPROBS_ENCODING_FIELD: "json"},
            )
        ]
        record("compact_logprobs", [f.text[:600] for f in forms])
        standard, compact = (f.json()["choices"] for f in forms[:2])
        for s, c in zip(standard, compact, strict=True):
            assert c["token_ids"] == s["token_ids"] and c["logprobs"]["content"] is None
            assert logprob_values(c["logprobs"], len(c["token_ids"])) == [
                e["logprob"] for e in s["logprobs"]["content"]
            ]
        assert forms[2].status_code == 400 and LOGPROBS_ENCODING_FIELD in forms[2].text
        # concurrent, so their steps share batches: one asks for the top 2 too (wider arrays for every row)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            many = list(pool.map(lambda i: httpx.post(
                f"{url}/v1/chat/completions", timeout=120,
                json={**body, "messages": [{"role": "user", "content": "x" * (i + 3)}], "n": 4,
                      **({"top_logprobs": 2} if i == 1 else {})}), range(4)))  # fmt: skip
        for i, r in enumerate(many):
            assert r.status_code == 200, r.text
            for c in r.json()["choices"]:
                assert len(c["logprobs"]["content"]) == len(c["token_ids"]) > 0
                assert all(
                    len(e.get("top_logprobs") or []) == (2 if i == 1 else 0)
                    for e in c["logprobs"]["content"]
                )

        long = {
            **body,
            "messages": [{"role": "user", "content": "abc"}],
            "max_tokens": 2000,
            "ignore_eos": True,
            "n": 2,
        }
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            cut = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=long, timeout=120)
            time.sleep(1.0)  # decoding by now: the engine core holds its logprobs
            assert httpx.post(f"{url}/pause", params={"mode": "abort"}, timeout=60).status_code == 200
            answer = cut.result()
        assert httpx.post(f"{url}/resume", timeout=60).status_code == 200
        record("aborted_under_deferral", {"status": answer.status_code, "body": answer.text[:400]})
        assert answer.status_code == 200, answer.text
        for c in answer.json()["choices"]:
            assert (
                c["finish_reason"] == "abort" and c["token_ids"] == [] and c["logprobs"]["content"] == []
            ), c
        after = httpx.post(
            f"{url}/v1/chat/completions",
            json={**body, "messages": [{"role": "user", "content": "ab"}]},
            timeout=120,
        )
        assert after.status_code == 200 and len(after.json()["choices"][0]["token_ids"]) > 0, after.text
    finally:
        from asyncrl.utils.children import stop

        stop([proc], timeout_s=60)
    assert LOG_LINE in log.read_text(), "the plugin did not defer logprobs in vLLM's engine core"
    assert KERNEL_LINE in log.read_text(), "the plugin did not install the logprobs kernel (on by default)"


def test_vllm_token_route_streaming_and_verifiers_episodes(gpu_setup, tmp_path, monkeypatch):
    """What verifiers needs, on the vLLM backend: vLLM's own /inference/v1/generate, max_model_len in
    /v1/models, SSE streaming read by the openai client; then verifiers episodes (single- and multi-turn)
    whose trained tokens are exactly what vLLM sampled, with vLLM's logprobs."""
    import openai

    from helpers.vf_support import check_trained_tokens, record_generate_calls, run_env

    proc, url = start_vllm(gpu_setup["sft_model"], tmp_path / "vllm.log")
    model = str(gpu_setup["sft_model"])
    try:
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        record("vllm_models_max_model_len", card.get("max_model_len"))
        assert card["id"] == model and isinstance(card["max_model_len"], int)
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 1, "return_token_ids": True}
        prompt = httpx.post(f"{url}/v1/chat/completions", json={**body, "model": model}, timeout=60).json()
        sp = {
            "n": 8,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 1,
            "skip_special_tokens": False,
        }
        r = httpx.post(
            f"{url}/inference/v1/generate",
            json={"model": model, "token_ids": prompt["prompt_token_ids"], "sampling_params": sp},
            timeout=60,
        )
        record("vllm_generate_status", r.status_code)
        assert r.status_code == 200, r.text
        data = r.json()
        record("vllm_generate_keys", sorted(data))
        record("vllm_generate_lengths", [len(c["token_ids"]) for c in data["choices"]])
        # stopping on different steps: below
        assert sorted(c["index"] for c in data["choices"]) == list(range(8))
        for c in data["choices"]:
            assert [e["token"] for e in c["logprobs"]["content"]] == [
                f"token_id:{t}" for t in c["token_ids"]
            ]
            assert c["finish_reason"] in ("stop", "length")
        bad = httpx.post(f"{url}/inference/v1/generate", json={"model": model, "token_ids": "x"}, timeout=60)
        assert 400 <= bad.status_code < 500
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "abcd"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        # verifiers episodes against vLLM: single-turn reverse_text and the multi-turn calculator
        sidecar = {"url": url, "model": model}
        recorded = record_generate_calls(monkeypatch)
        task = {"num_tasks": 10, "min_len": 3, "max_len": 6}
        rev, _ = run_env(
            sidecar, tmp_path, {"taskset": "asyncrl-reverse-text", "taskset_args": task, "num_eval": 2}, 4
        )
        calc = {
            "taskset": "asyncrl-calculator",
            "taskset_args": {"num_tasks": 8},
            "num_eval": 2,
            "max_turns": 3,
        }
        mt, counts = run_env(sidecar, tmp_path, calc, 3, max_tokens=16)
        rollouts = [r for rows in rev + mt for r in rows]
        record("vllm_vf_rewards", [round(r.reward, 3) for r in rollouts])
        record("vllm_vf_turns", [r.info.get("turns") for r in rollouts])
        assert counts.get("rollout/episode_errors", 0) == 0, [r.info for rows in mt for r in rows]
        check_trained_tokens(rollouts, recorded)
        assert any(r.info["turns"] > 1 for rows in mt for r in rows)
    finally:
        from asyncrl.utils.children import stop

        stop([proc], timeout_s=60)


def test_rl_with_vllm_on_the_verifiers_reverse_text(gpu_setup, tmp_path):
    """The same run as test_rl_with_vllm_reward_rises, with reverse_text through verifiers (the token route):
    the rewards of both are recorded side by side."""
    data = tmp_path / "data"
    task = "{min_len: 3, max_len: 6, num_tasks: 2024, seed: 0}"
    env = [
        "env=[vf_reverse_text]",
        f"env.vf_reverse_text.args.taskset_args={task}",
        "env.vf_reverse_text.args.num_eval=24",
    ]
    asyncrl("prepare", f"data_dir={data}", *env, "model.init.build=false", check=True)
    common = [a for a in gpu_setup["common"] if not a.startswith(("data_dir=", "env.reverse_text."))]
    setup = {**gpu_setup, "common": [*common, f"data_dir={data}", *env]}
    orch, train = rl_with_vllm(setup, tmp_path / "rl", "max_steps=40", "trainer.optim.lr=3e-4")
    rewards = [r["rollout/reward_mean"] for r in orch]
    record("vllm_vf_rl_rewards", [round(x, 4) for x in rewards])
    record("vllm_vf_rl_generate_s_median", sorted(r["time/generate_s"] for r in orch)[len(orch) // 2])
    assert all("rollout/episode_errors" not in r for r in orch)
    assert train[0]["train/mismatch_kl"] < 1e-2
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 0.01, rewards


def lora_adapter(model: Path, out: Path, seed: int, r: int = 8) -> None:
    """A random adapter (A and B nonzero) for ``model``, in peft's layout, as the trainer writes it."""
    from asyncrl.config.model import LoRAConfig, ModelConfig
    from asyncrl.models.hf import load_model
    from asyncrl.models.lora import apply_lora

    torch.manual_seed(seed)
    peft_model = apply_lora(
        load_model(ModelConfig(name=str(model)), dtype="bfloat16"), LoRAConfig(enabled=True, r=r)
    )
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.normal_(0, 0.05)
    peft_model.save_pretrained(out)


def test_vllm_loads_lora_adapters_in_place_and_unloads_them(gpu_setup, tmp_path):
    """model.lora on the vLLM backend: an adapter hand-off is served under the base model's own name
    (requests need no change), a second adapter replaces the first in place, full weights drop the adapter
    (the base model's tokens come back token for token), and a broken adapter is a 400 that leaves the server
    serving."""
    model = gpu_setup["sft_model"]
    for seed in (1, 2):
        lora_adapter(model, tmp_path / f"a{seed}", seed)
    lora = ["model.lora.enabled=true", "model.lora.r=8", f"inference.weights_roots=[{tmp_path},{model}]"]
    proc, url = start_vllm(model, tmp_path / "vllm.log", *lora)
    try:
        greedy = partial(greedy_tokens, url, model)
        base = greedy()
        seconds = []
        outs = []
        for v, name in ((1, "a1"), (2, "a2"), (3, "a1")):
            r = httpx.post(
                f"{url}/update_weights", json={"path": str(tmp_path / name), "version": v}, timeout=300
            )
            assert r.status_code == 200, r.text
            seconds.append(r.json()["seconds"])
            outs.append(greedy())
        record("vllm_lora_update_s", seconds)
        assert outs[0] != base and outs[1] != outs[0]
        assert outs[2] == outs[0]  # a1 again, in place: the same tokens as the first time
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text((tmp_path / "a1" / "adapter_config.json").read_text())
        (broken / "adapter_model.safetensors").write_bytes(b"\0" * 64)
        r = httpx.post(f"{url}/update_weights", json={"path": str(broken), "version": 4}, timeout=300)
        record("vllm_lora_broken_status", [r.status_code, r.text[:300]])
        assert 400 <= r.status_code < 500, r.text
        assert greedy() == outs[0]  # still serving a1
        r = httpx.post(f"{url}/update_weights", json={"path": str(model), "version": 5}, timeout=300)
        assert r.status_code == 200, r.text
        assert greedy() == base  # full weights: the adapter is gone
    finally:
        from asyncrl.utils.children import stop

        stop([proc], timeout_s=60)


def test_rl_with_vllm_and_lora_adapters(gpu_setup, tmp_path):
    """RL with model.lora on vLLM, on-policy (async_level 0): every step's policy is an adapter vLLM loaded
    in place, so the trainer/vLLM gap stays at bf16 noise while the policy moves well away from the base
    (kl_ref, measured with a negligible beta); a stale or unloaded adapter would put the gap at kl_ref's
    size."""
    orch, train = rl_with_vllm(
        gpu_setup,
        tmp_path / "rl",
        "max_steps=8",
        "async_level=0",
        "model.lora.enabled=true",
        "trainer.optim.lr=3e-3",
        "trainer.kl.beta=1e-9",
    )
    mismatch = [r["train/mismatch_kl"] for r in train]
    kl_ref = [r["train/kl_ref"] for r in train]
    record("vllm_lora_mismatch_kl_per_step", mismatch)
    record("vllm_lora_kl_ref_per_step", kl_ref)
    record("vllm_lora_update_weights_s", [r["time/update_weights_s"] for r in orch[1:]])
    assert (tmp_path / "rl" / "weights" / "step_8" / "adapter_config.json").is_file()
    assert max(mismatch) < 1e-2, mismatch
    assert kl_ref[-1] > 10 * max(mismatch[1:]), (kl_ref, mismatch)


def test_rl_with_a_vllm_teacher_scores_the_students_tokens(gpu_setup, tmp_path):
    """Online distillation on vLLM: a second vLLM sidecar (the teacher, here the same SFT model as the
    student) answers prompt-logprobs requests for every sampled token. Teacher = student at step 0, so the
    reverse KL is bf16 noise only if the teacher scored exactly the tokens the student sampled (an off-by-one
    would not be), and it grows as the RL-trained student leaves the teacher."""
    orch, train = rl_with_vllm(
        gpu_setup,
        tmp_path / "rl",
        "max_steps=6",
        f"distill.teacher={gpu_setup['sft_model']}",
        "distill.weight=0",  # measured, not trained on: the student moves by its reward only
        "trainer.optim.lr=3e-3",
    )
    kl = [r["train/distill_kl"] for r in train]
    record("vllm_teacher_distill_kl_per_step", kl)
    record("vllm_teacher_mismatch_kl_per_step", [r["train/mismatch_kl"] for r in train])
    assert abs(kl[0]) < 1e-2, kl
    assert (tmp_path / "rl" / "logs" / "teacher.log").exists()
    assert max(kl[1:]) > abs(kl[0]), kl
