# shellcheck shell=bash
# Source from the repository root on the lent, offline GPU machine: `. benchmarks/device_env.sh`.
# Sets up what the GPU tests and benchmarks need there, once per machine (later calls to the same warm machine
# reuse it; nothing of it is committed):
#   - vLLM from the bundle that ../shared/tools/offline-vllm/build.sh makes, carried as .vllm/ (unpacked to
#     /tmp/site). A later call may leave .vllm/ out of `carry` once /tmp/site is unpacked;
#   - vLLM's MoE kernels carried as .vllm-moe/ (benchmarks/device_moe_kernels.sh), put into the unpacked bundle;
#   - extra wheels carried as .whl/ or .whl-NAME/ (e.g. verifiers' dependency closure, pytest), installed to
#     /tmp/extra (flash-attn-4's to /tmp/extra-trainer), or split into .whl-NAME.part1/, .part2/, ... carried one
#     per call (flash-attn-4, SmolLM2), installed once all are here;
#   - asyncrl's entry point for vLLM's plugin loader (vLLM finds general plugins among installed
#     distributions): a dist-info next to the bundle, as `pip install -e .` would make;
#   - PYTHONPATH: the bundle, the extras, src/ and the environments; TRAINER_PYTHON: an interpreter without vLLM;
#   - GPU_PASSED: the file of GPU tests passed in earlier calls with the same code (benchmarks/gpu_suite.sh);
#   - Qwen3's tokenizer for the shapes' models, carried as .tokenizers/qwen3.tar.xz (1.4 MB: `tar -C
#     ~/.cache/asyncrl/tokenizers -cJf .tokenizers/qwen3.tar.xz qwen3` after `python -m asyncrl.models.qwen_tokenizer`),
#     unpacked to /tmp/tokenizers for this and later calls.
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
# vLLM's MoE kernels, carried apart as .vllm-moe/ (benchmarks/device_moe_kernels.sh), into the unpacked bundle
moe=vllm/_moe_C_stable_libtorch.abi3.so
if [ -f ".vllm-moe/${moe#vllm/}.xz" ] && [ -f "$SITE/.ok" ] && [ ! -f "$SITE/$moe" ]; then
  if (cd .vllm-moe && sha256sum -c --quiet SHA256SUMS); then
    xz -dc ".vllm-moe/${moe#vllm/}.xz" >"$SITE/$moe.tmp" && mv "$SITE/$moe.tmp" "$SITE/$moe" &&
      echo "device_env: vLLM's MoE kernels installed" >&2
  else
    echo "device_env: .vllm-moe does not match its SHA256SUMS; run benchmarks/device_moe_kernels.sh again" >&2
  fi
fi
# where a wheel set goes: flash-attn-4's to /tmp/extra-trainer, on the trainer's path only (TRAINER_PYTHON below): its
# newer nvidia-cutlass-dsl, cuda-bindings and apache-tvm-ffi beside vLLM make the sidecar's engine fail to start
# ("Cannot re-initialize CUDA in forked subprocess"); every other set to /tmp/extra, on every process's path
extra_dir() { case $1 in *fa4*) echo /tmp/extra-trainer ;; *) echo /tmp/extra ;; esac; }
for d in .whl*/; do # wheel sets carried whole (benchmarks/device_wheels.sh [-o .whl-NAME]), installed once each
  if ls "$d"*.whl >/dev/null 2>&1; then
    to=$(extra_dir "${d%/}") && mkdir -p "$to"
    have=$(find "$d" -maxdepth 1 -name '*.whl' -printf '%f %s\n' | sort | md5sum | cut -d' ' -f1) && mark=$to/.installed-${d%/}
    [ "$(cat "$mark" 2>/dev/null)" = "$have" ] && continue
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$to" "$d"*.whl \
      2>&1 | grep -v -i "warning" || true
    echo "$have" >"$mark"
  fi
done
# a wheel set too large for one call arrives in pieces, one DIR.partN per call (benchmarks/device_wheels.sh), kept in
# /tmp/whlparts/NAME until all are here
for part in .whl*.part*/; do
  [ -f "$part/SPLIT" ] || continue
  read -r _ sum name <"$part/SPLIT"
  # a set rebuilt since (another sum) starts over: its old pieces and install mark go
  old= && [ ! -f "/tmp/whlparts/$name/SPLIT" ] || read -r _ old _ <"/tmp/whlparts/$name/SPLIT"
  [ -z "$old" ] || [ "$old" = "$sum" ] || rm -rf "/tmp/whlparts/$name"
  mkdir -p "/tmp/whlparts/$name" && cp "$part"/part.* "$part/SPLIT" "/tmp/whlparts/$name/"
done
for set in /tmp/whlparts/*/; do
  [ -f "$set/SPLIT" ] && [ ! -f "$set/.installed" ] || continue
  read -r total sum name <"$set/SPLIT"
  have=$(find "$set" -maxdepth 1 -name 'part.*' | wc -l)
  if [ "$have" -lt "$total" ]; then
    echo "device_env: $have of $total pieces of $name here; carry the next .$name.partN to this machine" >&2
  elif [ "$(cat "$set"/part.* | sha256sum | cut -d' ' -f1)" != "$sum" ]; then
    echo "device_env: the pieces of $name do not add up to the tar device_wheels.sh split (sha256)" >&2
  else
    to=$(extra_dir "$name") && mkdir -p "$set/wheels" "$to"
    if cat "$set"/part.* | tar -x -C "$set/wheels" &&
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$to" \
        "$set"/wheels/*.whl >"$set/pip.log" 2>&1; then
      touch "$set/.installed" && echo "device_env: installed $name ($total pieces)" >&2
    else
      echo "device_env: installing $name failed:" >&2 && tail -5 "$set/pip.log" >&2
    fi
  fi
done
dist=$SITE/asyncrl-0.1.0.dist-info
if [ -d "$SITE" ] && [ ! -f "$dist/entry_points.txt" ]; then
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: asyncrl\nVersion: 0.1.0\n' >"$dist/METADATA"
  # the entry point of pyproject.toml's [project.entry-points."vllm.general_plugins"]
  printf '[vllm.general_plugins]\nasyncrl_bitwise = asyncrl.inference.vllm.plugin:register\n' >"$dist/entry_points.txt"
fi
# the GPU tests that passed in earlier calls to this machine (tests/helpers/suite_budget.py's --passed-file), for the code
# they ran: a call with other code (src, tests, configs, environments, benchmarks, pyproject.toml) starts it over;
# measurements (benchmarks/results/) are not code, so committing a call's figures keeps the list
if [ -f .tokenizers/qwen3.tar.xz ]; then
  rm -rf /tmp/tokenizers/qwen3 && mkdir -p /tmp/tokenizers && tar -C /tmp/tokenizers -xJf .tokenizers/qwen3.tar.xz
fi
[ ! -f /tmp/tokenizers/qwen3/tokenizer.json ] || export ASYNCRL_TOKENIZERS=/tmp/tokenizers
export GPU_PASSED=$PWD/outputs/gpu_suite/passed.txt
mkdir -p outputs/gpu_suite
code=$( (find src tests conf environments benchmarks -type f -not -path '*/__pycache__/*' \
  -not -path 'benchmarks/results/*' -print0 &&
  printf '%s\0' pyproject.toml) | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
if [ "$(cat outputs/gpu_suite/code 2>/dev/null)" != "$code" ]; then
  rm -f "$GPU_PASSED" && echo "$code" >outputs/gpu_suite/code
fi
envs=$(find "$PWD/environments" -mindepth 1 -maxdepth 1 -type d -printf '%p:')  # each environment package
export PYTHONPATH=$PWD/src:$PWD/tests:$envs${PYTHONPATH:-}:/tmp/extra
# a wheel's .pth file runs only in a site dir, and /tmp/extra is a PYTHONPATH entry: nvidia-cutlass-dsl (flash-attn-4)
# puts its `cutlass` package on sys.path from one. Run them once (site.addsitedir) and keep the paths they added.
pth_of() { # the paths a site dir's .pth files add
  compgen -G "$1/*.pth" >/dev/null || return 0
  python3 -c 'import site, sys; before = set(sys.path); site.addsitedir(sys.argv[1])
print(":".join(p for p in sys.path if p not in before and p != sys.argv[1]))' "$1" || true
}
pth_paths=$(pth_of /tmp/extra)
[ -z "$pth_paths" ] || export PYTHONPATH=$PYTHONPATH:$pth_paths
trainer_paths=$(pth_of /tmp/extra-trainer)
# the extras (the trainer's first) and their .pth paths, for a trainer-only script that must put them before the vLLM
# bundle (gpu_attention.sh)
export EXTRA_PATHS=/tmp/extra-trainer${trainer_paths:+:$trainer_paths}:/tmp/extra${pth_paths:+:$pth_paths}
export PYTHONUNBUFFERED=1
# the trainer's own environment, as `launcher.trainer_python` runs it (docs/gpus.md, `make trainer-venv`): the extras
# first (flash-attn-4's newer nvidia-cutlass-dsl and apache-tvm-ffi), then the bundle's packages but vLLM's: an
# interpreter that cannot import vllm, like the trainer image. `asyncrl rl launcher.trainer_python=$TRAINER_PYTHON`.
if [ -f "$SITE/.ok" ]; then
  mkdir -p /tmp/site-trainer
  for p in "$SITE"/*; do
    case ${p##*/} in vllm | vllm-* | asyncrl-*) ;; *) ln -sfn "$p" /tmp/site-trainer/ ;; esac
  done
  printf '#!/bin/sh\nPYTHONPATH=%s exec python3 "$@"\n' "$PWD/src:$PWD/tests:$envs$EXTRA_PATHS:/tmp/site-trainer" \
    >/tmp/trainer-python && chmod +x /tmp/trainer-python && export TRAINER_PYTHON=/tmp/trainer-python
fi
set +u
