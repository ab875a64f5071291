"""Where a GPU RL run's time goes, from what it wrote: per step, generation (scoring included: rewards run
beside it), the rewards' own time, training, the trainer's weight send and the sidecars' weight update;
trained tokens/s and MFU (6·N per token, N the matmul parameters) of the trainer's GPUs; the trainer's peak
memory; and how idle each GPU was while the loop ran (``nvidia-smi`` samples between the first and last
measured step).

    python benchmarks/rl_scale.py --run RUN_DIR --model MODEL_DIR --util gpu_util.csv --trainer-gpus 2,3
    --out x.json

``gpu_util.csv`` is ``nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used
--format=csv,noheader,nounits -lms 200`` taken during the run (benchmarks/gpu_rl_scale.sh does both).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from _results import read_jsonl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from asyncrl.trainer.perf import matmul_params, mfu_at  # noqa: E402


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def gpu_idle(util_csv: Path, start: float, end: float) -> dict[str, float]:
    """Per GPU, the share of the window ``[start, end]`` (epoch seconds) it ran no kernel, by nvidia-smi's
    utilization samples (100 - utilization, averaged)."""
    per_gpu: dict[str, list[float]] = {}
    for line in util_csv.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[2].isdigit():
            continue
        t = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        if start <= t <= end:
            per_gpu.setdefault(parts[1], []).append(1 - int(parts[2]) / 100)
    return {gpu: statistics.mean(v) for gpu, v in sorted(per_gpu.items())}


def trainer_mfu(rows: list[dict], cfg, tok_s: list[float], completion: int, device: str, world: int) -> dict:
    """The trainer's MFU both ways over the measured steps: as it logged them (``train/mfu_6n``,
    ``train/mfu_attn``: its own samples' lengths, on a GPU of known peak); else from its tokens/s on
    ``device``, attention counted over samples of the median completion length (prompts left out: a lower
    bound)."""
    if rows and all("train/mfu_6n" in r for r in rows):
        return {f"trainer_{k}": spread([r[f"train/{k}"] for r in rows]) for k in ("mfu_6n", "mfu_attn")}
    runs = [mfu_at(cfg, [max(completion, 1)], t, device, world) for t in tok_s]
    return {f"trainer_{k}": spread([m[k] for m in runs]) for k in ("mfu_6n", "mfu_attn")} if runs else {}


def summarize(run: Path, model_dir: Path, util: Path | None, trainer_gpus: list[str], skip: int, device: str) -> dict:
    from transformers import AutoConfig

    orch = read_jsonl(run / "metrics" / "orchestrator.jsonl")
    train = read_jsonl(run / "metrics" / "trainer.jsonl")
    measured = [r for r in train if r["step"] >= skip]  # the first steps compile and warm up
    cfg = AutoConfig.from_pretrained(model_dir)
    n = matmul_params(cfg)
    world = len(trainer_gpus)
    tok_s = [r["train/tokens_per_s"] for r in measured]
    completion = round(statistics.median([r["rollout/completion_len_mean"] for r in orch] or [0]))
    steps = [r["time"] for r in train]
    result = {
        "benchmark": "rl_scale",
        "date": time.strftime("%Y-%m-%d"),
        "device": device,
        "matmul_params": n,
        "steps": len(train),
        "measured_from_step": skip,
        "seconds_per_step": spread([b - a for a, b in zip(steps[skip:], steps[skip + 1 :], strict=False)]),
        "generate_s": spread([r["time/generate_s"] for r in orch if r["step"] >= skip]),
        "score_s_summed": spread([r.get("time/score_s", 0.0) for r in orch if r["step"] >= skip]),
        "update_weights_s": spread([r["time/update_weights_s"] for r in orch if r["step"] >= max(skip, 1)]),
        "wait_policy_s": spread([r["time/wait_policy_s"] for r in orch if r["step"] >= skip]),
        "train_s": spread([r["time/train_s"] for r in measured]),
        "publish_s": spread([r["time/publish_s"] for r in measured if "time/publish_s" in r]),
        "wait_rollouts_s": spread([r["time/wait_rollouts_s"] for r in measured]),
        "train_tokens_per_s": spread(tok_s),
        "gen_tokens_per_s": spread([r["rollout/throughput_tok_s"] for r in orch if r["step"] >= skip]),
        **trainer_mfu(measured, cfg, tok_s, completion, device, world),
        "trainer_peak_mem_gib": max((r.get("train/peak_mem_gib", 0.0) for r in train), default=0.0),
        "mismatch_kl": [r["train/mismatch_kl"] for r in train],
    }
    if util is not None and len(measured) > 1:
        idle = gpu_idle(util, measured[0]["time"], measured[-1]["time"])
        result["gpu_idle_share"] = idle
        result["gpu_idle_share_mean"] = statistics.mean(idle.values()) if idle else None
        result["trainer_gpus"] = trainer_gpus
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--model", type=Path, required=True, help="the model directory (its config.json counts N)")
    ap.add_argument("--util", type=Path, help="nvidia-smi samples taken during the run")
    ap.add_argument("--trainer-gpus", default="0", help="the trainer's GPUs, comma-separated (MFU divides by them)")
    ap.add_argument("--skip", type=int, default=1, help="steps left out of the medians (compilation, warm-up)")
    ap.add_argument("--device", default="H100")
    ap.add_argument("--command", default="", help="the command that made the run, recorded with the results")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    result = summarize(args.run, args.model, args.util, args.trainer_gpus.split(","), args.skip, args.device)
    result["command"] = args.command
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        if isinstance(value, dict) and "median" in value:
            print(f"{key}: {value['median']:.4g} (range {value['min']:.4g}-{value['max']:.4g})")
        elif key in ("gpu_idle_share", "gpu_idle_share_mean", "trainer_peak_mem_gib", "steps"):
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
