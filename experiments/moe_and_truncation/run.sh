#!/usr/bin/env bash
# Truncated sampling and a mixture of experts with the vLLM sidecar (README.md here), stage by stage, each under one
# lent-GPU call (10 minutes); a stage whose output exists is skipped (benchmarks/pipeline_steps.sh).
#   run.sh pack BUNDLE_DIR   # here, not on the GPU: the KEEP_MOE vLLM bundle in BUNDLE_DIR as .vllm-moe.partN/ carry
#                            # folders, one per call (made by `KEEP_MOE=1 ../shared/tools/offline-vllm/build.sh DIR`)
#   run.sh truncation        # gpu_small, SFT, then RL at top_p 0.9: exact ratios, and the full-distribution ones
#   run.sh moe               # the GPU Qwen3-MoE, SFT, then RL with vLLM's routes: router replay on, and off
#   run.sh moe_nccl          # (2 GPUs) the same MoE's RL with its experts broadcast over NCCL
#   run.sh tests             # the GPU tests of both features (tests/gpu/test_moe_vllm.py, test_truncated_sampling.py)
#   run.sh collect           # $OUT/moe_and_truncation.tar.gz: every run's metrics and configs
# On the lent machine every stage but `pack` first assembles the bundle from the carried pieces, then sources
# benchmarks/device_env.sh. VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's engine in-process (the bundle's README saw
# a MoE engine hang in the default multiprocess mode once).
set -euo pipefail
cd "$(dirname "$0")/../.."
O=outputs/moe_and_truncation
SITE=${SITE:-/tmp/site}
# the tests' GPU models and task (tests/gpu/conftest.py, tests/helpers/launch.py SMALL_TASK)
TASK=(env.reverse_text.args.min_len=3 env.reverse_text.args.max_len=6 env.reverse_text.args.num_train=2000
  env.reverse_text.args.num_eval=24 seq_len=512)
GPU=(trainer.fabric.accelerator=cuda trainer.fabric.precision=bf16-mixed trainer.fabric.num_threads=0)
MOE=(model.init.architecture=Qwen3MoeForCausalLM model.init.num_experts=8 model.init.num_experts_per_tok=2
  model.init.moe_intermediate_size=256 model.init.norm_topk_prob=true)
RL=(inference.backend=vllm inference.vllm.enforce_eager=true inference.vllm.gpu_memory_utilization=0.3
  orchestrator.max_tokens=10 orchestrator.prompts_per_step=16 orchestrator.group_size=16 launcher.progress=false
  launcher.overwrite=true)

pack() {  # pack BUNDLE_DIR: its site.tar.xz in 40 MB pieces, each in a carry folder with setup.sh and the sum
  local dir=${1:?usage: run.sh pack BUNDLE_DIR} sum n i=0
  sum=$(sha256sum "$dir/site.tar.xz" | cut -d' ' -f1)
  rm -rf .vllm-moe.part* "$dir"/site.part.*
  split -b 40M "$dir/site.tar.xz" "$dir/site.part."
  n=$(find "$dir" -maxdepth 1 -name 'site.part.*' | wc -l)
  for piece in "$dir"/site.part.*; do
    i=$((i + 1))
    mkdir -p ".vllm-moe.part$i" && cp "$piece" "$dir/setup.sh" ".vllm-moe.part$i/" && echo "$n $sum" >".vllm-moe.part$i/SPLIT"
  done
  echo "carry .vllm-moe.part1 .. .vllm-moe.part$n, one per call to the same warm machine (sha256 $sum)"
}

moe_bundle() {  # the MoE bundle unpacked to $SITE once every carried piece is on this machine
  local dir=/tmp/vllm-moe total sum have
  [[ -f $SITE/.ok && -f $SITE/vllm/_moe_C_stable_libtorch.abi3.so ]] && return 0
  mkdir -p $dir
  for part in .vllm-moe.part*/; do
    if [[ -d $part ]]; then cp "$part"* $dir/; fi
  done
  [[ -f $dir/SPLIT ]] || { echo "no piece of the MoE bundle: carry .vllm-moe.part1 (run.sh pack)" >&2 && return 1; }
  read -r total sum <$dir/SPLIT
  have=$(find $dir -maxdepth 1 -name 'site.part.*' | wc -l)
  [[ $have -ge $total ]] || { echo "$have of $total pieces of the MoE bundle here; carry the next" >&2 && return 1; }
  cat $dir/site.part.* >$dir/site.tar.xz
  [[ $(sha256sum $dir/site.tar.xz | cut -d' ' -f1) == "$sum" ]] || { echo "the pieces do not add up (sha256)" >&2 && return 1; }
  rm -rf "$SITE" # a dense bundle unpacked before has no MoE kernels
  # shellcheck source=/dev/null
  . $dir/setup.sh
}

built() {  # built NAME OVERRIDE...: model=gpu_small (with the overrides) prepared and SFT-warmed under $O/NAME
  local name=$1
  shift
  step $O/$name/model python -m asyncrl prepare data_dir=$O/data "${TASK[@]}" model=gpu_small "$@" \
    model.name=$O/$name/model "${GPU[@]}"
  step $O/$name/sft/model python -m asyncrl sft data_dir=$O/data "${TASK[@]}" model=gpu_small "$@" \
    model.name=$O/$name/model sft.run_dir=$O/$name/sft sft.max_steps=150 sft.optim.lr=2e-3 "${GPU[@]}"
}

rl() {  # rl NAME ARM OVERRIDE...: RL from $O/NAME's SFT model into $O/NAME/ARM
  local name=$1 arm=$2
  shift 2
  step $O/$name/$arm/model python -m asyncrl rl data_dir=$O/data "${TASK[@]}" model=gpu_small \
    model.name=$O/$name/sft/model run_dir=$O/$name/$arm "${GPU[@]}" "${RL[@]}" "$@"
}

stage=${1:-}
case $stage in
  pack) pack "${2:-}" && exit 0 ;;
  truncation | moe | moe_nccl | tests | collect) ;;
  *) echo "usage: $0 pack BUNDLE_DIR | truncation | moe | moe_nccl | tests | collect" >&2 && exit 2 ;;
esac
if [[ $stage != collect ]]; then
  moe_bundle
  set +e # device_env.sh is written for scripts that go on past a failed command
  # shellcheck source=benchmarks/device_env.sh
  . benchmarks/device_env.sh
  set -e
fi
. benchmarks/pipeline_steps.sh
mkdir -p $O
case $stage in
  truncation)
    built dense
    cut=(orchestrator.top_p=0.9 max_steps=20 async_level=1 trainer.optim.lr=3e-4)
    rl dense top_p_exact "${cut[@]}"
    rl dense top_p_full "${cut[@]}" trainer.loss.truncated_logprobs=false
    ;;
  moe)
    built moe "${MOE[@]}"
    routed=(orchestrator.routed_experts=true max_steps=20 async_level=1 trainer.optim.lr=3e-4)
    rl moe replay "${routed[@]}" trainer.router_replay=true
    rl moe no_replay "${routed[@]}" trainer.router_replay=false
    ;;
  moe_nccl)
    built moe "${MOE[@]}"
    rl moe nccl max_steps=20 async_level=1 trainer.optim.lr=3e-4 weights.transport=nccl "inference.gpus=['0']" \
      trainer.fabric.gpus=1
    ;;
  tests)
    ASYNCRL_GPU_REPORT=${OUT:-$O}/gpu_tests.jsonl python -m pytest -p no:cacheprovider -m gpu -q \
      tests/gpu/test_moe_vllm.py tests/gpu/test_truncated_sampling.py --passed-file "$GPU_PASSED"
    ;;
  collect)
    files=$(cd $O && ls -d ./*/*/metrics/*.jsonl ./*/*/metrics/summary.json ./*/*/configs/config.yaml 2>/dev/null || true)
    # shellcheck disable=SC2086  # the file list is words
    tar -czf "${OUT:-$O}/moe_and_truncation.tar.gz" -C $O $files && tar -tzf "${OUT:-$O}/moe_and_truncation.tar.gz"
    ;;
esac
