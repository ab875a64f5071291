"""The GPU benchmarks' own code, run on the CPU: a script that only ever runs on a lent GPU would otherwise
break unseen (``trainer_mfu.py --smoke`` once did, refused by a config check it never met on the CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_trainer_mfu_smoke_runs_and_profiles_each_step_variant(tmp_path):
    """Two configurations of the grid (each is a process of its own, ~10 s on the CPU): the step as it is and
    the unfused one, two packed rows a forward, one layer in two recomputed keeping its matmuls and
    attention, each profiled."""
    out = tmp_path / "mfu.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "trainer_mfu.py"),
            "--smoke",
            "--row-lens",
            "256",
            "--attn",
            "varlen",
            "--rows",
            "2",
            "--mb-rows",
            "2",
            "--step-variant",
            "current",
            "unfused",
            "--ac",
            "2:matmuls_and_attention",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--profile",
            str(tmp_path / "prof"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(out.read_text())
    results = written["results"]
    assert [r.get("error") for r in results] == [None] * 2, proc.stdout
    assert [m["runs"] for m in written["summary"]] == [1, 1] and not list(tmp_path.glob("*.tmp"))
    assert [(r["rows_per_micro_batch"], r["step_variant"]) for r in results] == [
        (2, "current"),
        (2, "unfused"),
    ]
    assert [r["activation_checkpointing"] for r in results] == ["2:matmuls_and_attention"] * 2
    assert all(lo <= r["tokens_per_s"] <= hi for r in results for lo, hi in [r["tokens_per_s_range"]])
    assert all(r["tokens_per_s"] > 0 and r["profile_phases_s"]["step_wall"] > 0 for r in results)
    assert all(r["wall_s"] > r["profile_phases_s"]["step_wall"] for r in results)  # the run's process, whole
    assert all(r["mfu_attn"] > r["mfu_6n"] and r["sample_len"] == "mixed" for r in results)
    assert len(list((tmp_path / "prof").glob("*_ops.txt"))) == 2


def test_rl_scale_reads_the_trainers_mfu_or_estimates_it(monkeypatch, tmp_path):
    """The loop's MFU both ways (rl_scale.py): as the trainer logged it, else from its tokens/s with
    attention over the median completion length."""
    from transformers import AutoConfig

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from rl_scale import summarize

    AutoConfig.for_model("qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936).save_pretrained(tmp_path / "model")  # fmt: skip
    metrics = tmp_path / "run" / "metrics"
    metrics.mkdir(parents=True)
    train = [{"step": s, "time": 30.0 * s, "train/tokens_per_s": 11000.0, "time/train_s": 23.0,
              "time/wait_rollouts_s": 0.0, "train/mismatch_kl": 0.0} for s in range(3)]  # fmt: skip
    orch = [
        {
            "step": s,
            "time/generate_s": 8.0,
            "time/update_weights_s": 0.1,
            "time/wait_policy_s": 0.0,
            "rollout/throughput_tok_s": 3e4,
            "rollout/completion_len_mean": 8000.0,
        }
        for s in range(3)
    ]

    def write(train_rows):
        for name, rows in (("trainer", train_rows), ("orchestrator", orch)):
            (metrics / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return summarize(tmp_path / "run", tmp_path / "model", None, ["3"], 1, "NVIDIA H100 80GB HBM3")

    r = write(train)
    # the Qwen3-4B shape at 8,000-token samples: causal attention is ~29% on top of 6·N
    ratio = r["trainer_mfu_attn"]["median"] / r["trainer_mfu_6n"]["median"]
    assert ratio == pytest.approx(1 + 6 * 36 * 32 * 128 * 8000 / (6 * r["matmul_params"]))
    assert r["trainer_mfu_6n"]["median"] == pytest.approx(11000 * 6 * r["matmul_params"] / 989e12)
    logged = write([{**row, "train/mfu_6n": 0.3, "train/mfu_attn": 0.4} for row in train])
    assert logged["trainer_mfu_6n"]["median"] == 0.3 and logged["trainer_mfu_attn"]["median"] == 0.4


def test_trainer_mfu_counts_gpu_busy_time_as_the_profilers_table_does(monkeypatch):
    """Only the device's own events: a CPU op's self device time repeats its kernels', and a record_function
    range on the GPU's timeline spans them (summing all three would count a 0.8 s step as 1.7 s busy)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from trainer_mfu import kernel_time_s

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    events = [
        event(DeviceType.CPU, 300.0),  # aten::mm: the time of the kernels it launched
        event(DeviceType.CUDA, 300.0),  # the kernels themselves
        event(DeviceType.CUDA, 400.0, annotation=True),  # asyncrl.forward on the GPU's timeline
        event(DeviceType.CUDA, 50.0),  # a copy
    ]
    assert kernel_time_s(events) == 350.0 / 1e6


def test_benchmark_arms_rotate_and_trainer_mfu_reports_each_ones_median_and_range(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from trainer_mfu import summarize

    from _results import rounds

    assert [v for _, v in rounds(["x", "y", "z"], 4)] == list("xyzyzxzxyxyz")
    assert [r for r, _ in rounds(["a", "b"], 2)] == [0, 0, 1, 1]

    def run(label, tok, mfu, mem=1.0):
        return {
            "label": label,
            "tokens_per_s": tok,
            "mfu_6n": mfu,
            "mfu_attn": 1.5 * mfu,
            "peak_mem_gib": mem,
        }

    failed = [{"label": "ac 1", "error": "out of memory"}, {"label": "ac 4", "error": "x"}]
    results = [run("ac 2", 10.0, 0.40), run("ac 1", 8.0, 0.36, 2.0), run("ac 2", 14.0, 0.44, 3.0), failed[0],
               run("ac 2", 11.0, 0.41), failed[1]]  # fmt: skip
    ac2, ac1 = summarize(results)  # a configuration that never ran has no summary
    assert ac2 == {"label": "ac 2", "runs": 3, "tokens_per_s": 11.0, "tokens_per_s_range": [10.0, 14.0],
                   "mfu_6n": 0.41, "mfu_6n_range": [0.40, 0.44], "mfu_attn": 1.5 * 0.41,
                   "mfu_attn_range": [1.5 * 0.40, 1.5 * 0.44], "peak_mem_gib": 3.0}  # fmt: skip
    assert ac1["runs"] == 1 and ac1["tokens_per_s_range"] == [8.0, 8.0] and ac1["peak_mem_gib"] == 2.0


def test_attention_kernels_runs_and_reports_missing_packages(tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "attention_kernels.py"),
            "--device",
            "cpu",
            "--tokens",
            "300",
            "--repeats",
            "2",
            "--kernels",
            "torch_varlen",
            "torch_varlen",
            "no_such_kernel",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, again, unknown = json.loads(out.read_text())["results"]
    assert first["forward_backward_s"] > 0 and first["max_abs_diff_out"] == 0.0
    # the same kernel again: the reference (the first kernel's output and gradient) is unchanged by its timed
    # steps
    assert again["max_abs_diff_out"] == 0.0 and again["max_abs_diff_grad_q"] == 0.0, again
    # against the exact per-sample answer (fp32 here): only rounding, for the output and the query gradient
    assert all(r["rel_err_out"] < 1e-5 and r["rel_err_grad_q"] < 1e-5 for r in (first, again)), (
        first,
        again,
    )
    assert "unknown kernel" in unknown["error"]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)"
)
def test_logprobs_transport_replays_vllms_cpu_side(tmp_path):
    out = tmp_path / "lt.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "logprobs_transport.py"),
            "--requests",
            "8",
            "--steps",
            "5",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # it also checks deferred == per-step logprobs
    assert {r["mode"] for r in json.loads(out.read_text())["rows"]} == {"plain", "per_step", "deferred"}


def test_pyspy_summary_splits_processes_and_threads(tmp_path):
    raw = tmp_path / "raw.txt"
    # as py-spy writes them: a command line as it is (newlines and ';' too), a forked child under its parent
    cmd = 'process 7:"python -c import os; x = 1\nrun(x)"'
    raw.write_text(
        f"{cmd};thread (0x1);run (a.py:1);step (a.py:9) 30\n"
        f"{cmd};thread (0x1);run (a.py:1);slice (b.py:4) 10\n"
        f"{cmd};thread (0x2);send (c.py:2) 5\n"
        f'{cmd};process 8:"EngineCore";thread (0x3);loop (d.py:3);run (a.py:1) 20\n'
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "pyspy_summary.py"), str(raw), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    main = s["process 7: python -c import os; x = 1 run(x) / thread (0x1)"]
    assert main["samples"] == 40
    assert main["self"] == [["step (a.py:9)", 30], ["slice (b.py:4)", 10]]
    assert dict(main["total"])["run (a.py:1)"] == 40
    assert s["process 8: EngineCore / thread (0x3)"]["self"] == [["run (a.py:1)", 20]]
    assert list(s)[0] == "process 7: python -c import os; x = 1 run(x) / thread (0x1)"  # busiest first
    assert s["process 7: python -c import os; x = 1 run(x) / thread (0x2)"]["samples"] == 5


def test_pyspy_record_runs_the_work_while_py_spy_records(tmp_path, monkeypatch):
    """``pyspy_summary.record`` (rollouts.py --pyspy): py-spy is asked for the process and its children,
    threads apart, in raw form; the work runs while it records, and the profile comes back summarized."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from pyspy_summary import record

    spy = tmp_path / "py-spy"  # writes a profile to --output and its arguments beside it
    spy.write_text('#!/bin/sh\necho "$@" > "$0.args"\nwhile [ "$1" != --output ]; do shift; done\n'
                   'printf \'process 9:"vllm";thread (0x1);step (s.py:1) 12\\n\' > "$2"\n')  # fmt: skip
    spy.chmod(0o755)
    calls = []

    def work():
        time.sleep(0.05)
        calls.append(1)
        return len(calls)

    got = record(str(spy), 123, tmp_path / "p.txt", 6, work, idle=True)
    args = (tmp_path / "py-spy.args").read_text().split()
    assert args[:3] == ["record", "--pid", "123"] and {"--subprocesses", "--threads", "--idle"} <= set(args)
    assert args[args.index("--format") + 1] == "raw" and args[args.index("--duration") + 1] == "6"
    assert calls and got["results"] == list(range(1, len(calls) + 1)) and got["returncode"] == 0
    assert "process 9: vllm / thread (0x1): 12 samples" in got["summary"]
    assert record(str(spy), 5, tmp_path / "q.txt", 6, None)["results"] == []


def test_logprobs_cost_reports_what_its_engines_measured(tmp_path, monkeypatch):
    """logprobs_cost.py's own code after the engines (each a vLLM process, GPU only) return: a run on the GPU
    once lost every figure to a TypeError here."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import logprobs_cost

    import asyncrl.models.hf

    spy = tmp_path / "pyspy_processed_logprobs.txt"
    spy.write_text('process 1:"EngineCore";thread (0x1);step (a.py:1) 7\n')

    specs = []

    def engine(spec, env_extra=None):
        specs.append(spec)
        rates = {v: 1000.0 * (i + 1) for i, v in enumerate(spec["variants"])}
        out = {**rates, "all_tok_s": {v: [r] for v, r in rates.items()}, "defer_installed": bool(env_extra)}
        out["split"] = {v: {"step_ms": 5.0, "engine_tok_s": 2 * r, "tail_ms": 10.0 * (i + 1)}
                        for i, (v, r) in enumerate(rates.items())}  # fmt: skip
        if spec.get("pyspy"):
            out["pyspy"] = {"logprobs": {"path": str(spy), "tok_s": [1.0], "returncode": 0, "log": ""}}
        return out

    monkeypatch.setattr(logprobs_cost, "engine", engine)
    monkeypatch.setattr(asyncrl.models.hf, "build_tiny_model", lambda init, path, seed: path)
    out = tmp_path / "lc.json"
    argv = [
        "--out",
        str(out),
        "--skip-raw",
        "--pyspy",
        "py-spy",
        "--pyspy-idle",
        "--variants",
        "plain",
        "logprobs",
    ]
    monkeypatch.setattr(sys, "argv", ["logprobs_cost.py", *argv])
    assert logprobs_cost.main() == 0
    result = json.loads(out.read_text())
    assert specs[0]["variants"] == ["plain", "logprobs"] and all(s["pyspy_idle"] for s in specs)
    # the deferred engine waits are compared with plain's
    assert specs[1]["pyspy_variants"] == ["plain", "logprobs"]
    assert result["split"]["deferred_"]["logprobs"]["tail_ms"] == 20.0
    assert (
        result["ratio_vs_plain"]["logprobs"] == 2.0 and result["ratio_vs_plain"]["deferred_logprobs"] == 2.0
    )
    assert "logprobs_raw" not in result["rates_tok_s"]
    assert (
        result["pyspy"]["processed_logprobs"]["summary"]["process 1: EngineCore / thread (0x1)"]["samples"]
        == 7
    )


def test_profile_totals_reads_torch_profiler_tables(monkeypatch):
    """logprobs_cost.py --kernels reads the totals off the table vLLM's worker writes
    (key_averages().table())."""
    import torch

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from logprobs_cost import profile_totals

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(256, 256) @ torch.ones(256, 256)
    table = prof.key_averages().table(sort_by="self_cpu_time_total")
    assert profile_totals(table)["self_cpu_ms"] > 0, table[-300:]
    assert profile_totals("Self CPU time total: 2.5s\nSelf CUDA time total: 812.5ms") == {
        "self_cpu_ms": 2500.0,
        "self_cuda_ms": 812.5,
    }
    assert profile_totals("Self CPU time total: 950us") == {"self_cpu_ms": pytest.approx(0.95)}


def test_context_parallel_arms_name_any_fsdp2_layout(monkeypatch):
    """benchmarks/context_parallel.py's arms: the names of earlier results, and <N>gpu[_cp<C>][_ac[<K>]] for
    the 4- and 8-GPU trainer runs; MFU is counted over the arm's GPUs."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from context_parallel import arm_overrides

    assert arm_overrides("cp2_ac") == arm_overrides("2gpu_cp2_ac")
    gpus, over = arm_overrides("8gpu_cp2_ac")
    assert gpus == 8 and "trainer.fabric.gpus='0,1,2,3,4,5,6,7'" in over
    assert (
        "trainer.fabric.context_parallel=2" in over
        and "trainer.fabric.activation_checkpointing=true" in over
    )
    assert arm_overrides("4gpu") == (4, ["trainer.fabric.devices=4", "trainer.fabric.gpus='0,1,2,3'"])
    assert arm_overrides("4gpu_ac2")[1][2:] == [
        "trainer.fabric.activation_checkpointing=true",
        "trainer.fabric.activation_checkpointing_every=2",
    ]
    assert not any("every" in o for o in arm_overrides("4gpu_ac")[1] + arm_overrides("4gpu_ac1")[1])
    for bad in ("3gpu_cp2", "eight", "0gpu", "2gpu_ac0", "2gpu_ac_2"):
        with pytest.raises(argparse.ArgumentTypeError):
            arm_overrides(bad)


def test_context_parallel_summary_over_an_arms_runs(monkeypatch):
    """Each arm's median and range over the runs that finished, MFU over the arm's GPUs; an arm whose every
    run failed keeps its error, and one not run yet (a call cut at its limit) says so."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from context_parallel import summarize

    results = {
        "1gpu_ac": [{"tokens_per_s": 10.0, "peak_mem_gib": 5.0}, {"tokens_per_s": 14.0, "peak_mem_gib": 6.0},
                    {"tokens_per_s": 11.0, "peak_mem_gib": 5.5}, {"error": "out of memory"}],
        "cp2": [{"error": "x" * 600}],
        "cp2_ac": [],
    }  # fmt: skip
    s = summarize(results, flops_6n=100.0, flops_attn=300.0, peak=1000.0)
    one = s["1gpu_ac"]
    assert (one["tokens_per_s"], one["tokens_per_s_range"], one["runs"], one["peak_mem_gib"]) == (
        11.0,
        [10.0, 14.0],
        3,
        6.0,
    )
    assert one["mfu_6n"] == pytest.approx(11.0 * 100 / 1000) and one["mfu_attn"] == pytest.approx(3.3)
    assert s["cp2"] == {"error": "x" * 500} and s["cp2_ac"] == {"error": "not run yet"}
    assert summarize({"2gpu_cp2": [{"tokens_per_s": 20.0, "peak_mem_gib": 1.0}]}, 100.0, 300.0, 1000.0)[
        "2gpu_cp2"
    ]["mfu_6n"] == pytest.approx(1.0)  # two GPUs: half of 20 x 100 / 1000


STAND_IN_GPU_TESTS = """import os

import pytest

pytestmark = pytest.mark.gpu


@pytest.mark.two_gpus  # the mark, not the name, gets it a pair
def test_on_a_pair():
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2"


def test_on_one_gpu():
    assert os.environ["CUDA_VISIBLE_DEVICES"] in ("1", "2") and "STAND_IN_TRAINER" not in os.environ


@pytest.mark.trainer_env  # under $TRAINER_PYTHON, on one GPU
def test_in_the_trainers_environment():
    assert os.environ["CUDA_VISIBLE_DEVICES"] in ("1", "2") and os.environ["STAND_IN_TRAINER"] == "1"
"""


def test_gpu_suite_lanes_runs_every_phase_and_returns(tmp_path):
    """The lane runner on a machine that reports three GPUs and lends two of them to the lanes (LANE_GPUS):
    the two-GPU phase and then the one-GPU phase run, each test in a lane of its GPUs, and the script ends by
    itself with the passed list and the lanes' logs in $OUT; a second call with the same code runs nothing
    again. What runs is the runner's own control flow, which a lent machine only finds broken after minutes
    of its budget: two stand-in tests marked `gpu` (the real ones need CUDA) check the GPUs their lane was
    given, the one marked `two_gpus` a pair, the one marked `trainer_env` its interpreter."""
    root = tmp_path / "repo"
    for d in ("benchmarks", "tests/gpu", "src"):
        (root / d).mkdir(parents=True)
    for script in ("gpu_suite_lanes.sh", "device_env.sh"):
        shutil.copy(ROOT / "benchmarks" / script, root / "benchmarks" / script)
    (root / "tests" / "helpers").symlink_to(ROOT / "tests" / "helpers")  # --budget-s, --passed-file
    (root / "tests" / "gpu" / "test_stand_in.py").write_text(STAND_IN_GPU_TESTS)
    (root / "pyproject.toml").write_text(
        '[tool.pytest.ini_options]\naddopts = "-p helpers.suite_budget --strict-markers"\n'
        'markers = ["gpu: s", "two_gpus: s", "four_gpus: s", "trainer_env: s"]\n'
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # what the runner asks of it: the GPUs (-L) and their name
    smi.write_text('#!/bin/sh\n[ "$1" = -L ] && printf "GPU 0\\nGPU 1\\nGPU 2\\n" || echo "no GPU here"\n')
    smi.chmod(0o755)
    trainer_python = bin_dir / "trainer-python"  # device_env.sh's, as the lanes call it
    trainer_python.write_text(f'#!/bin/sh\nSTAND_IN_TRAINER=1 exec "{sys.executable}" "$@"\n')
    trainer_python.chmod(0o755)
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OUT": str(out),
        "LANES_TMP": str(tmp_path / "lanes"),
        "SITE": str(tmp_path / "site"),
        "LANE_ORDER": "2 1 t",
        "TRAINER_PYTHON": str(trainer_python),
        "LANE_GPUS": "1,2",
        # the runner's control flow, not pytest's plugins: without loading every installed plugin each of its
        # dozen pytest starts takes 0.4 s, not 2.2 (`time python -m pytest -q` of a one-test file, 2 cores)
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    lanes = ["bash", str(root / "benchmarks" / "gpu_suite_lanes.sh"), "120"]
    proc = subprocess.run(lanes, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "[gpus1_2] PASSED tests/gpu/test_stand_in.py::test_on_a_pair" in lines, proc.stdout
    assert "[gpus1] PASSED tests/gpu/test_stand_in.py::test_on_one_gpu" in lines, proc.stdout
    assert "[trainer_gpus1] PASSED tests/gpu/test_stand_in.py::test_in_the_trainers_environment" in lines
    assert lines[-1] == "passed so far (all calls with this code): 3", proc.stdout
    assert len((out / "gpu_suite" / "passed.txt").read_text().splitlines()) == 3
    logs = ["pytest_gpus1.log", "pytest_gpus1_2.log", "pytest_trainer_gpus1.log"]
    assert sorted(p.name for p in (out / "lanes").iterdir()) == logs
    again = subprocess.run(lanes, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "PASSED" not in again.stdout, again.stdout
    assert again.stdout.splitlines()[-1] == lines[-1], again.stdout
