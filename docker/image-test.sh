#!/usr/bin/env bash
# Build the images for real, without a Docker engine: Debian's buildah builds the Dockerfile (chroot isolation)
# and runs commands in the result. Used by tests/container (pytest -m container), which then runs the pipeline
# inside the images and compares its hashes with the committed ones (and the cpu image's with the host's).
#
#   docker/image-test.sh build [TARGET...]  build asyncrl:TARGET for each (cpu and dev by default; gpu, trainer)
#   docker/image-test.sh run DIR CMD...     run CMD in asyncrl:cpu (or $IMAGE) as its user (uid 1000), DIR mounted at /runs
#   docker/image-test.sh remove TARGET...   remove asyncrl:TARGET, its containers and the layers no image uses
#                                           (the gpu and trainer images hold ~10 GB each)
#
# The base images: pulled from the registry where one is reachable; otherwise (this project's machines reach
# no registry) one stand-in made with debootstrap takes the place of each: Debian bookworm with its Python and
# the Python headers that the official image ships too (the builder stage compiles against them), tagged as the
# Dockerfile's bases. It checks every RUN step, user, path and permission of the Dockerfile, not the exact base:
# Python 3.11 from Debian instead of 3.12 (python:3.12-slim's in /usr/local, Ubuntu 24.04's under the CUDA base),
# and in place of nvidia/cuda no CUDA toolkit, so no nvcc: the gpu and trainer images' CUDA libraries come as
# PyPI wheels with torch and build here, flash-attn 2 (FLASH_ATTN=1) does not. ASYNCRL_STANDIN=1 skips the pull.
# Where /opt/wheels holds a local CPU torch wheel (this project's machines), the build reads it through a
# mounted pip.conf; elsewhere it uses the Dockerfile's TORCH_INDEX_URL. Needs root, buildah, podman (to
# import the stand-in) and debootstrap: apt-get install -y buildah podman debootstrap.
# Images live in a store of their own under $ASYNCRL_IMAGE_WORK: overlay where this kernel mounts it (layers
# share their files), else vfs (a whole copy of the tree per layer: the gpu and trainer images then need ~40 GB
# each while they build); ASYNCRL_STORAGE_DRIVER picks one.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${ASYNCRL_IMAGE_WORK:-/var/tmp/asyncrl-image-test}
STANDIN=localhost/asyncrl-standin:bookworm

# The Dockerfile's bases from a registry (python:..., nvidia/cuda:...), as buildah names them: Docker Hub's unless
# the first part of the name is a registry's host (it has a dot or a port, or is localhost)
registry_bases() {
  local image as first
  while read -r _ image as _; do
    [[ "${as,,}" == as && "$image" == *:* && "$image" != --* ]] || continue
    first=${image%%/*}
    if [[ "$image" != */* ]]; then
      image="docker.io/library/$image"
    elif [[ "$first" != *.* && "$first" != *:* && "$first" != localhost ]]; then
      image="docker.io/$image"
    fi
    echo "$image"
  done < <(grep -iE '^FROM[[:space:]]' "$ROOT/Dockerfile")
}
mapfile -t BASES < <(registry_bases)

need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "image-test: $tool is missing (apt-get install -y buildah podman debootstrap)" >&2; exit 3; }
  done
}

storage_driver() {
  if [[ -n "${ASYNCRL_STORAGE_DRIVER:-}" ]]; then echo "$ASYNCRL_STORAGE_DRIVER" && return; fi
  local probe  # one of its own: runs of this script may start at the same moment
  probe=$(mktemp -d "$WORK/overlay-probe.XXXXXX") || return 1
  mkdir -p "$probe"/{lower,upper,work,merged} || return 1
  if mount -t overlay overlay -o "lowerdir=$probe/lower,upperdir=$probe/upper,workdir=$probe/work" "$probe/merged" 2>/dev/null; then
    umount "$probe/merged" || return 1
    echo overlay
  else
    echo vfs
  fi
  rm -rf "$probe"
}

mkdir -p "$WORK"
DRIVER=$(storage_driver) || { echo "image-test: could not probe overlay storage under $WORK" >&2; exit 3; }
[[ "$DRIVER" == overlay || "$DRIVER" == vfs ]] \
  || { echo "image-test: ASYNCRL_STORAGE_DRIVER=$DRIVER: overlay or vfs" >&2; exit 2; }
STORE=(--storage-driver="$DRIVER" --root "$WORK/storage-$DRIVER" --runroot "/run/asyncrl-image-test-$DRIVER")

# builds and removals one at a time (the stand-in's rootfs, the logs and the layers are shared); runs need none
exclusive() { exec 9>"$WORK/lock" && flock 9; }

have_image() { buildah "${STORE[@]}" inspect --type image "$1" >/dev/null 2>&1; }

standin() {
  have_image "$STANDIN" && return 0
  need debootstrap podman
  echo "image-test: no registry; making a stand-in for ${BASES[*]} with debootstrap (a few minutes, once)" >&2
  local rootfs="$WORK/rootfs"
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev bookworm "$rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { echo "image-test: debootstrap failed, see $WORK/debootstrap.log" >&2; exit 1; }
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
  tar -C "$rootfs" -c . | podman "${STORE[@]}" import - "$STANDIN" >/dev/null
  rm -rf "$rootfs"
}

base_images() {
  [[ ${#BASES[@]} -gt 0 ]] || { echo "image-test: no 'FROM image:tag AS stage' in the Dockerfile" >&2; exit 3; }
  local base
  for base in "${BASES[@]}"; do
    have_image "$base" && continue
    if [[ "${ASYNCRL_STANDIN:-0}" != 1 ]] && timeout 60 buildah "${STORE[@]}" pull -q "$base" >/dev/null 2>&1; then
      continue
    fi
    standin
    buildah "${STORE[@]}" tag "$STANDIN" "$base"
  done
}

build() {
  need buildah
  exclusive
  base_images
  local args=(--pull=never --isolation=chroot --network=host -f "$ROOT/Dockerfile")
  # vfs copies the whole tree per layer: a layer per instruction would take the gpu images past most disks
  if [[ "$DRIVER" == overlay ]]; then args+=(--layers); fi
  if [[ -d /etc/ssl/certs ]]; then args+=(-v /etc/ssl/certs:/etc/ssl/certs:ro); fi
  if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
    printf '[global]\nfind-links = /opt/wheels\n' >"$WORK/pip.conf"
    args+=(-v /opt/wheels:/opt/wheels:ro -v "$WORK/pip.conf:/etc/pip.conf:ro" --build-arg TORCH_INDEX_URL=)
  fi
  local target targets=("$@")
  [[ ${#targets[@]} -gt 0 ]] || targets=(cpu dev)
  for target in "${targets[@]}"; do
    local start=$SECONDS
    buildah "${STORE[@]}" bud "${args[@]}" --target "$target" -t "asyncrl:$target" "$ROOT" >"$WORK/build-$target.log" 2>&1 \
      || { tail -n 30 "$WORK/build-$target.log" >&2; echo "image-test: building $target failed, see $WORK/build-$target.log" >&2; exit 1; }
    echo "image-test: built asyncrl:$target in $((SECONDS - start)) s ($DRIVER storage)"
  done
}

run_in() {
  need buildah
  local dir=$1
  shift
  # the image's user owns nothing on the host: give it the folder mounted at /runs
  chown 1000:1000 "$dir"
  CONTAINER=$(buildah "${STORE[@]}" from --pull=never "${IMAGE:-asyncrl:cpu}")
  # the container goes whatever ends the script: CMD's exit status, set -e, or a signal
  trap 'buildah "${STORE[@]}" rm "$CONTAINER" >/dev/null || echo "image-test: could not remove container $CONTAINER" >&2' EXIT
  trap 'exit 143' TERM INT
  local status=0
  buildah "${STORE[@]}" run --isolation=chroot --network=host --user 1000:1000 --workingdir /runs -v "$dir:/runs" \
    "$CONTAINER" -- "$@" || status=$?
  return "$status"
}

remove() {
  need buildah
  exclusive
  local target c
  for target in "$@"; do
    have_image "asyncrl:$target" || continue
    # containers left by a run stopped halfway hold their image
    for c in $(buildah "${STORE[@]}" containers --quiet --filter "ancestor=asyncrl:$target"); do
      buildah "${STORE[@]}" rm "$c" >/dev/null || true
    done
    buildah "${STORE[@]}" rmi "asyncrl:$target" >/dev/null
  done
  # the layers no image uses any more (a rebuild's earlier layers among them)
  buildah "${STORE[@]}" rmi --prune >/dev/null || true
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; [[ $# -ge 2 ]] || { echo "usage: $0 run DIR CMD..." >&2; exit 2; }; run_in "$@" ;;
  remove) shift; remove "$@" ;;
  *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
