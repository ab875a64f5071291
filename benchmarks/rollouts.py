"""Rollout throughput through asyncrl against bare vLLM, and the full weight-update latency. One GPU.

Model: the Qwen3-0.6B shape (random init, char tokenizer). Workload: 32 prompts of 64 characters, 8 samples
each, 256 new tokens (``ignore_eos``), temperature 1. Side by side, in one run, each repeated:
  1. bare vLLM ``LLM.generate`` (a fresh process) on the same prompt token ids: plain, and with the
     sampled token's logprob (``logprobs=0``, ``processed_logprobs`` as our sidecar uses);
  2. the asyncrl path: ``asyncrl serve inference.backend=vllm`` driven by the orchestrator's client
     (OpenAI chat route, token ids + logprobs in the response), once per ``--defer-logprobs`` value
     (``inference.vllm.defer_logprobs``: logprobs sent once per request; ``--defer-logprobs 0 1`` compares);
  3. full weight update, trainer to serving: the trainer's export (gather, bf16, safetensors, atomic
     rename) plus the sidecar's ``/update_weights``, to disk and to /dev/shm.
Prints a table and writes JSON.

    python benchmarks/rollouts.py --out $OUT/rollouts.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = ["model=qwen3_0.6b_shape"]
VLLM = {"gpu_memory_utilization": 0.5, "max_num_seqs": 512}


def prompts(n: int) -> list[list[dict]]:
    rng = random.Random(0)
    return [
        [{"role": "user", "content": "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(64))}]
        for _ in range(n)
    ]


BARE = r"""
import json, statistics, sys, time
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, logprobs_mode="processed_logprobs",
          gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_seqs=spec["max_num_seqs"])
tok = llm.get_tokenizer()
ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
       for m in spec["prompts"]]
inputs = [{"prompt_token_ids": x} for x in ids]
out = {}
for mode, extra in (("plain", {}), ("logprobs", {"logprobs": 0})):
    rates = []
    for r in range(spec["repeats"] + 1):
        params = SamplingParams(
            n=spec["n"], temperature=1.0, max_tokens=spec["max_tokens"], ignore_eos=True, seed=r, **extra
        )
        t = time.perf_counter(); res = llm.generate(inputs, params, use_tqdm=False); dt = time.perf_counter() - t
        if r: rates.append(sum(len(c.token_ids) for o in res for c in o.outputs) / dt)  # first run warms up
    out[mode] = statistics.median(rates)
print("RESULT " + json.dumps(out), flush=True)
"""


def bare_vllm(model: Path, msgs, n: int, max_tokens: int, repeats: int) -> dict:
    spec = {"model": str(model), "prompts": msgs, "n": n, "max_tokens": max_tokens, "repeats": repeats, **VLLM}
    proc = subprocess.run([sys.executable, "-c", BARE, json.dumps(spec)], capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"bare vLLM failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][7:])


def start_sidecar(model: Path, log: Path, extra: list[str] | None = None):
    from asyncrl.launcher.process import spawn, wait_healthy
    from asyncrl.utils.process import free_port

    port = free_port()
    args = [
        sys.executable,
        "-m",
        "asyncrl",
        "serve",
        *MODEL,
        f"model.name={model}",
        "inference.backend=vllm",
        f"inference.port={port}",
        f"inference.vllm.gpu_memory_utilization={VLLM['gpu_memory_utilization']}",
        f"inference.vllm.max_num_seqs={VLLM['max_num_seqs']}",
        # the weight-update timing hands the sidecar directories made by tempfile (on disk and in /dev/shm)
        f"inference.weights_roots=[{tempfile.gettempdir()},/dev/shm]",
        *(extra or []),
    ]
    proc = spawn("sidecar", args, log)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, timeout_s=600)
    return proc, url


async def asyncrl_path(url: str, model: Path, msgs, n: int, max_tokens: int, repeats: int) -> float:
    from asyncrl.rollouts.client import InferencePool

    pool = InferencePool([url], str(model), 600, 512, extra_body={"ignore_eos": True})
    rates = []
    try:
        for r in range(repeats + 1):
            t = time.perf_counter()
            outs = await asyncio.gather(
                *(pool.chat(m, n, 1.0, 1.0, max_tokens, seed=r * 1000 + i) for i, m in enumerate(msgs))
            )
            dt = time.perf_counter() - t
            assert all(len(c.logprobs) == len(c.token_ids) for o in outs for c in o.choices)
            if r:
                rates.append(sum(len(c.token_ids) for o in outs for c in o.choices) / dt)
    finally:
        await pool.close()
    return statistics.median(rates)


def weight_update(url: str, model: Path, repeats: int) -> dict:
    """The trainer's real export path (Fabric, FSDP2 on this GPU) then the sidecar's reload."""
    import httpx

    from asyncrl.config.compose import compose_config
    from asyncrl.trainer.state import build_train_state
    from asyncrl.transport.files import export_model

    cfg = compose_config(
        [
            *MODEL,
            f"model.name={model}",
            "trainer.fabric.accelerator=cuda",
            "trainer.fabric.strategy=fsdp2",
            "trainer.fabric.precision=bf16-mixed",
            "trainer.fabric.num_threads=0",
        ]
    )
    fabric, raw, tokenizer, _ = build_train_state(cfg, cfg.trainer.optim, cfg.trainer.scheduler, 10)
    import shutil

    out = {}
    version = 0  # the sidecar takes only versions that go forward, across both places
    places = ["disk"] + (
        ["shm"] if Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 4 * 2**30 else []
    )
    for where in places:
        root = Path(tempfile.mkdtemp(dir="/dev/shm" if where == "shm" else None))
        export_s, reload_s, total_s = [], [], []
        for r in range(repeats + 1):
            path = root / f"step_{r}"
            t = time.perf_counter()
            export_model(fabric, raw, tokenizer, path, "bfloat16")
            t1 = time.perf_counter()
            version += 1
            resp = httpx.post(f"{url}/update_weights", json={"path": str(path), "version": version}, timeout=600)
            t2 = time.perf_counter()
            assert resp.status_code == 200, resp.text
            shutil.rmtree(path)
            if r:
                export_s.append(t1 - t)
                reload_s.append(t2 - t1)
                total_s.append(t2 - t)
        out[where] = {
            "export_s": statistics.median(export_s),
            "reload_s": statistics.median(reload_s),
            "total_s": statistics.median(total_s),
        }
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--defer-logprobs",
        type=int,
        nargs="+",
        default=[0],
        help="inference.vllm.defer_logprobs of the sidecar, one sidecar each (0 1: both, side by side)",
    )
    ap.add_argument("--out", default="benchmarks/results/rollouts.json")
    args = ap.parse_args()
    msgs = prompts(args.prompts)
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(compose_config(MODEL).model.init, Path(tmp) / "model", seed=0)
        bare = bare_vllm(model, msgs, args.n, args.max_tokens, args.repeats)
        print(
            f"bare vLLM generate: {bare['plain']:.0f} tok/s plain, {bare['logprobs']:.0f} tok/s with logprobs",
            flush=True,
        )
        by_defer: dict[str, float] = {}
        update: dict = {}
        for defer in args.defer_logprobs:
            extra = [f"inference.vllm.defer_logprobs={str(bool(defer)).lower()}"]
            proc, url = start_sidecar(model, Path(tmp) / f"sidecar_defer{defer}.log", extra)
            try:
                ours = asyncio.run(asyncrl_path(url, model, msgs, args.n, args.max_tokens, args.repeats))
                by_defer[str(defer)] = ours
                print(
                    f"asyncrl (sidecar + orchestrator client, with logprobs, defer_logprobs={defer}): {ours:.0f} tok/s",
                    flush=True,
                )
                if not update:  # the weight hand-off does not depend on how logprobs travel: once
                    update = weight_update(url, model, args.repeats)
                    for where, u in update.items():
                        print(
                            f"weight update ({where}): export {u['export_s']:.3f}s + reload {u['reload_s']:.3f}s = "
                            f"{u['total_s']:.3f}s",
                            flush=True,
                        )
            finally:
                from asyncrl.launcher.process import stop

                stop([proc], timeout_s=60)
        ours = by_defer[str(args.defer_logprobs[0])]
    import torch

    result = {
        "benchmark": "rollouts",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "workload": vars(args),
        "bare_vllm_tok_s": bare,
        "asyncrl_tok_s_with_logprobs": ours,
        "ratio_to_bare_plain": ours / bare["plain"],
        "ratio_to_bare_logprobs": ours / bare["logprobs"],
        "asyncrl_tok_s_by_defer_logprobs": by_defer,
        "ratio_to_bare_plain_by_defer_logprobs": {k: v / bare["plain"] for k, v in by_defer.items()},
        "weight_update": update,
    }
    print(
        f"asyncrl / bare plain = {result['ratio_to_bare_plain']:.2f}, asyncrl / bare with logprobs = "
        f"{result['ratio_to_bare_logprobs']:.2f}"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
