"""On the lent GPU: an update the served model cannot take is refused with a 4xx on every transport (files,
NCCL, IPC), and the sidecar goes on serving the old policy bit for bit; a good update after the refusals
still loads. The CPU sidecar's tests of the same cases: tests/unit/test_engine.py and
tests/unit/test_vllm_args.py."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.multiprocessing.reductions import reduce_tensor

from asyncrl.inference.vllm.weights_check import directory_entries
from asyncrl.paths import STABLE
from asyncrl.transport import ipc, nccl
from asyncrl.utils.children import stop
from asyncrl.utils.process import free_port
from gpu.conftest import record, shared_common
from gpu.test_gpu import greedy_tokens, start_vllm
from gpu.test_vllm_inflight_update import perturbed_copy
from helpers.launch import asyncrl

pytestmark = pytest.mark.gpu

LAYER = "model.layers.0.self_attn.q_proj.weight"
# each probe computes its prompt afresh: a prefix-cache hit would run other kernel shapes, and the probes
# compare bits
NO_CACHE = "inference.vllm.enable_prefix_caching=false"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The GPU test model, random-init (what it has learnt does not matter here)."""
    root = tmp_path_factory.mktemp("refusals")
    asyncrl("prepare", *shared_common(root), f"model.name={root / 'model'}", check=True)
    return root / "model"


def probe(url: str, served: Path) -> tuple[list[int], list[float]]:
    """A greedy completion of a fixed prompt: its tokens and their logprobs, unrounded."""
    return greedy_tokens(url, served, "the fixed probe", max_tokens=24, digits=None)


def edited(model: Path, out: Path, edit) -> Path:
    """A copy of ``model`` whose state dict ``edit`` changed in place, unsealed: the checks under test are
    the sidecar's own, not the trainer's seal (which refuses a file altered after it was written)."""
    shutil.copytree(model, out)
    (out / STABLE).unlink(missing_ok=True)
    state = load_file(out / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def damaged_variants(model: Path, root: Path) -> dict[str, Path]:
    """Weights directories the served model must refuse, by what is wrong with them."""
    out = {}
    out["truncated"] = edited(model, root / "truncated", lambda s: None)
    f = out["truncated"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4096])
    out["garbage_header"] = edited(model, root / "garbage", lambda s: None)
    f = out["garbage_header"] / "model.safetensors"
    f.write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00" + b"{not json" + f.read_bytes()[17:])
    out["wrong_shape"] = edited(model, root / "shape", lambda s: s.update({LAYER: torch.zeros(8, 8)}))
    out["unknown_name"] = edited(
        model, root / "unknown", lambda s: s.update({"model.layers.0.extra.weight": s[LAYER].clone()})
    )
    out["missing_name"] = edited(model, root / "missing", lambda s: s.pop(LAYER))
    out["integer_dtype"] = edited(
        model, root / "ints", lambda s: s.update({LAYER: s[LAYER].to(torch.int32)})
    )
    return out


def manifest_cases(model: Path) -> dict[str, list[tuple[str, str, list[int]]]]:
    """A transfer manifest's entries the served model must refuse (the tensors never get sent)."""
    state = load_file(model / "model.safetensors")
    good = [(n, "bfloat16", list(t.shape)) for n, t in state.items()]

    def swap(name, entry):
        return [entry if n == name else (n, d, s) for n, d, s in good]

    return {
        "wrong_shape": swap(LAYER, (LAYER, "bfloat16", [8, 8])),
        "unknown_name": [*good, ("model.layers.0.extra.weight", "bfloat16", [8, 8])],
        "missing_name": [e for e in good if e[0] != LAYER],
        "integer_dtype": swap(LAYER, (LAYER, "int32", list(state[LAYER].shape))),
    }


def refused_and_unchanged(url: str, model: Path, path: Path, version: int, before, case: str) -> None:
    r = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": version}, timeout=300)
    record(
        f"vllm_refused_update_{case}",
        {"status": r.status_code, "reason": r.json()["error"]["message"][:300]},
    )
    assert 400 <= r.status_code < 500, (case, r.status_code, r.text)
    assert probe(url, model) == before, case  # the same tokens, the same logprobs to the last bit
    assert httpx.get(f"{url}/policy").json() == {"version": 0}, case


def test_files_updates_that_do_not_fit_are_refused_and_change_nothing(model, tmp_path):
    proc, url = start_vllm(
        model, tmp_path / "vllm.log", f"inference.weights_roots=[{tmp_path},{model}]", NO_CACHE
    )
    try:
        before = probe(url, model)
        for case, path in damaged_variants(model, tmp_path).items():
            refused_and_unchanged(url, model, path, 1, before, case)
        # OpenAI's shapes on the same server: one model's card, an unknown model, an unknown route
        card = httpx.get(f"{url}/v1/models/{model}")
        assert card.status_code == 200 and card.json()["id"] == str(model), card.text
        answers = {
            path: httpx.get(f"{url}{path}") for path in ("/v1/models/no-such-model", "/v1/no-such-route")
        }
        record("vllm_openai_404s", {path: [r.status_code, r.text[:300]] for path, r in answers.items()})
        for path, r in answers.items():
            assert r.status_code == 404 and r.json().get("error", {}).get("code") == 404, (path, r.text)
        # a good update after all of them still loads, and the old policy comes back bit for bit
        new = perturbed_copy(model, tmp_path / "perturbed", seed=1)
        r = httpx.post(f"{url}/update_weights", json={"path": str(new), "version": 1}, timeout=300)
        assert r.status_code == 200, r.text
        assert probe(url, model) != before
        r = httpx.post(f"{url}/update_weights", json={"path": str(model), "version": 2}, timeout=300)
        assert r.status_code == 200, r.text
        assert probe(url, model) == before
    finally:
        stop([proc], timeout_s=60)


@pytest.mark.parametrize("transport", ["nccl", "ipc"])
def test_transfer_manifests_that_do_not_fit_are_refused_and_change_nothing(model, tmp_path, transport):
    roots = f"inference.weights_roots=[{tmp_path},{model}]"
    extra = [
        f"weights.transport={transport}",
        "strict_async=true",
        "trainer.fabric.accelerator=cuda",
        roots,
        NO_CACHE,
    ]
    proc, url = start_vllm(model, tmp_path / "vllm.log", *extra)
    # a real handle: the refusal comes before it is opened
    buffer = torch.zeros(16, dtype=torch.uint8, device="cuda")
    try:
        before = probe(url, model)
        for case, entries in manifest_cases(model).items():
            path = tmp_path / f"step_{case}"
            if transport == "nccl":
                nccl.write_manifest(path, entries, 1)
            else:
                uuid = str(torch.cuda.get_device_properties(0).uuid)
                handle = ipc.encode_handle(reduce_tensor(buffer)[1])
                ipc.write_manifest(path, entries, [1] * len(entries), 1, uuid, handle)
            refused_and_unchanged(url, model, path, 1, before, f"{transport}_{case}")
    finally:
        stop([proc], timeout_s=60)


# the trainer's end of an NCCL group (rank 0, on the GPU it is given), which dies half-way through its
# broadcast
CUT_SENDER = r"""
import os, sys, torch
from safetensors.torch import load_file
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine
port, weights, keep = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
group = NCCLWeightTransferEngine.trainer_init(
    {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
)
print("JOINED", flush=True)
sys.stdin.readline()
state = load_file(weights)
def items():
    for i, (name, t) in enumerate(state.items()):
        if i == keep:
            os._exit(3)
        yield name, t.to("cuda", torch.bfloat16)
NCCLWeightTransferEngine.trainer_send_weights(items(), {"group": group, "packed": True})
"""


@pytest.mark.two_gpus
def test_a_broadcast_cut_half_way_stops_the_sidecar_with_the_cause(model, tmp_path):
    """The trainer (GPU 1) dies half-way through a broadcast into the sidecar (GPU 0): past the receive
    deadline (the orchestrator's request timeout) the sidecar answers 503 naming the cause, serves nothing
    meanwhile (generation stays paused), and ends, its log saying why at CRITICAL."""
    port, log = free_port(), tmp_path / "vllm.log"
    roots = f"inference.weights_roots=[{tmp_path},{model}]"
    extra = [
        "weights.transport=nccl",
        "strict_async=true",
        "trainer.fabric.accelerator=cuda",
        roots,
        NO_CACHE,
    ]
    proc, url = start_vllm(
        model, log, *extra, "orchestrator.request_timeout_s=20", env={"CUDA_VISIBLE_DEVICES": "0"}
    )
    argv = [sys.executable, "-c", CUT_SENDER, str(port), str(model / "model.safetensors"), "3"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    sender = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        probe(url, model)
        group = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            joined = pool.submit(httpx.post, f"{url}/init_weight_transfer", json=group, timeout=120)
            assert sender.stdout is not None
            # after vLLM's logs
            assert any(line.strip() == "JOINED" for line in iter(sender.stdout.readline, ""))
            assert joined.result().status_code == 200, joined.result().text
            nccl.write_manifest(
                tmp_path / "step_1", [(n, "bfloat16", s) for n, _, s in directory_entries(model)], 1
            )
            body = {"path": str(tmp_path / "step_1"), "version": 1}
            answer = pool.submit(httpx.post, f"{url}/update_weights", json=body, timeout=120)
            time.sleep(2.0)  # the workers are in the receive
            assert sender.stdin is not None
            sender.stdin.write("go\n")
            sender.stdin.flush()
            assert sender.wait(timeout=60) == 3  # gone half-way
            start = time.monotonic()
            paused = pool.submit(httpx.post, f"{url}/v1/completions", timeout=120,
                                 json={"model": str(model), "prompt": "abc", "max_tokens": 4})  # fmt: skip
            r = answer.result()
            waited = time.monotonic() - start
        reason = r.json()["error"]["message"]
        record("cut_broadcast", {"status": r.status_code, "reason": reason, "waited_s": waited})
        assert r.status_code == 503 and "did not finish in 20 s" in reason, r.text
        assert proc.popen.wait(timeout=90) is not None  # the sidecar ended itself
        # a request sent while the receive hung gets nothing from the mixed weights: no answer, or an abort's
        try:
            late = paused.result()
            assert late.status_code != 200 or late.json()["choices"][0]["finish_reason"] == "abort", (
                late.text
            )
        except httpx.HTTPError:
            pass  # the server closed the connection as it ended
        assert "CRITICAL" in log.read_text() and "did not finish in 20 s" in log.read_text()
    finally:
        sender.kill()
        stop([proc], timeout_s=60)
