# shellcheck shell=bash
# Copy what the smollm2 verifiable runs produced into $OUT/r (the lent GPU machine returns $OUT): run after run.sh.
mkdir -p $OUT/r
for t in math code; do
  O=outputs/smollm2_$t
  for d in eval_base eval_rl; do
    [ -f $O/$d/metrics.json ] && cp $O/$d/metrics.json $OUT/r/${t}_$d.metrics.json
    [ -f $O/$d/samples.jsonl ] && head -c 400000 $O/$d/samples.jsonl > $OUT/r/${t}_$d.samples.jsonl
  done
  if [ -d $O/rl ]; then
    cp $O/rl/metrics/orchestrator.jsonl $OUT/r/${t}_orchestrator.jsonl 2>/dev/null
    cp $O/rl/metrics/trainer.jsonl $OUT/r/${t}_trainer.jsonl 2>/dev/null
    cp $O/rl/configs/config.yaml $OUT/r/${t}_rl_config.yaml 2>/dev/null
    cp $O/rl/run_meta.json $OUT/r/${t}_rl_run_meta.json 2>/dev/null
    tail -c 20000 $O/rl/logs/orchestrator.log > $OUT/r/${t}_orchestrator.log 2>/dev/null
    tail -c 20000 $O/rl/logs/trainer.log > $OUT/r/${t}_trainer.log 2>/dev/null
  fi
done
ls -la $OUT/r
