#!/usr/bin/env bash
# On a lent GPU machine: weight updates trainer -> vLLM (asyncrl's direct load against vLLM's
# layerwise reload and against files), and the tests of each transport. Carry .vllm (the bundle) and .whl
# (benchmarks/device_wheels.sh tools) with the first call; later calls to the same warm machine need neither.
#   bash benchmarks/gpu_transfer.sh small   # two GPUs, NCCL: the Qwen3-0.6B shape (about 3 min), then the 2-GPU
#                                           # tests (about 5); the trainer on GPU 1, the sidecar on GPU 0
#   bash benchmarks/gpu_transfer.sh 4b      # two GPUs, NCCL: the Qwen3-4B shape (about 6 min)
#   bash benchmarks/gpu_transfer.sh ipc     # one GPU (GPU 0), CUDA IPC: the Qwen3-0.6B shape, then the ipc tests
# Results and logs go under $OUT (or ./gpu_out).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
case "${1:-}" in small | 4b | ipc) ;; *) echo "usage: $0 small|4b|ipc" >&2 && exit 2 ;; esac
# shellcheck source=benchmarks/device_env.sh
. benchmarks/device_env.sh
out=${OUT:-gpu_out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
quiet() { grep -v -E "^(INFO|WARNING|DEBUG|\(EngineCore)|Writing model|Loading weights"; }
if [ "$1" = ipc ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 python benchmarks/weight_transfer.py --transport ipc --shape 0.6b --repeats 5 \
    --out "$out/weight_transfer_ipc.json" 2>&1 | tee "$out/weight_transfer_ipc.log" | quiet | tail -25
  CUDA_VISIBLE_DEVICES=0 ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl timeout 270 python -m pytest -p no:cacheprovider \
    -m gpu tests/gpu/test_gpu.py -k ipc_transport -q \
    --passed-file "$GPU_PASSED" 2>&1 | tail -6
  exit 0
fi
shape=$([ "$1" = 4b ] && echo 4b || echo 0.6b)
CUDA_VISIBLE_DEVICES=1 timeout 560 python benchmarks/weight_transfer.py --sidecar-gpu 0 --shape "$shape" \
  --repeats "$([ "$1" = 4b ] && echo 3 || echo 5)" --out "$out/weight_transfer_$shape.json" 2>&1 \
  | tee "$out/weight_transfer_$shape.log" | quiet | tail -25
if [ "$1" = small ]; then
  ASYNCRL_GPU_REPORT=$out/gpu_tests.jsonl timeout 330 python -m pytest -p no:cacheprovider -m gpu \
    tests/gpu/test_gpu.py -k "two_gpus" -q 2>&1 | tail -6
fi
