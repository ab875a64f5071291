#!/usr/bin/env bash
# The multi-turn calculator environment (environments/calculator: call `calc: <expr>`, read `result: <v>`, reply
# `answer: <n>`) learning on the CPU default, through verifiers and the token route (experiment=calculator_vf):
# prepare -> SFT on the taskset's reference episodes (100 steps: the sampled policy still unsure) -> RL (200
# steps) -> eval of the SFT and the RL model on the 200 held-out tasks, and the training curve of RL.
#   benchmarks/vf_calculator.sh            # ~20 min on 2 cores; writes benchmarks/results/vf_calculator_cpu.json
# A step whose output exists is skipped (rm -r outputs/calculator_vf to rerun all).
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/pipeline_steps.sh
OUT=outputs/calculator_vf
X=experiment=calculator_vf
step $OUT/data/vf_calculator/eval.jsonl asyncrl prepare "$X"
step $OUT/sft/model asyncrl sft "$X"
step $OUT/eval_sft/metrics.json asyncrl eval "$X" model.name=$OUT/sft/model eval.out_dir=$OUT/eval_sft
step $OUT/rl/model asyncrl rl "$X" model.name=$OUT/sft/model launcher.overwrite=true launcher.progress=false
step $OUT/eval_rl/metrics.json asyncrl eval "$X" model.name=$OUT/rl/model eval.out_dir=$OUT/eval_rl
python - <<'PY'
import json, statistics, subprocess
from pathlib import Path

OUT, ENV = Path("outputs/calculator_vf"), "vf_calculator"
rows = [json.loads(l) for l in (OUT / "rl/metrics/orchestrator.jsonl").read_text().splitlines() if l.strip()]
keys = ["reward_mean", "correct_mean", "tool_use_mean", "calls_made_mean", "bad_calls_mean"]
def rl_key(k):
    return "rollout/reward_mean" if k == "reward_mean" else f"rollout/{ENV}/{k}"
curve = {k: [r[rl_key(k)] for r in rows] for k in keys}
out = {"rl": {f"{k}/first20": statistics.mean(v[:20]) for k, v in curve.items()}}
out["rl"].update({f"{k}/last20": statistics.mean(v[-20:]) for k, v in curve.items()})
out["rl"].update({"steps": len(rows), "generate_s_median": statistics.median(r["time/generate_s"] for r in rows),
                  "truncated_mean": statistics.mean(r["rollout/truncated"] for r in rows)})
for name in ("eval_sft", "eval_rl"):
    m = json.loads((OUT / name / "metrics.json").read_text())
    out[name] = {k.removeprefix(f"{ENV}/"): v for k, v in m.items() if k.startswith(f"{ENV}/") and "/" in k[len(ENV) + 1:]}
sha = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True)
result = {"command": "benchmarks/vf_calculator.sh", "git": sha, "cpu": cpu.stdout.strip(), **out}
Path("benchmarks/results/vf_calculator_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"{'eval (200 held-out tasks)':<28}{'after SFT':>12}{'after RL':>12}")
for k in out["eval_rl"]:
    print(f"{k:<28}{out['eval_sft'][k]:>12.4f}{out['eval_rl'][k]:>12.4f}")
print(f"\n{'RL training (64 episodes/step)':<28}{'first 20':>12}{'last 20':>12}")
for k in keys:
    print(f"{k:<28}{out['rl'][k + '/first20']:>12.4f}{out['rl'][k + '/last20']:>12.4f}")
PY
