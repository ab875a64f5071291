#!/usr/bin/env bash
# numerics=fast against numerics=bitwise in RL, on one GPU shared by the vLLM sidecar and the FSDP2 trainer
# (README.md here): SmolLM2-135M-Instruct, the smollm2_reverse_text experiment's SFT model, then 100 RL steps per
# arm from it, then the same eval. Only `numerics` (and the paths) differ. Stages: experiments/smollm2_arms.sh.
#   experiments/bitwise_vs_fast/run.sh [ARM ...]     (default: fast bitwise)
# The bitwise arm needs asyncrl installed where vLLM runs (its vLLM plugin is an entry point); the sidecar refuses
# to start otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/smollm2_arms.sh
declare -A ARMS=([fast]="numerics=fast" [bitwise]="numerics=bitwise")
O=outputs/bitwise_vs_fast
for arm in ${@:-fast bitwise}; do  # every arm known before the first stage runs
  [[ -n "${ARMS[$arm]:-}" ]] || { echo "unknown arm $arm (have: ${!ARMS[*]})" >&2; exit 2; }
done
smollm2_sft
for arm in ${@:-fast bitwise}; do
  # shellcheck disable=SC2086  # the arm's overrides are words
  rl_arm $O $arm ${ARMS[$arm]}
done
python -m asyncrl.evals.compare $(for a in fast bitwise; do [ -f $O/eval_$a/metrics.json ] && echo $O/eval_$a; done)
