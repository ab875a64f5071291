# shellcheck shell=bash
# The sixth session's device calls 3 and 4 (benchmarks/results/2026-11-27-gpu.md), as run from the repository root
# on a lent nvidia-h100-x4: call 3 carrying .vllm and .whl, call 4 (same warm machine) carrying .vllm-moe.
call3() {
  # call 1: the truncation tests on GPUs 0-1, the truncation experiment on GPU 2, the ops probe on GPU 3
  . benchmarks/device_env.sh >/dev/null 2>&1
  export ASYNCRL_GPU_SETUP_DIR=/tmp/gpu_lanes/setup-x
  t() { CUDA_VISIBLE_DEVICES=$1 ASYNCRL_GPU_REPORT=$OUT/gpu_tests.jsonl timeout $2 python -m pytest -p no:cacheprovider -m gpu -q -rA --basetemp /tmp/t$1 "$3" > $OUT/pytest_$1.log 2>&1; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/pytest_$1.log | sed "s/^/[gpu$1] /" | cut -c1-200; }
  t 0 230 tests/gpu/test_truncated_sampling.py::test_bitwise_mode_holds_under_top_p &
  t 1 230 tests/gpu/test_truncated_sampling.py::test_exact_ratios_under_truncation_against_the_biased_ones &
  (CUDA_VISIBLE_DEVICES=2 timeout -s INT 225 bash experiments/moe_and_truncation/run.sh truncation > $OUT/truncation.log 2>&1; echo "truncation stage exit $?") &
  (CUDA_VISIBLE_DEVICES=3 timeout 200 python benchmarks/bitwise_probe.py --ops --variants eager --prompts 8 --n 4 --out $OUT/probe_dense.json > $OUT/probe_dense.log 2>&1; echo "probe exit $?"; grep -E "^ops|trainer|equal" $OUT/probe_dense.log | cut -c1-600) &
  wait
  OUT=$OUT bash experiments/moe_and_truncation/run.sh collect > /dev/null 2>&1; ls $OUT
  grep -h RESULT $OUT/pytest_*.log | cut -c1-300
}
call4() {
  . benchmarks/device_env.sh >/dev/null 2>&1
  export ASYNCRL_GPU_SETUP_DIR=/tmp/gpu_lanes/setup-x VLLM_ENABLE_V1_MULTIPROCESSING=0
  (CUDA_VISIBLE_DEVICES=0 ASYNCRL_GPU_REPORT=$OUT/gpu_tests.jsonl timeout 250 python -m pytest -p no:cacheprovider -m gpu -q -rA --basetemp /tmp/t0 "tests/gpu/test_moe_vllm.py::test_router_replay_with_vllms_routes[False]" > $OUT/pytest_0.log 2>&1; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/pytest_0.log | cut -c1-200) &
  (CUDA_VISIBLE_DEVICES=1 timeout 250 python benchmarks/bitwise_probe.py --ops --variants eager --prompts 8 --n 4 --init model=gpu_small model.init.architecture=Qwen3MoeForCausalLM model.init.num_experts=8 model.init.num_experts_per_tok=2 model.init.moe_intermediate_size=256 model.init.norm_topk_prob=true --out $OUT/probe_moe.json > $OUT/probe_moe.log 2>&1; echo "probe exit $?"; grep -E "^ops|eager" $OUT/probe_moe.log | cut -c1-900; grep -o "'moe[^]]*" $OUT/probe_moe.log | head -3) &
  (CUDA_VISIBLE_DEVICES=2 timeout -s INT 245 bash experiments/moe_and_truncation/run.sh moe > $OUT/moe.log 2>&1; echo "moe stage exit $?") &
  wait
  OUT=$OUT bash experiments/moe_and_truncation/run.sh collect > /dev/null 2>&1
  grep -h RESULT $OUT/pytest_*.log | cut -c1-300
}
"$1"
