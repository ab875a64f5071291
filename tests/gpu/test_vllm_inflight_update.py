"""On the lent GPU: a weight update lands on the vLLM sidecar while requests are in flight, and they are
kept.

``/update_weights`` on the vLLM backend pauses generation with ``mode="keep"`` (running requests stay
scheduled), loads the new weights, resets the running requests' caches
(``reset_prefix_cache( reset_running_requests=True)``: their KV is computed again, under the new weights) and
resumes. So every request in flight finishes with all its tokens; each token sampled before the update has
the old policy's logprob, each one after it the new policy's on a fresh scoring of the whole sequence so far.

vLLM's answers carry no policy version per token (the CPU sidecar returns ``policy_versions``; the
orchestrator counts a vLLM token as the version the server held when its request was sent), so each token's
version is read off its logprob, against both policies' scoring of the sequence in float32: the versions must
switch exactly once, inside the sequence, and not before the tokens that had already arrived when the update
was sent. The CPU engine's test of the same contract:
tests/unit/test_engine.py::test_a_weight_update_in_the_middle_of_a_completion.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.paths import STABLE
from asyncrl.utils.atomic import atomic_dir
from asyncrl.utils.children import stop
from gpu.conftest import record
from gpu.test_gpu import start_vllm

pytestmark = pytest.mark.gpu

STREAMS = 3  # requests in flight together, each sampled with its own seed
MAX_TOKENS = 1024  # ~5 s of decoding for the small model: the update (~0.4 s) lands well inside it
UPDATE_AFTER = 16  # tokens every stream has received when the update is sent
ATOL = 0.1  # vLLM's bf16 forward against a float32 scoring of the same weights
# the widest span of switch points that may explain a stream (tokens around the switch that score alike)
PINNED = 8


def perturbed_copy(model: Path, out: Path, seed: int) -> Path:
    """``model`` with Gaussian noise of each matrix's own spread added, saved beside its tokenizer: a policy
    whose logprobs differ far beyond ``ATOL`` from the old one's and still depend on the context (a
    random-init model samples near-uniformly whatever the cache holds, so a stale cache would score as a
    fresh one)."""
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * p.std())
    with atomic_dir(out) as tmp:  # sealed as the trainer's exports are: the sidecar checks the manifest
        m.save_pretrained(tmp)
        for f in model.iterdir():  # the tokenizer and the generation config, not the old weights' marker
            if f.is_file() and f.name != STABLE and not (tmp / f.name).exists():
                shutil.copy(f, tmp / f.name)
    return out


def stream(url: str, model: str, prompt: list[int], seed: int, arrived: threading.Event) -> dict:
    """One streamed completion of ``MAX_TOKENS`` tokens; ``arrived`` is set once ``UPDATE_AFTER`` have
    come."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,  # every stream runs its full length, across the update
        "temperature": 1.0,  # processed logprobs are then the plain log-softmax the reference computes
        "seed": seed,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "stream": True,
    }
    ids: list[int] = []
    logprobs: list[float] = []
    finish = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                lp = choice.get("logprobs") or {}
                ids += [int(t.removeprefix("token_id:")) for t in lp.get("tokens", [])]
                logprobs += lp.get("token_logprobs", [])
                finish = choice.get("finish_reason") or finish
            if len(ids) >= UPDATE_AFTER:
                arrived.set()
    return {"token_ids": ids, "logprobs": logprobs, "finish_reason": finish}


@torch.no_grad()
def fresh_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Each token's logprob under ``model`` given the prompt and the tokens before it, computed from
    scratch."""
    ids = torch.tensor([prompt + tokens], device="cuda")
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).cpu()


def switch_points(got: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> list[int]:
    """Every ``s`` in 1..n-1 such that tokens ``[0, s)`` score as the old policy does and ``[s, n)`` as the
    new one: the versions ``[0] * s + [1] * (n - s)`` explain every logprob (more than one ``s`` where tokens
    around the switch score alike under both)."""
    old_ok, new_ok = (got - old).abs() <= ATOL, (got - new).abs() <= ATOL
    return [s for s in range(1, len(got)) if old_ok[:s].all() and new_ok[s:].all()]


def test_vllm_weight_update_keeps_requests_in_flight_and_switches_versions_once(gpu_setup, tmp_path):
    old_dir = gpu_setup["sft_model"]
    new_dir = perturbed_copy(old_dir, tmp_path / "new", seed=0)
    proc, url = start_vllm(old_dir, tmp_path / "vllm.log", f"inference.weights_roots=[{tmp_path}]")
    prompt = AutoTokenizer.from_pretrained(old_dir).encode("reverse: abcdef", add_special_tokens=False)
    arrived = [threading.Event() for _ in range(STREAMS)]
    try:
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(stream, url, str(old_dir), prompt, i, arrived[i]) for i in range(STREAMS)]
            for event in arrived:
                event.wait(120)
            ended = [i for i, f in enumerate(futures) if f.done()]
            for i in ended:
                futures[i].result()  # a stream that failed raises here
            assert not ended and all(e.is_set() for e in arrived), (
                f"streams ended or stalled before the update: {ended}"
            )
            r = httpx.post(f"{url}/update_weights", json={"path": str(new_dir), "version": 1}, timeout=300)
            assert r.status_code == 200, r.text
            record("vllm_inflight_update_s", r.json()["seconds"])
            results = [f.result() for f in futures]
        assert httpx.get(f"{url}/policy").json() == {"version": 1}
    finally:
        stop([proc], timeout_s=60)
    old_model, new_model = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
        .cuda()
        .eval()
        for d in (old_dir, new_dir)
    )
    switches, told_apart = [], []
    for i, out in enumerate(results):
        # kept: neither aborted nor cut short by the pause
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == MAX_TOKENS, (
            i,
            out["finish_reason"],
        )
        got = torch.tensor(out["logprobs"], dtype=torch.float64)
        old = fresh_logprobs(old_model, prompt, out["token_ids"])
        new = fresh_logprobs(new_model, prompt, out["token_ids"])
        points = switch_points(got, old, new)
        off_old, off_new = (got - old).abs() > ATOL, (got - new).abs() > ATOL
        assert points, (
            f"stream {i}: no single switch from the old policy to the new explains the logprobs; tokens off "
            f"the old policy: {off_old.nonzero().flatten()[:10].tolist()}, off both: "
            f"{(off_old & off_new).nonzero().flatten()[:10].tolist()}"
        )
        # the switch is pinned to a few tokens: tokens just before it score as the old policy only and tokens
        # just after it as the new one only, so the versions read off are meaningful (policies that scored
        # alike would let every s explain the logprobs). A mean gap over the whole sequence would not show
        # it: the new policy's own samples grow confident under both policies, and its tail dilutes any mean.
        assert max(points) - min(points) <= PINNED, (i, min(points), max(points))
        # the tokens that had arrived before the update was sent are the old policy's
        assert max(points) >= UPDATE_AFTER, (i, points)
        # and the update lands while the stream decodes (it takes ~0.3 s of ~5 s), not as the request ends: a
        # sidecar that swapped weights only between requests would switch at the last token
        assert max(points) < MAX_TOKENS // 2, (i, points)
        switches.append(points)
        told_apart.append(((old - new).abs() > 2 * ATOL).double().mean().item())
    record("vllm_inflight_update_switch_points", [[min(p), max(p)] for p in switches])
    record("vllm_inflight_update_tokens_told_apart", told_apart)
