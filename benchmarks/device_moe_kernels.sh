#!/usr/bin/env bash
# vLLM's mixture-of-experts kernels for the lent GPU machine, as .vllm-moe/ (git-ignored): the offline bundle
# (../shared/tools/offline-vllm/build.sh) leaves out vllm/_moe_C_stable_libtorch.abi3.so to fit one call's carry,
# and MoE models need it. This takes that one library from the same vLLM wheel, keeps its sm_90 machine code and
# PTX (the bundle's fatbin.py, as KEEP_MOE=1 does), and xz-packs it (about 14 MB). Carry .vllm-moe with a call to a
# machine that already unpacked the bundle (the bundle and it together pass 64 MiB); benchmarks/device_env.sh puts
# the library into the unpacked bundle.
#   benchmarks/device_moe_kernels.sh [VLLM_WHEEL]   # default: the wheel build.sh cached
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${OFFLINE_VLLM:-../shared/tools/offline-vllm}
wheel=${1:-$(ls "${WHEELS:-$HOME/.cache/offline-vllm/wheels}"/vllm-0.26.0-*.whl)}
lib=vllm/_moe_C_stable_libtorch.abi3.so
tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
unzip -q -o "$wheel" "$lib" -d "$tmp"
python3 -m pip install -q --target "$tmp/py" pyelftools==0.32
PYTHONPATH=$tmp/py python3 "$tools/fatbin.py" "$tmp/$lib" "$tmp/moe.so" >/dev/null
rm -rf .vllm-moe && mkdir .vllm-moe
xz -9 -T0 -c "$tmp/moe.so" >.vllm-moe/_moe_C_stable_libtorch.abi3.so.xz
(cd .vllm-moe && sha256sum ./*.xz >SHA256SUMS)
du -sh .vllm-moe
