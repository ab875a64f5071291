"""Rollout throughput through asyncrl against bare vLLM, and the full weight-update latency. One GPU.

Model: the Qwen3-0.6B shape (``--shape 4b``: the 4B one; random init, Qwen3's tokenizer and 151,936-row
vocabulary: run ``python -m asyncrl.models.qwen_tokenizer`` first; on the GPU machine,
``benchmarks/device_env.sh``). Workload: 32 prompts of 64 characters, 8 samples each, 256 new tokens
(``ignore_eos``; ``--prompts``, ``--n``, ``--max-tokens`` change it), temperature 1. Every arm stays up on
the same GPU for the whole run (0.22 of its memory each by default), and the arms are interleaved: each round
measures every arm once, in an order that rotates from round to round, after a warm-up round:
  1. bare vLLM ``LLM.generate`` (one process, kept) on the same prompt token ids: plain, and with the sampled
     token's logprob (``logprobs=0``, ``processed_logprobs`` as our sidecar uses);
  2. the asyncrl path: ``asyncrl serve inference.backend=vllm`` driven by the orchestrator's client (OpenAI
     chat route, token ids + logprobs in the response), one sidecar per ``--defer-logprobs`` value
     (``inference.vllm.defer_logprobs``: logprobs sent once per request; ``--defer-logprobs 0 1`` compares),
     each with the client's compact logprobs (one base64 array a choice; ``asyncrl_defer*``) and with
     OpenAI's object per token (``*_openai``; ``--forms`` picks); ``--logprobs-kernel 0 1``,
     ``--log-stats 0 1``: a sidecar each way (``inference.vllm.logprobs_kernel=false``: arms end ``_vllmlp``;
     ``log_stats=true``: ``_stats``); and the first sidecar through a bare HTTP client, without logprobs
     (``server_plain``: what the server path costs) and with the client's logprob fields
     (``server_logprobs``: the server's part of the logprobs' cost);
  3. then, once: the full weight update through files, trainer to serving: the trainer's export (gather,
     bf16, safetensors, atomic rename) plus the sidecar's ``/update_weights``, to disk and to /dev/shm.
Prints each arm's median and range over the rounds, and each ratio to bare plain vLLM taken within a round;
writes JSON. ``--pyspy $(command -v py-spy)``: then py-spy profiles of the first sidecar's processes and of
the client per arm (``--pyspy-arms``), summarized per process and thread (``pyspy_summary.py``).

    python benchmarks/rollouts.py --defer-logprobs 0 1 --repeats 5 --out $OUT/rollouts.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

SHAPES = {"0.6b": ["model=qwen3_0.6b_shape"], "4b": ["model=qwen3_4b_shape"]}
MODEL = SHAPES["0.6b"]  # --shape picks another
# up to three engines and a trainer share the GPU
VLLM = {"gpu_memory_utilization": 0.22, "max_num_seqs": 512}


def prompts(n: int) -> list[list[dict]]:
    rng = random.Random(0)
    return [
        [{"role": "user", "content": "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(64))}]
        for _ in range(n)
    ]


BARE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, logprobs_mode="processed_logprobs",
          gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_seqs=spec["max_num_seqs"])
tok = llm.get_tokenizer()
ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
       for m in spec["prompts"]]
inputs = [{"prompt_token_ids": x} for x in ids]
print("READY", flush=True)
for line in sys.stdin:  # one measurement per command: {"logprobs": bool, "seed": int}
    cmd = json.loads(line)
    params = SamplingParams(n=spec["n"], temperature=1.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            seed=cmd["seed"], **({"logprobs": 0} if cmd["logprobs"] else {}))
    t = time.perf_counter(); res = llm.generate(inputs, params, use_tqdm=False); dt = time.perf_counter() - t
    print("RESULT " + json.dumps(sum(len(c.token_ids) for o in res for c in o.outputs) / dt), flush=True)
"""


class BareVLLM:
    """Bare vLLM in a process of its own, kept up between measurements (commands on its stdin)."""

    def __init__(self, model: Path, msgs, n: int, max_tokens: int, log: Path):
        spec = {"model": str(model), "prompts": msgs, "n": n, "max_tokens": max_tokens, **VLLM}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", BARE, json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
        )  # fmt: skip
        self._read("READY")

    def _read(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"bare vLLM stopped:\n{self.log.read_text()[-3000:]}")

    def tok_s(self, logprobs: bool, seed: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"logprobs": logprobs, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return float(self._read("RESULT "))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_sidecar(model: Path, log: Path, extra: list[str] | None = None):
    from asyncrl.utils.children import spawn, wait_healthy
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


async def asyncrl_tok_s(pool, msgs, n: int, max_tokens: int, bursts: list[float], seed: int) -> float:
    """One measurement of the asyncrl path: every prompt's group through the orchestrator's client at once.
    Every request of this workload finishes at the same decode step, so the time from the first answer to the
    last (appended to ``bursts``, ms) is what the sidecar and the client spend per answer after the engine is
    done."""
    arrived: list[float] = []

    async def one(i: int, m):
        out = await pool.chat(m, n, 1.0, 1.0, max_tokens, seed=seed * 1000 + i)
        arrived.append(time.perf_counter())
        return out

    t = time.perf_counter()
    outs = await asyncio.gather(*(one(i, m) for i, m in enumerate(msgs)))
    dt = time.perf_counter() - t
    bursts.append(1e3 * (max(arrived) - min(arrived)))
    assert all(len(c.logprobs) == len(c.token_ids) for o in outs for c in o.choices)
    return sum(len(c.token_ids) for o in outs for c in o.choices) / dt


async def server_tok_s(
    client, url: str, model: str, msgs, n: int, max_tokens: int, seed: int, *, logprobs: bool = False
) -> float:
    """The sidecar's chat route through a bare httpx client (no answer parsed but the token count): without
    logprobs (``server_plain``), or with the orchestrator's client's logprob fields (``server_logprobs``: the
    server's cost of logprobs, apart from the client's reading of them)."""
    from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD

    body = {"model": model, "n": n, "temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    if logprobs:
        body |= {
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            LOGPROBS_ENCODING_FIELD: LOGPROBS_ENCODING,
        }

    async def one(i: int, m):
        r = await client.post(f"{url}/v1/chat/completions", json={**body, "messages": m, "seed": seed * 1000 + i})
        r.raise_for_status()
        return sum(len(c["token_ids"]) for c in r.json()["choices"])

    t = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, m) for i, m in enumerate(msgs))))
    return tokens / (time.perf_counter() - t)


async def interleaved(arms: dict, repeats: int) -> dict[str, list[float]]:
    """``repeats`` rounds after a warm-up round, every arm once per round, the order rotating."""
    names, rates = list(arms), {name: [] for name in arms}
    for r in range(repeats + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            rate = await arms[name](r)
            if r:
                rates[name].append(rate)
        if r:
            print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()), flush=True)
    return rates


def weight_update(url: str, model: Path, repeats: int) -> dict:
    """The trainer's real export path (Fabric, FSDP2 on this GPU) then the sidecar's reload."""
    import httpx

    from asyncrl.config.compose import compose_config
    from asyncrl.trainer.state import build_train_state
    from asyncrl.transport.gather import export_model

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


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds (each arm once per round)")
    ap.add_argument(
        "--defer-logprobs",
        type=int,
        nargs="+",
        default=[1],
        help="inference.vllm.defer_logprobs of the sidecar, one sidecar each (0 1: both, side by side)",
    )
    ap.add_argument(
        "--logprobs-kernel",
        type=int,
        nargs="+",
        default=[1],
        help="inference.vllm.logprobs_kernel of the sidecar, one sidecar each (0 1: both; arms of 0 end _vllmlp)",
    )
    ap.add_argument("--log-stats", type=int, nargs="+", default=[0], help="inference.vllm.log_stats (1: _stats)")
    ap.add_argument(
        "--forms",
        nargs="+",
        choices=["compact", "openai"],
        default=["compact", "openai"],
        help="logprob forms asked",
    )
    ap.add_argument("--no-weight-update", action="store_true", help="skip the file weight-update timing")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="the model shape (random init)")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=VLLM["gpu_memory_utilization"],
        help="each engine's share",
    )
    ap.add_argument("--pyspy", help="py-spy's binary: after the rounds, profile the sidecar and the client per arm")
    ap.add_argument("--pyspy-arms", nargs="+", default=["server_plain", "server_logprobs", "asyncrl_defer1"])
    ap.add_argument("--pyspy-seconds", type=int, default=15)
    ap.add_argument("--pyspy-rate", type=int, default=200, help="py-spy's samples a second")
    ap.add_argument("--pyspy-idle", action="store_true", help="py-spy counts the threads' waits too (--idle)")
    ap.add_argument("--out", default="benchmarks/results/rollouts.json")
    args = ap.parse_args()
    MODEL[:] = SHAPES[args.shape]
    VLLM["gpu_memory_utilization"] = args.gpu_memory_utilization
    rates, update, bursts, profiles = run_arms(args)
    import torch

    base = rates["bare_plain"]
    ratios = {k: [a / b for a, b in zip(v, base, strict=True)] for k, v in rates.items() if k != "bare_plain"}
    result = {
        "benchmark": "rollouts",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(),
        "workload": vars(args),
        "tok_s": {k: spread(v) for k, v in rates.items()},
        "tok_s_rounds": rates,
        "ratio_to_bare_plain": {k: spread(v) for k, v in ratios.items()},
        "weight_update_files": update,
        "first_to_last_answer_ms": {k: spread(v[1:]) for k, v in bursts.items() if len(v) > 1},
        "pyspy": profiles,
    }
    print("\n| arm | tok/s median | min | max | / bare plain (median, range) |\n|---|---:|---:|---:|---:|")
    for k, v in result["tok_s"].items():
        r = result["ratio_to_bare_plain"].get(k)
        ratio = f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "1"
        print(f"| {k} | {v['median']:.0f} | {v['min']:.0f} | {v['max']:.0f} | {ratio} |")
    for k, v in result["first_to_last_answer_ms"].items():
        print(f"{k}: first to last answer {v['median']:.0f} ms ({v['min']:.0f}-{v['max']:.0f})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def run_arms(args) -> tuple[dict[str, list[float]], dict, dict[str, list[float]], dict[str, dict]]:
    """Start every arm, measure them interleaved, then time the file weight update against the first
    sidecar."""
    import httpx

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.rollouts.answers import LOGPROBS_ENCODING_FIELD
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.utils.children import stop

    msgs = prompts(args.prompts)
    bursts: dict[str, list[float]] = {}  # the warm-up round's first: dropped
    profiles: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(compose_config(MODEL).model.init, Path(tmp) / "model", seed=0)
        bare = BareVLLM(model, msgs, args.n, args.max_tokens, Path(tmp) / "bare.log")
        sidecars = []
        try:
            for defer, kernel, stats in itertools.product(args.defer_logprobs, args.logprobs_kernel, args.log_stats):
                name = f"defer{defer}" + ("" if kernel else "_vllmlp") + ("_stats" if stats else "")
                keys = {"defer_logprobs": defer, "logprobs_kernel": kernel, "log_stats": stats}
                extra = [f"inference.vllm.{k}={str(bool(x)).lower()}" for k, x in keys.items()]
                sidecars.append((name, *start_sidecar(model, Path(tmp) / f"sidecar_{name}.log", extra)))

            async def measure() -> dict[str, list[float]]:
                # compact (the client's) and per token, as --forms asks
                forms = {"": {}, "_openai": {LOGPROBS_ENCODING_FIELD: None}}
                forms = {k: v for k, v in forms.items() if (k[1:] or "compact") in args.forms}
                pools = {f"asyncrl_{d}{form}": InferencePool([url], str(model), 600, 512,
                                                             extra_body={"ignore_eos": True, **extra})
                         for d, _, url in sidecars for form, extra in forms.items()}  # fmt: skip
                bursts.update({name: [] for name in pools})
                plain = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512))
                arms = {
                    "bare_plain": lambda r: asyncio.to_thread(bare.tok_s, False, r),
                    "bare_logprobs": lambda r: asyncio.to_thread(bare.tok_s, True, r),
                    **{f"server_{k}": partial(server_tok_s, plain, sidecars[0][2], str(model), msgs, args.n,
                                              args.max_tokens, logprobs=k == "logprobs")
                       for k in ("plain", "logprobs")},
                    **{name: partial(asyncrl_tok_s, pool, msgs, args.n, args.max_tokens, bursts[name])
                       for name, pool in pools.items()},
                }  # fmt: skip
                try:
                    rates = await interleaved(arms, args.repeats)
                    if args.pyspy:  # the rounds' figures are kept whatever befalls the profiles
                        try:
                            profiles.update(await profile(args, arms, sidecars[0][1].popen.pid, Path(args.out).parent))
                        except Exception as e:  # noqa: BLE001
                            profiles["error"] = f"{type(e).__name__}: {e}"
                    return rates
                finally:
                    await plain.aclose()
                    for pool in pools.values():
                        await pool.close()

            rates = asyncio.run(measure())
            bare.close()
            update = {} if args.no_weight_update else weight_update(sidecars[0][2], model, 3)
        finally:
            bare.close()
            stop([proc for _, proc, _ in sidecars], timeout_s=60)
    return rates, update, bursts, profiles


async def profile(args, arms: dict, sidecar_pid: int, where: Path) -> dict[str, dict]:
    """``--pyspy``: each of ``--pyspy-arms`` again for ``--pyspy-seconds`` under two py-spy recorders, one on
    the first sidecar's processes (API server, engine core), one on this process (the orchestrator's
    client)."""
    import os

    from pyspy_summary import record

    out, loop = {}, asyncio.get_running_loop()
    for name in args.pyspy_arms:
        spy = partial(record, args.pyspy, seconds=args.pyspy_seconds, rate=args.pyspy_rate, idle=args.pyspy_idle)
        work = partial(lambda arm: asyncio.run_coroutine_threadsafe(arm(900), loop).result(), arms[name])
        # the client's recorder only records, the sidecar's runs the arm
        server, client = await asyncio.gather(
            asyncio.to_thread(spy, pid=sidecar_pid, path=where / f"pyspy_rollouts_{name}_sidecar.txt", work=work),
            asyncio.to_thread(
                spy,
                pid=os.getpid(),
                path=where / f"pyspy_rollouts_{name}_client.txt",
                work=None,
                children=False,
            ),
        )
        out[name] = {"sidecar": server, "client": client}
        print(f"== py-spy {name} (tok/s {[round(x) for x in server['results']]})", flush=True)
        print(f"-- sidecar\n{server['summary']}\n-- client\n{client['summary']}", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
