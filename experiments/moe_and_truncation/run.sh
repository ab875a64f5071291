#!/usr/bin/env bash
# Truncated sampling and a mixture of experts with the vLLM sidecar (README.md here), stage by stage, each under one
# lent-GPU call (10 minutes); a stage whose output exists is skipped (benchmarks/pipeline_steps.sh).
#   run.sh truncation        # gpu_small, SFT, then RL at top_p 0.9: exact ratios, and the full-distribution ones
#   run.sh moe               # the GPU Qwen3-MoE, SFT, then RL with vLLM's routes: router replay on, and off
#   run.sh moe_nccl          # (2 GPUs) the same MoE's RL with its experts broadcast over NCCL
#   run.sh all               # (4 GPUs) the three above side by side
#   run.sh tests             # the GPU tests of both features (tests/gpu/test_moe_vllm.py, test_truncated_sampling.py)
#   run.sh collect           # $OUT/moe_and_truncation.tar.gz: every run's metrics and configs
# The MoE stages need vLLM's MoE kernels, which the offline bundle leaves out: carry .vllm-moe
# (benchmarks/device_moe_kernels.sh) to a machine that unpacked the bundle; benchmarks/device_env.sh installs them.
# VLLM_ENABLE_V1_MULTIPROCESSING=0 runs vLLM's engine in-process (the bundle's README saw a MoE engine hang in the
# default multiprocess mode once).
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$0")/../.."
O=outputs/moe_and_truncation
# the tests' GPU models and task (tests/gpu/conftest.py, tests/helpers/launch.py SMALL_TASK)
TASK=(env.reverse_text.args.min_len=3 env.reverse_text.args.max_len=6 env.reverse_text.args.num_train=2000
  env.reverse_text.args.num_eval=24 seq_len=512)
GPU=(trainer.fabric.accelerator=cuda trainer.fabric.precision=bf16-mixed trainer.fabric.num_threads=0)
MOE=(model.init.architecture=Qwen3MoeForCausalLM model.init.num_experts=8 model.init.num_experts_per_tok=2
  model.init.moe_intermediate_size=256 model.init.norm_topk_prob=true)
RL=(inference.backend=vllm inference.vllm.enforce_eager=true inference.vllm.gpu_memory_utilization=0.3
  orchestrator.max_tokens=10 orchestrator.prompts_per_step=16 orchestrator.group_size=16 launcher.progress=false
  launcher.overwrite=true)

gpu_env() {  # the bundle, vLLM's MoE kernels (.vllm-moe, carried with this or an earlier call) and the rest
  set +e # device_env.sh is written for scripts that go on past a failed command
  # shellcheck source=benchmarks/device_env.sh
  . benchmarks/device_env.sh
  set -e
  [[ -f $SITE/vllm/_moe_C_stable_libtorch.abi3.so ]] || [[ $stage == truncation ]] ||
    { echo "no MoE kernels in $SITE: carry .vllm-moe (benchmarks/device_moe_kernels.sh)" >&2 && return 1; }
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
  truncation | moe | moe_nccl | all | tests) gpu_env ;;
  collect) ;;
  *) echo "usage: $0 truncation | moe | moe_nccl | all | tests | collect" >&2 && exit 2 ;;
esac
. benchmarks/pipeline_steps.sh
mkdir -p $O
case $stage in
  truncation)
    built dense
    cut=(orchestrator.top_p=0.9 max_steps=20 async_level=1 trainer.optim.lr=3e-4)
    rl dense top_p_exact "${cut[@]}" & a=$!
    rl dense top_p_full "${cut[@]}" trainer.loss.truncated_logprobs=false & b=$!
    wait $a && wait $b
    ;;
  moe)
    built moe "${MOE[@]}"
    routed=(orchestrator.routed_experts=true max_steps=20 async_level=1 trainer.optim.lr=3e-4)
    rl moe replay "${routed[@]}" trainer.router_replay=true & a=$!
    rl moe no_replay "${routed[@]}" trainer.router_replay=false & b=$!
    wait $a && wait $b
    ;;
  moe_nccl)
    built moe "${MOE[@]}"
    rl moe nccl max_steps=20 async_level=1 trainer.optim.lr=3e-4 weights.transport=nccl "inference.gpus=['0']" \
      trainer.fabric.gpus=1
    ;;
  all) # four GPUs: each arm its own run, two runs to a GPU (vLLM takes 30% of it); the NCCL run on GPUs 2-3
    mkdir -p $O/logs
    (CUDA_VISIBLE_DEVICES=0 "$self" truncation >$O/logs/truncation.log 2>&1; echo "truncation: exit $?") &
    (CUDA_VISIBLE_DEVICES=1 "$self" moe >$O/logs/moe.log 2>&1; echo "moe: exit $?") &
    (for _ in $(seq 120); do [[ -d $O/moe/sft/model ]] && break || sleep 5; done # built by the moe stage
    CUDA_VISIBLE_DEVICES=2,3 "$self" moe_nccl >$O/logs/moe_nccl.log 2>&1; echo "moe_nccl: exit $?") &
    wait
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
