# shellcheck shell=bash
# Source from the repository root on the lent, offline GPU machine: `. benchmarks/device_env.sh`.
# Sets up what the GPU tests and benchmarks need there, once per machine (later calls to the same warm machine
# reuse it; nothing of it is committed):
#   - vLLM from the bundle that ../shared/tools/offline-vllm/build.sh makes, carried as .vllm/ (unpacked to
#     /tmp/site). A later call may leave .vllm/ out of `carry` once /tmp/site is unpacked;
#   - extra wheels carried as .whl/ (e.g. verifiers' dependency closure, pytest), installed to /tmp/extra, or
#     split into .whlpart1/, .whlpart2/, ... carried one per call (flash-attn-4), installed once all are here;
#   - asyncrl's entry point for vLLM's plugin loader (vLLM finds general plugins among installed
#     distributions): a dist-info next to the bundle, as `pip install -e .` would make;
#   - PYTHONPATH: the bundle, the extras, src/ and the environments.
set -u
export SITE=${SITE:-/tmp/site}
if [ -f .vllm/setup.sh ]; then
  # shellcheck source=/dev/null
  . .vllm/setup.sh
elif [ -f "$SITE/.ok" ]; then # .vllm/setup.sh's exports, for a call that did not carry the bundle again
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
  export VLLM_USE_FLASHINFER_SAMPLER=0
else
  echo "device_env: no vLLM bundle (.vllm/) and none unpacked at $SITE" >&2
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  mkdir -p /tmp/extra
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/extra .whl/*.whl \
    2>&1 | grep -v -i "warning" || true
fi
# a wheel set too large for one call arrives in pieces, one .whlpartN per call (benchmarks/device_wheels.sh)
for part in .whlpart*/; do
  [ -f "$part/SPLIT" ] && mkdir -p /tmp/whlparts && cp "$part"/part.* "$part/SPLIT" /tmp/whlparts/
done
if [ -f /tmp/whlparts/SPLIT ] && [ ! -f /tmp/whlparts/.installed ]; then
  read -r total sum </tmp/whlparts/SPLIT
  have=$(find /tmp/whlparts -name 'part.*' | wc -l)
  if [ "$have" -lt "$total" ]; then
    echo "device_env: $have of $total wheel pieces here; carry the next .whlpartN to this machine" >&2
  elif [ "$(cat /tmp/whlparts/part.* | sha256sum | cut -d' ' -f1)" != "$sum" ]; then
    echo "device_env: the wheel pieces do not add up to the tar device_wheels.sh split (sha256)" >&2
  else
    mkdir -p /tmp/whlparts/wheels /tmp/extra
    if cat /tmp/whlparts/part.* | tar -x -C /tmp/whlparts/wheels &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/extra \
        /tmp/whlparts/wheels/*.whl >/tmp/whlparts/pip.log 2>&1; then
      touch /tmp/whlparts/.installed
    else
      echo "device_env: installing the pieced wheels failed:" >&2 && tail -5 /tmp/whlparts/pip.log >&2
    fi
  fi
fi
dist=$SITE/asyncrl-0.1.0.dist-info
if [ -d "$SITE" ] && [ ! -f "$dist/entry_points.txt" ]; then
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: asyncrl\nVersion: 0.1.0\n' >"$dist/METADATA"
  # the entry point of pyproject.toml's [project.entry-points."vllm.general_plugins"]
  printf '[vllm.general_plugins]\nasyncrl_bitwise = asyncrl.inference.vllm_plugin:register\n' >"$dist/entry_points.txt"
fi
export PYTHONPATH=$PWD/src:$PWD/tests:$PWD/environments/reverse_text:$PWD/environments/calculator:${PYTHONPATH:-}:/tmp/extra
export PYTHONUNBUFFERED=1
set +u
