#!/usr/bin/env bash
# numerics=fast against numerics=bitwise in RL, on one GPU shared by the vLLM sidecar and the FSDP2 trainer
# (README.md here): SmolLM2-135M-Instruct, the smollm2_reverse_text experiment's SFT model, then 100 RL steps per
# arm from it, then the same eval. Only `numerics` (and the paths) differ. Stages: experiments/smollm2_arms.sh.
#   experiments/bitwise_vs_fast/run.sh [ARM ...]     (default: fast bitwise)
#   ARM_GPUS="0 1" experiments/bitwise_vs_fast/run.sh   # the arms side by side, one GPU each (logs: $O/ARM.log)
# The bitwise arm needs asyncrl installed where vLLM runs (its vLLM plugin is an entry point); the sidecar refuses
# to start otherwise.
set -euo pipefail
cd "$(dirname "$0")/../.."
. experiments/smollm2_arms.sh
declare -A ARMS=([fast]="numerics=fast" [bitwise]="numerics=bitwise")
O=outputs/bitwise_vs_fast
arms=("$@")
[[ ${#arms[@]} -gt 0 ]] || arms=(fast bitwise)
for arm in "${arms[@]}"; do  # every arm known before the first stage runs
  [[ -n "${ARMS[$arm]:-}" ]] || { echo "unknown arm $arm (have: ${!ARMS[*]})" >&2; exit 2; }
done
read -ra gpus <<<"${ARM_GPUS:-}"
if [[ ${#gpus[@]} -gt 0 && ${#gpus[@]} -lt ${#arms[@]} ]]; then
  echo "ARM_GPUS names ${#gpus[@]} GPUs for ${#arms[@]} arms" >&2 && exit 2
fi
smollm2_sft
if [[ ${#gpus[@]} -eq 0 ]]; then
  for arm in "${arms[@]}"; do
    # shellcheck disable=SC2086  # the arm's overrides are words
    rl_arm $O $arm ${ARMS[$arm]}
  done
else  # each arm on a GPU of its own, all at once: the same hardware per arm, so step times still compare
  mkdir -p $O
  pids=()
  for i in "${!arms[@]}"; do
    arm=${arms[$i]}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=${gpus[$i]} rl_arm $O $arm ${ARMS[$arm]} >"$O/$arm.log" 2>&1 &
    pids+=($!)
  done
  failed=()
  for i in "${!pids[@]}"; do wait "${pids[$i]}" || failed+=("${arms[$i]} (log: $O/${arms[$i]}.log)"); done
  if [[ ${#failed[@]} -gt 0 ]]; then echo "arms failed: ${failed[*]}" >&2 && exit 1; fi
fi
evals=()
for a in fast bitwise; do [[ -f $O/eval_$a/metrics.json ]] && evals+=("$O/eval_$a"); done
python -m asyncrl compare "${evals[@]}"
