"""Where bare vLLM loses throughput when asked for logprobs. One GPU, one process per engine.

The workload of ``rollouts.py`` (Qwen3-0.6B shape, random init, char tokenizer; 32 prompts x 8 samples, 256
new tokens, ``ignore_eos``, temperature 1), through ``LLM.generate`` in these variants, each timed after a
warm-up:
  plain                    no logprobs logprobs                 ``logprobs=0`` (the sampled token's logprob),
  ``processed_logprobs`` (what we use) logprobs_raw             the same with ``logprobs_mode=raw_logprobs``
  (no temperature/top-p processing) plain_nodetok            ``detokenize=False`` logprobs_nodetok
  ``logprobs=0`` and ``detokenize=False`` (no text for the logprob tokens either) logprobs_flat
  ``logprobs=0`` and ``flat_logprobs=True`` (FlatLogprobs: a few flat lists per request
                           instead of a dict and a Logprob object per token; engine-level only, not in the
                           OpenAI server)
  logprobs_flat_nodetok    both
  plain_then_score         generate without logprobs, then one prefill of prompt + completion asking for
                           ``prompt_logprobs=0`` (flat, no detokenize): logprobs from a scoring pass, not
                           decode
Then one more engine with asyncrl's deferred logprobs (``ASYNCRL_DEFER_LOGPROBS=1``, the vLLM plugin must be
installed: ``inference.vllm.defer_logprobs``, src/asyncrl/inference/vllm/logprobs.py) runs ``plain``,
``logprobs`` and ``logprobs_flat_nodetok`` interleaved: the ``deferred_*`` rows, against that engine's own
plain. The variants run interleaved (round-robin over the repeats), so a drift of the machine hits them
alike. Each timed round is also split where the frontend receives the engine core's outputs: the median time
between two output batches (a decode step, the engine's pace), the rate up to the batch that finishes the
last request (``engine tok/s``) and the time the frontend takes after it (``tail ms``: the finishing
requests' logprobs, which a deferred engine sends all at once here, since every request of this workload ends
at the same step). With ``--pyspy PY_SPY``, each engine then runs a few more rounds of some variants
(``plain`` and ``logprobs``; the deferred engine ``logprobs``) under
``py-spy record --subprocesses --threads`` (sampling, not pausing, the frontend and the engine core as they
run, multiprocess as served): the raw profiles are saved beside ``--out`` and summarised per process and
thread (``pyspy_summary.py``) into the JSON. ``--pyspy-idle`` counts the samples of waiting threads too
(py-spy's ``--idle``), so a thread that blocks (on the GPU, a copy, a lock) shows where. With ``--profile``,
one more engine in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) runs ``logprobs`` under cProfile and the
top functions by own time are printed and saved: where the frontend and the engine core spend the difference.
Prints a table and writes JSON.

With ``--kernels``, only one engine runs, with deferred logprobs (as asyncrl's sidecar does) and vLLM's torch
profiler in its worker (``profiler_config``): one round of ``plain`` and one of ``logprobs`` each between
``start_profile`` and ``stop_profile``. For each, the rate under the profiler, the worker's total self CUDA
and CPU time (the footer of the table vLLM writes on stop, ``profiler_out_0.txt``, kept beside ``--out`` as
``kernels_<variant>.txt``): whether the logprobs' remaining cost is GPU work (more kernel time a step) or
time the GPU waits on the host (wall time grown more than kernel time), and which kernels.

With ``--logprobs-kernel-ab 0 1``, only the deferred engine runs, once without and once with asyncrl's
logprobs kernel (``inference.vllm.logprobs_kernel``), ``plain`` and ``logprobs`` interleaved in each: each
engine's ratio.

    python benchmarks/logprobs_cost.py --out $OUT/logprobs_cost.json [--pyspy $(command -v py-spy)]
    [--profile] python benchmarks/logprobs_cost.py --kernels --out $OUT/logprobs_kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollouts import MODEL, VLLM, prompts  # noqa: E402  (the same workload as the rollout benchmark)

ENGINE = r"""
import cProfile, io, json, os, pstats, statistics, sys, time
spec = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=spec["model"], dtype="bfloat16", seed=0, logprobs_mode=spec["mode"],
          gpu_memory_utilization=spec["gpu_memory_utilization"], max_num_seqs=spec["max_num_seqs"],
          **({"profiler_config": spec["profiler_config"]} if spec.get("profiler_config") else {}))
tok = llm.get_tokenizer()
ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids
       for m in spec["prompts"]]
inputs = [{"prompt_token_ids": x} for x in ids]
VARIANTS = {"plain": {}, "logprobs": {"logprobs": 0}, "plain_nodetok": {"detokenize": False},
            "logprobs_nodetok": {"logprobs": 0, "detokenize": False},
            "logprobs_flat": {"logprobs": 0, "flat_logprobs": True},
            "logprobs_flat_nodetok": {"logprobs": 0, "flat_logprobs": True, "detokenize": False}}
# when each batch of the engine core's outputs reaches the frontend, and how many requests it finishes: a round's
# decode steps (the engine's pace) apart from what the frontend does after the last one (the finishing burst)
core, arrivals, split = llm.llm_engine.engine_core, [], {}
_get_output = core.get_output
def get_output(*a, **k):
    out = _get_output(*a, **k)
    arrivals.append((time.perf_counter(), sum(o.finish_reason is not None for o in out.outputs)))
    return out
core.get_output = get_output
def note_split(name, t0, t1, tokens):
    steps = [t for t, _ in arrivals if t > t0]
    last = max((t for t, done in arrivals if done), default=t1)
    gaps = sorted(b - a for a, b in zip(steps, steps[1:]))
    split.setdefault(name, []).append({"step_ms": 1e3 * gaps[len(gaps) // 2] if gaps else None,
                                       "engine_tok_s": tokens / (last - t0), "tail_ms": 1e3 * (t1 - last)})
def run(extra, seed, name=None):
    params = SamplingParams(n=spec["n"], temperature=1.0, max_tokens=spec["max_tokens"], ignore_eos=True, seed=seed,
                            **extra)
    arrivals.clear()
    t = time.perf_counter(); res = llm.generate(inputs, params, use_tqdm=False); t1 = time.perf_counter()
    tokens = sum(len(c.token_ids) for o in res for c in o.outputs)
    if name:
        note_split(name, t, t1, tokens)
    return tokens / (t1 - t)
def run_then_score(seed):
    # generate without logprobs, then one prefill over prompt + completion for their logprobs (prompt_logprobs)
    params = SamplingParams(n=spec["n"], temperature=1.0, max_tokens=spec["max_tokens"], ignore_eos=True, seed=seed,
                            detokenize=False)
    t = time.perf_counter(); res = llm.generate(inputs, params, use_tqdm=False)
    full = [{"prompt_token_ids": list(o.prompt_token_ids) + list(c.token_ids)} for o in res for c in o.outputs]
    score = SamplingParams(max_tokens=1, prompt_logprobs=0, flat_logprobs=True, detokenize=False)
    llm.generate(full, score, use_tqdm=False); dt = time.perf_counter() - t
    return sum(len(c.token_ids) for o in res for c in o.outputs) / dt
def measure(name, seed):
    return run_then_score(seed) if name == "plain_then_score" else run(VARIANTS[name], seed)
rates = {name: [] for name in spec["variants"]}
for name in spec["variants"]:
    measure(name, 0)  # warm-up
for r in range(spec["repeats"]):
    for name in spec["variants"]:
        rates[name].append(run(VARIANTS[name], r + 1, name) if name in VARIANTS else measure(name, r + 1))
out = {name: statistics.median(v) for name, v in rates.items()}
out["all_tok_s"] = rates
out["split"] = {name: {k: statistics.median(x[k] for x in v if x[k] is not None) for k in v[0]}
                for name, v in split.items()}
from vllm.v1.core.sched import scheduler as _sched
out["defer_installed"] = bool(getattr(_sched.Scheduler, "_asyncrl_defer_logprobs", False))
if spec.get("pyspy"):
    import subprocess
    out["pyspy"] = {}
    for name in spec["pyspy_variants"]:
        path = os.path.join(spec["pyspy_dir"], f"pyspy_{spec['tag']}_{name}.txt")
        cmd = [spec["pyspy"], "record", "--pid", str(os.getpid()), "--subprocesses", "--threads", "--nonblocking",
               "--format", "raw", "--rate", str(spec.get("pyspy_rate", 200)), "--duration", str(spec["pyspy_s"]),
               "--output", path,
               *(["--idle"] if spec.get("pyspy_idle") else [])]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        time.sleep(2)  # attached to every process
        t0, rs = time.time(), []
        while time.time() - t0 < spec["pyspy_s"] - 5:
            rs.append(measure(name, 500 + len(rs)))
        log = p.communicate(timeout=spec["pyspy_s"] + 120)[0]
        out["pyspy"][name] = {"path": path, "tok_s": rs, "returncode": p.returncode, "log": log[-1500:]}
if spec.get("profile"):
    prof = cProfile.Profile(); prof.enable(); rate = run(VARIANTS["logprobs"], 99); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    out["profile_logprobs_tok_s"] = rate; out["profile"] = s.getvalue()
    prof = cProfile.Profile(); prof.enable(); rate = run(VARIANTS["plain"], 98); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
    out["profile_plain_tok_s"] = rate; out["profile_plain"] = s.getvalue()
if spec.get("profiler_config"):
    import shutil
    os.makedirs(spec["profiler_config"]["torch_profiler_dir"], exist_ok=True)
    table = os.path.join(spec["profiler_config"]["torch_profiler_dir"], "profiler_out_0.txt")
    out["kernels"] = {}
    for name in spec["kernel_variants"]:
        if os.path.exists(table):
            os.remove(table)
        llm.start_profile(); rate = run(VARIANTS[name], 700); llm.stop_profile()
        t0 = time.time()
        while not os.path.exists(table) and time.time() - t0 < 120:  # the worker writes it as it stops
            time.sleep(0.5)
        time.sleep(1)
        kept = os.path.join(spec["kernels_dir"], f"kernels_{name}.txt")
        shutil.copyfile(table, kept)
        out["kernels"][name] = {"tok_s": rate, "table": kept}
print("RESULT " + json.dumps(out))
"""


ORDER = [
    "plain",
    "logprobs",
    "plain_nodetok",
    "logprobs_nodetok",
    "logprobs_flat",
    "logprobs_flat_nodetok",
    "plain_then_score",
]

DEFERRED = ["plain", "logprobs", "logprobs_flat_nodetok"]


def engine(spec: dict, env_extra: dict[str, str] | None = None) -> dict:
    """One fresh engine process (vLLM keeps GPU memory until its process exits)."""
    import os

    env = {**os.environ, **(env_extra or {})}
    p = subprocess.run(
        [sys.executable, "-c", ENGINE, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            # into this process's output too: what an engine measured survives a failure further on
            measured = {k: v for k, v in result.items() if k != "pyspy"}
            print(f"engine {spec.get('tag', spec['mode'])}: {json.dumps(measured)}")
            return result
    raise RuntimeError(f"engine failed ({p.returncode}):\n{p.stderr[-4000:]}")


def profile_totals(table: str) -> dict[str, float]:
    """``{"self_cpu_ms", "self_cuda_ms"}`` from the footer of a torch profiler table
    (``key_averages().table()``: ``Self CPU time total: 1.234s``; units s, ms or us)."""
    scale = {"s": 1e3, "ms": 1.0, "us": 1e-3}
    found = re.findall(r"Self (CPU|CUDA) time total: ([0-9.]+)(ms|us|s)\b", table)
    return {f"self_{kind.lower()}_ms": float(value) * scale[unit] for kind, value, unit in found}


@contextlib.contextmanager
def tiny_model():
    """The benchmark's model (rollouts.py's shape, random init) in a temporary directory:
    ``(model dir, that dir)``."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        yield build_tiny_model(compose_config(MODEL).model.init, Path(tmp) / "model", seed=0), Path(tmp)


def base_spec(model: Path, repeats: int) -> dict:
    """The workload every engine of this benchmark runs (rollouts.py's)."""
    return {
        "model": str(model),
        "prompts": prompts(32),
        "n": 8,
        "max_tokens": 256,
        "repeats": repeats,
        **VLLM,
    }


def kernels(args) -> int:
    """``--kernels``: plain against logprobs, deferred, under vLLM's torch profiler in one engine."""
    out_dir = args.out.resolve().parent
    out_dir.mkdir(parents=True, exist_ok=True)
    with tiny_model() as (model, tmp):
        profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp / "traces"),
                    "torch_profiler_with_stack": False, "ignore_frontend": True}  # fmt: skip
        variants = ["plain", "logprobs"]
        result = engine(
            {**base_spec(model, args.repeats), "mode": "processed_logprobs", "variants": variants,
             "profiler_config": profiler, "kernel_variants": variants, "kernels_dir": str(out_dir)},
            {"ASYNCRL_DEFER_LOGPROBS": "1"},
        )  # fmt: skip
    if not result.pop("defer_installed"):
        raise RuntimeError("ASYNCRL_DEFER_LOGPROBS=1 had no effect: asyncrl's vLLM plugin is not installed")
    k = result["kernels"]
    for r in k.values():
        r.update({"self_cpu_ms": None, "self_cuda_ms": None, **profile_totals(Path(r["table"]).read_text())})
    print(f"{'variant':<12}{'tok/s':>10}{'tok/s profiled':>16}{'self CUDA ms':>14}{'self CPU ms':>13}")
    for name in variants:
        r = k[name]
        print(f"{name:<12}{result[name]:>10,.0f}{r['tok_s']:>16,.0f}{r['self_cuda_ms'] or 0:>14,.1f}"
              f"{r['self_cpu_ms'] or 0:>13,.1f}")  # fmt: skip
    p, lp = k["plain"], k["logprobs"]
    ratios = {
        "tok_s_logprobs_vs_plain": result["logprobs"] / result["plain"],
        "profiled_wall_logprobs_vs_plain": p["tok_s"] / lp["tok_s"],
        "cuda_time_logprobs_vs_plain": (lp["self_cuda_ms"] / p["self_cuda_ms"]) if p["self_cuda_ms"] else None,
    }
    print(json.dumps(ratios))
    args.out.write_text(
        json.dumps(
            {
                "rates_tok_s": {v: result[v] for v in variants},
                "all_tok_s": result["all_tok_s"],
                "kernels": k,
                **ratios,
                "repeats": args.repeats,
            },
            indent=1,
        )
    )
    return 0


def kernel_ab(args) -> int:
    """``--logprobs-kernel-ab``: the deferred engine without and with asyncrl's logprobs kernel
    (``inference.vllm.logprobs_kernel``), one engine each, one after the other; each engine's logprobs
    against its own plain, so a drift between the two engines' starts cancels."""
    out: dict = {"repeats": args.repeats, "engines": {}}
    with tiny_model() as (model, _):
        for kernel in args.logprobs_kernel_ab:
            result = engine(
                {
                    **base_spec(model, args.repeats),
                    "mode": "processed_logprobs",
                    "variants": ["plain", "logprobs"],
                    "tag": f"kernel{kernel}",
                },
                {"ASYNCRL_DEFER_LOGPROBS": "1", "ASYNCRL_LOGPROBS_KERNEL": str(kernel)},
            )
            if not result.pop("defer_installed"):
                raise RuntimeError("ASYNCRL_DEFER_LOGPROBS=1 had no effect: asyncrl's vLLM plugin is not installed")
            out["engines"][f"kernel{kernel}"] = result
    print(f"{'engine':<10}{'plain tok/s':>13}{'logprobs tok/s':>16}{'ratio':>7}{'step ms plain/logprobs':>24}")
    for name, r in out["engines"].items():
        r["ratio"] = r["logprobs"] / r["plain"]
        steps = "/".join(f"{r['split'][v]['step_ms']:.2f}" for v in ("plain", "logprobs"))
        print(f"{name:<10}{r['plain']:>13,.0f}{r['logprobs']:>16,.0f}{r['ratio']:>7.3f}{steps:>24}")
    args.out.write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--skip-raw", action="store_true", help="leave out the raw_logprobs engine (one engine start less)")
    ap.add_argument("--pyspy", help="py-spy's binary: profile the engines' processes (see the docstring)")
    ap.add_argument("--pyspy-seconds", type=int, default=14)
    ap.add_argument("--pyspy-idle", action="store_true", help="py-spy counts the threads' waits too (--idle)")
    ap.add_argument("--pyspy-rate", type=int, default=200, help="py-spy's samples a second")
    ap.add_argument("--only-deferred", action="store_true", help="only the deferred engine (its plain and logprobs)")
    ap.add_argument("--variants", nargs="+", choices=ORDER, default=ORDER, help="the first engine's variants")
    ap.add_argument("--kernels", action="store_true", help="only the kernel-level profile (see the docstring)")
    ap.add_argument(
        "--logprobs-kernel-ab",
        type=int,
        nargs="+",
        help="only deferred engines with these ASYNCRL_LOGPROBS_KERNEL",
    )
    args = ap.parse_args()
    if args.kernels:
        return kernels(args)
    if args.logprobs_kernel_ab:
        return kernel_ab(args)
    spy = (
        {
            "pyspy": args.pyspy,
            "pyspy_dir": str(args.out.resolve().parent),
            "pyspy_s": args.pyspy_seconds,
            "pyspy_idle": args.pyspy_idle,
            "pyspy_rate": args.pyspy_rate,
        }
        if args.pyspy
        else {}
    )
    with tiny_model() as (model, _):
        base = base_spec(model, args.repeats)
        processed = (
            {"plain": None, "all_tok_s": {}, "split": {}, "defer_installed": False}
            if args.only_deferred
            else engine(
                {
                    **base,
                    "mode": "processed_logprobs",
                    "variants": args.variants,
                    **spy,
                    "tag": "processed",
                    "pyspy_variants": ["plain", "logprobs"],
                }
            )
        )
        raw = (
            None
            if args.skip_raw or args.only_deferred
            else engine({**base, "mode": "raw_logprobs", "variants": ["logprobs"]})
        )
        deferred = engine(
            {
                **base,
                "mode": "processed_logprobs",
                "variants": DEFERRED[:2] if args.only_deferred else DEFERRED,
                **spy,
                "tag": "deferred",
                "pyspy_variants": ["plain", "logprobs"] if args.pyspy_idle else ["logprobs"],
            },
            {"ASYNCRL_DEFER_LOGPROBS": "1"},
        )
        if not deferred.pop("defer_installed"):
            raise RuntimeError("ASYNCRL_DEFER_LOGPROBS=1 had no effect: asyncrl's vLLM plugin is not installed")
        processed.pop("defer_installed")
        # the py-spy rounds' results are not rates: out of the engines' dicts before the rates are read off
        # them
        spies = {f"{tag}_{k}": v for tag, e in (("processed", processed), ("deferred", deferred)) for k, v in
                 e.pop("pyspy", {}).items()}  # fmt: skip
        rates = {**processed} if raw is None else {**processed, "logprobs_raw": raw["logprobs"]}
        prof = None
        if args.profile:
            prof = engine(
                {**base, "mode": "processed_logprobs", "variants": [], "profile": True, "repeats": 1},
                {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
            )
    for v in spies.values():
        if Path(v["path"]).is_file():
            from pyspy_summary import render, summarize

            v["summary"] = summarize(Path(v["path"]).read_text())
            print(f"== py-spy {v['path']} (tok/s {[round(x) for x in v['tok_s']]})\n{render(v['summary'], 8)}")
        else:
            print(f"== py-spy wrote no {v['path']} (exit {v['returncode']}): {v['log']}")
    splits = {"": rates.pop("split"), "deferred_": deferred.pop("split")}
    plain = rates.pop("plain")
    all_runs = rates.pop("all_tok_s")
    ratios = {k: v / plain for k, v in rates.items()}
    if plain is not None:
        rates["plain"], ratios["plain"] = plain, 1.0
    deferred_runs = deferred.pop("all_tok_s")
    for k in (k for k in DEFERRED if k in deferred):
        rates[f"deferred_{k}"] = deferred[k]
        ratios[f"deferred_{k}"] = deferred[k] / deferred["plain"]  # against the same engine's plain
    print(f"{'variant':<28}{'output tok/s':>14}{'vs plain':>10}")
    for k in (*ORDER, "logprobs_raw", *(f"deferred_{k}" for k in DEFERRED)):
        if k not in rates:
            continue
        print(f"{k:<28}{rates[k]:>14,.0f}{ratios[k]:>10.2f}")
    print(f"{'variant':<28}{'step ms':>9}{'engine tok/s':>14}{'tail ms':>9}  (medians; see note_split)")
    for tag, by in splits.items():
        for k, v in by.items():
            print(f"{tag + k:<28}{v['step_ms']:>9.2f}{v['engine_tok_s']:>14,.0f}{v['tail_ms']:>9.1f}")
    result = {
        "rates_tok_s": rates,
        "ratio_vs_plain": ratios,
        "all_tok_s": all_runs,
        "deferred_all_tok_s": deferred_runs,
        "repeats": args.repeats,
        "split": splits,
        "pyspy": spies,
    }
    if prof:
        result["profile"] = prof
        print(
            f"in-process, cProfile on: logprobs {prof['profile_logprobs_tok_s']:,.0f} tok/s, "
            f"plain {prof['profile_plain_tok_s']:,.0f} tok/s"
        )
        print(prof["profile"])
        print(prof["profile_plain"])
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
