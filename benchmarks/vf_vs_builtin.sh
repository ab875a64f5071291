#!/usr/bin/env bash
# reverse_text through verifiers vs the built-in environment, side by side on the CPU default: the whole
# pipeline (prepare -> SFT -> RL -> eval of both models) for experiment=reverse_text_vf, then its eval and RL
# metrics next to those of the DVC pipeline's outputs/reverse_text (`make run`; run that first).
#   benchmarks/vf_vs_builtin.sh            # ~15 min on 2 cores; writes benchmarks/results/vf_vs_builtin_cpu.json
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
export PATH="$PWD/$BIN:$PATH" HF_HUB_OFFLINE=1
OUT=outputs/reverse_text_vf
X=experiment=reverse_text_vf
[[ -f outputs/reverse_text/eval_rl/metrics.json ]] || { echo "run \`make run\` first (the built-in side)" >&2; exit 2; }
start=$(date +%s)
asyncrl prepare "$X"
asyncrl sft "$X"
asyncrl rl "$X" model.name=$OUT/sft/model launcher.overwrite=true launcher.progress=false
asyncrl eval "$X" model.name=$OUT/sft/model eval.out_dir=$OUT/eval_sft
asyncrl eval "$X" model.name=$OUT/rl/model eval.out_dir=$OUT/eval_rl
python - "$(( $(date +%s) - start ))" <<'PY'
import json, statistics, subprocess, sys
from pathlib import Path

def rl(run):
    rows = [json.loads(l) for l in Path(run, "metrics", "orchestrator.jsonl").read_text().splitlines() if l.strip()]
    r = [x["rollout/reward_mean"] for x in rows]
    return {"reward_first20": statistics.mean(r[:20]), "reward_last20": statistics.mean(r[-20:]),
            "generate_s_median": statistics.median(x["time/generate_s"] for x in rows)}

out = {}
for side, root, env in (("builtin", "outputs/reverse_text", "reverse_text"), ("verifiers", "outputs/reverse_text_vf", "vf_reverse_text")):
    m = {}
    for stage in ("sft", "rl"):
        e = json.loads(Path(root, f"eval_{stage}", "metrics.json").read_text())
        m[f"eval_{stage}/greedy"] = e[f"{env}/greedy/reward_mean"]
        m[f"eval_{stage}/sampled"] = e[f"{env}/sampled/reward_mean"]
    m.update({f"rl/{k}": v for k, v in rl(Path(root, "rl")).items()})
    out[side] = m
sha = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True).stdout.strip()
result = {"command": "benchmarks/vf_vs_builtin.sh", "git": sha, "wall_s_verifiers_side": int(sys.argv[1]),
          "cpu": subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip(),
          **out}
Path("benchmarks/results/vf_vs_builtin_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
keys = list(out["builtin"])
print(f"{'metric':<28}{'built-in':>10}{'verifiers':>11}")
for k in keys:
    print(f"{k:<28}{out['builtin'][k]:>10.4f}{out['verifiers'][k]:>11.4f}")
PY
