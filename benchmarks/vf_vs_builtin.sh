#!/usr/bin/env bash
# reverse_text through verifiers vs the built-in environment, side by side on the CPU default: the whole
# pipeline (prepare -> SFT -> RL -> eval of both models) for experiment=reverse_text_vf, and RL through verifiers
# from the built-in's SFT model (the same start as the built-in RL: when the model "gets" reversal during SFT
# depends on the data order, so the two SFTs end at different points), then their eval and RL metrics next to
# those of the DVC pipeline's outputs/reverse_text (`make run`; run that first).
#   benchmarks/vf_vs_builtin.sh            # ~25 min on 2 cores; writes benchmarks/results/vf_vs_builtin_cpu.json
# A step whose output exists is skipped (rm -r outputs/reverse_text_vf to rerun all).
set -euo pipefail
cd "$(dirname "$0")/.."
. benchmarks/pipeline_steps.sh
OUT=outputs/reverse_text_vf
X=experiment=reverse_text_vf
[[ -f outputs/reverse_text/eval_rl/metrics.json ]] || { echo "run \`make run\` first (the built-in side)" >&2; exit 2; }
step $OUT/data/vf_reverse_text/eval.jsonl asyncrl prepare "$X"
step $OUT/sft/model asyncrl sft "$X"
step $OUT/rl/model asyncrl rl "$X" model.name=$OUT/sft/model launcher.overwrite=true launcher.progress=false
step $OUT/eval_sft/metrics.json asyncrl eval "$X" model.name=$OUT/sft/model eval.out_dir=$OUT/eval_sft
step $OUT/eval_rl/metrics.json asyncrl eval "$X" model.name=$OUT/rl/model eval.out_dir=$OUT/eval_rl
# RL through verifiers from the built-in's SFT model (its eval after SFT is the built-in's eval_sft, on
# the built-in's eval texts; after RL both are evaluated on both eval sets)
B=outputs/reverse_text/sft/model
step $OUT/rl_from_builtin_sft/model asyncrl rl "$X" model.name=$B run_dir=$OUT/rl_from_builtin_sft \
  launcher.overwrite=true launcher.progress=false
step $OUT/eval_rl_from_builtin_sft/metrics.json asyncrl eval experiment=reverse_text \
  model.name=$OUT/rl_from_builtin_sft/model eval.out_dir=$OUT/eval_rl_from_builtin_sft
python - <<'PY'
import json, statistics, subprocess
from pathlib import Path

def rl(run):
    rows = [json.loads(l) for l in Path(run, "metrics", "orchestrator.jsonl").read_text().splitlines() if l.strip()]
    r = [x["rollout/reward_mean"] for x in rows]
    return {"reward_first20": statistics.mean(r[:20]), "reward_last20": statistics.mean(r[-20:]),
            "generate_s_median": statistics.median(x["time/generate_s"] for x in rows)}

def ev(path, env):
    e = json.loads(Path(path, "metrics.json").read_text())
    return {"greedy": e[f"{env}/greedy/reward_mean"], "sampled": e[f"{env}/sampled/reward_mean"]}

B, V = "outputs/reverse_text", "outputs/reverse_text_vf"
columns = {  # (SFT eval, RL run, RL eval): every eval on its column's own eval texts
    "built-in": (ev(f"{B}/eval_sft", "reverse_text"), f"{B}/rl", ev(f"{B}/eval_rl", "reverse_text")),
    "verifiers": (ev(f"{V}/eval_sft", "vf_reverse_text"), f"{V}/rl", ev(f"{V}/eval_rl", "vf_reverse_text")),
    "verifiers RL from built-in SFT": (
        ev(f"{B}/eval_sft", "reverse_text"), f"{V}/rl_from_builtin_sft", ev(f"{V}/eval_rl_from_builtin_sft", "reverse_text")
    ),
}
out = {}
for name, (sft, run, after) in columns.items():
    m = {f"eval_sft/{k}": v for k, v in sft.items()}
    m.update({f"eval_rl/{k}": v for k, v in after.items()})
    m.update({f"rl/{k}": v for k, v in rl(run).items()})
    out[name] = m
sha = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True)
result = {"command": "benchmarks/vf_vs_builtin.sh", "git": sha, "cpu": cpu.stdout.strip(), **out}
Path("benchmarks/results/vf_vs_builtin_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
print(f"{'metric':<24}" + "".join(f"{n:>32}" for n in out))
for k in out["built-in"]:
    print(f"{k:<24}" + "".join(f"{out[n][k]:>32.4f}" for n in out))
PY
