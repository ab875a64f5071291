#!/usr/bin/env bash
# The one install recipe of asyncrl. The Dockerfile's stages RUN it, and `make install` runs it outside
# Docker (target dev), so every CI run exercises the image's install steps; tests/static checks the rest.
#
#   docker/install.sh TARGET [PHASE]
#
#   TARGET  cpu               torch (CPU build) + asyncrl
#           dev               cpu + the `dev` extra (pytest and the Dockerfile/compose/devcontainer checkers)
#           gpu               asyncrl + the `gpu` extra: vLLM (which pins torch, CUDA 13); flash-attn 2 with FLASH_ATTN=1
#           trainer           asyncrl + the `trainer` extra (flash-attn-4) + the gpu target's torch, no vLLM: the
#                             trainer's own environment (launcher.trainer_python), as vLLM's pins exclude flash-attn-4's
#           source-wheels     build the wheels of the dependencies that ship only as source (docker/source-only.txt)
#                             into $SOURCE_WHEELS (needs a C compiler: the Dockerfile's builder stages)
#           flash-attn-wheel  build flash-attn's wheel into $FLASH_ATTN_WHEELS (needs nvcc: the Dockerfile's
#                             flash-attn stage), against the torch that vLLM pins
#   PHASE   deps              everything asyncrl needs but not asyncrl (a Docker layer that survives source edits)
#           project           asyncrl itself, without dependencies (needs src/), then `pip check`
#           all               both (default)
#           requirements      print what `deps` installs, one requirement a line (docker/lock.py locks it)
#
# Environment:
#   PYTHON              interpreter whose environment receives the packages (default: python3 on PATH)
#   ASYNCRL_EDITABLE=1  install asyncrl in editable mode (make install, the devcontainer)
#   TORCH_INDEX_URL     index that the CPU torch comes from (the Dockerfile: PyTorch's CPU index). Unset, pip's
#                       own configuration decides: on this project's machines a local CPU wheel; elsewhere
#                       PyPI's build of torch, which is the CUDA one (several GB)
#   SOURCE_WHEELS       cpu, dev, gpu, trainer: directory of the wheels that source-wheels built; set, every package is
#                       installed from a wheel (--only-binary :all:), so an image never needs a compiler.
#                       docker/locks/ says which dependencies ship only as source (tests/static checks it)
#   FLASH_ATTN=1        gpu: add flash-attn 2 (model.attn_implementation=flash_attention_2) from FLASH_ATTN_WHEELS.
#                       Off by default: the trainer's default attention, torch's varlen kernel, is flash-attn 2's
#                       kernel as torch builds it in, and the wheel takes ~30 minutes to build
#   FLASH_ATTN_WHEELS   gpu, flash-attn-wheel: directory of the flash-attn wheel
#   MAX_JOBS, FLASH_ATTN_CUDA_ARCHS, NVCC_THREADS   flash-attn-wheel: parallel compile jobs (each takes several GB
#                       of memory), GPU architectures (90 = H100/H200), nvcc threads per job
#   DRY_RUN=1           print the commands instead of running them
set -euo pipefail

# -- pins: the only place that names torch and flash-attn versions ------------------------------------
TORCH_CPU=2.13.0               # CPU build: CI, the cpu and dev images
TORCH_GPU=2.11.0               # what the gpu extra's vllm==0.26.0 pins (checked after the install); trainer's too
FLASH_ATTN_VERSION=2.8.3.post2 # no wheel on PyPI for torch 2.11 + CUDA 13: built from source
FLASH_ATTN_BUILD_DEPS=(ninja==1.13.2 packaging==26.3 psutil==7.2.2 setuptools==80.10.2 wheel==0.48.0)

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
TARGET=${1:-}
PHASE=${2:-all}

usage() {
  sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  exit 2
}

case "$TARGET" in cpu | dev | gpu | trainer | source-wheels | flash-attn-wheel) ;; *) usage ;; esac
case "$PHASE" in deps | project | all | requirements) ;; *) usage ;; esac

run() {  # every command goes through here, so DRY_RUN shows exactly what would run
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

pip() { run "$PY" -m pip "$@"; }

# With SOURCE_WHEELS: wheels only, those of the source-only dependencies from the builder stage's directory
binary_only() {
  if [[ -n "${SOURCE_WHEELS:-}" ]]; then echo --find-links "$SOURCE_WHEELS" --only-binary :all:; fi
}

# Requirements from pyproject.toml (one place for asyncrl's pins): the build backend, the dependencies and the given
# extras. The build backend because the project phase builds asyncrl with it, without build isolation (on Python
# 3.12 torch depends on setuptools as well; on 3.11 nothing else brings one new enough).
requirements() {
  "$PY" - "$ROOT/pyproject.toml" "$@" <<'PY'
import sys, tomllib
pyproject = tomllib.load(open(sys.argv[1], "rb"))
project = pyproject["project"]
extras, self_ref = project["optional-dependencies"], project["name"] + "["

def expand(extra):  # an extra may name others of this project, e.g. dev = [..., "asyncrl[notebooks]"]
    for r in extras[extra]:
        if r.startswith(self_ref):
            for e in r[len(self_ref):].rstrip("]").split(","):
                yield from expand(e.strip())
        else:
            yield r

reqs = pyproject["build-system"]["requires"] + list(project["dependencies"])
for extra in sys.argv[2:]:
    reqs += expand(extra)
print("\n".join(dict.fromkeys(reqs)))
PY
}

deps() {
  pip install -U "pip>=25"
  local reqs
  case "$TARGET" in
    cpu | dev)
      # torch first and on its own: left to the resolver, an unpinned torch is PyPI's multi-GB CUDA build
      if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
        pip install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_CPU"
      else
        pip install "torch==$TORCH_CPU"
      fi
      if [[ "$TARGET" == dev ]]; then mapfile -t reqs < <(requirements dev); else mapfile -t reqs < <(requirements); fi
      # shellcheck disable=SC2046  # binary_only's words are separate arguments
      pip install $(binary_only) "${reqs[@]}"
      ;;
    gpu)
      mapfile -t reqs < <(requirements gpu)
      if [[ "${FLASH_ATTN:-0}" == 0 ]]; then
        # shellcheck disable=SC2046  # binary_only's words are separate arguments
        pip install $(binary_only) "${reqs[@]}"
      else
        # the wheel built by the gpu-wheels stage; never PyPI's sdist (its build needs torch and nvcc)
        # shellcheck disable=SC2046  # binary_only's words are separate arguments
        pip install $(binary_only) --find-links "${FLASH_ATTN_WHEELS:?FLASH_ATTN_WHEELS must name the directory of the flash-attn wheel (or leave FLASH_ATTN unset)}" \
          --only-binary flash-attn "${reqs[@]}" "flash-attn==$FLASH_ATTN_VERSION"
      fi
      run "$PY" - "$TORCH_GPU" <<'PY'
import sys, torch
have = torch.__version__.split("+")[0]
if have != sys.argv[1]:
    sys.exit(f"torch {have} was installed, but flash-attn is built against TORCH_GPU={sys.argv[1]}: "
             "update the pin in docker/install.sh")
PY
      ;;
    trainer)
      mapfile -t reqs < <(image_requirements)
      # shellcheck disable=SC2046  # binary_only's words are separate arguments
      pip install $(binary_only) "${reqs[@]}"
      # pip's configuration may name a CPU index (TORCH_INDEX_URL's, say): its torch 2.11 runs no flash-attn-4
      run "$PY" - <<'PY'
import sys, torch
if torch.version.cuda is None:
    sys.exit(f"torch {torch.__version__} is a CPU build: the trainer's environment needs PyPI's CUDA one")
PY
      ;;
    source-wheels)
      pip wheel --no-deps --wheel-dir "${SOURCE_WHEELS:?SOURCE_WHEELS must name the output directory}" \
        -r "$ROOT/docker/source-only.txt"
      ;;
    flash-attn-wheel)
      pip install "torch==$TORCH_GPU" "${FLASH_ATTN_BUILD_DEPS[@]}"
      # FORCE_BUILD: setup.py would first look for a prebuilt wheel on GitHub; there is none for this combination
      run env FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-4}" NVCC_THREADS="${NVCC_THREADS:-2}" \
        FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}" \
        "$PY" -m pip wheel --no-build-isolation --no-deps \
        --wheel-dir "${FLASH_ATTN_WHEELS:?FLASH_ATTN_WHEELS must name the output directory}" "flash-attn==$FLASH_ATTN_VERSION"
      ;;
  esac
}

project() {
  [[ "$TARGET" == flash-attn-wheel || "$TARGET" == source-wheels ]] && return 0
  # asyncrl and the shipped environments (environments/*/: verifiers tasksets found by their id, agent programs by
  # import path) in one pip call, built with the build backend that deps installed (pyproject.toml's build-system;
  # every image's lock pins it), not in a build environment per package that fetches the newest: this phase takes
  # 7 s on 2 cores where those take 17 (`time docker/install.sh dev project`)
  local pkg pkgs=()
  for pkg in "$ROOT" "$ROOT"/environments/*/; do
    if [[ "${ASYNCRL_EDITABLE:-0}" == 1 ]]; then pkgs+=(-e "${pkg%/}"); else pkgs+=("${pkg%/}"); fi
  done
  pip install --no-deps --no-build-isolation "${pkgs[@]}"
  pip check
  # A receipt in the environment: tests/static checks that the test venv was installed by this script.
  run "$PY" - "$TARGET" "$ROOT/docker/install.sh" <<'PY'
import hashlib, json, pathlib, sys
receipt = {"target": sys.argv[1], "install_sh_sha256": hashlib.sha256(pathlib.Path(sys.argv[2]).read_bytes()).hexdigest()}
(pathlib.Path(sys.prefix) / "asyncrl-install.json").write_text(json.dumps(receipt) + "\n")
PY
}

# What `deps` installs, one requirement a line: the torch pin first where this script names it (cpu, dev: the CPU
# torch, installed on its own before the rest; trainer: the gpu target's, installed with the rest).
image_requirements() {
  case "$TARGET" in
    cpu) echo "torch==$TORCH_CPU" && requirements ;;
    dev) echo "torch==$TORCH_CPU" && requirements dev ;;
    gpu) requirements gpu ;;
    trainer) echo "torch==$TORCH_GPU" && requirements trainer ;;
    source-wheels) grep -v '^#' "$ROOT/docker/source-only.txt" ;;
    flash-attn-wheel) printf '%s\n' "torch==$TORCH_GPU" "${FLASH_ATTN_BUILD_DEPS[@]}" ;;
  esac
}

case "$PHASE" in
  requirements) image_requirements ;;
  deps) deps ;;
  project) project ;;
  all) deps && project ;;
esac
