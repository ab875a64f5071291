#!/usr/bin/env bash
# Build the cpu and dev images for real, without a Docker engine: Debian's buildah builds the Dockerfile
# (vfs storage, chroot isolation) and runs commands in the result. Used by tests/container (pytest -m
# container), which then runs the pipeline inside the cpu image and compares its hashes with the host's.
#
#   docker/image-test.sh build              build asyncrl:cpu and asyncrl:dev (the base image first, see below)
#   docker/image-test.sh run DIR CMD...     run CMD in asyncrl:cpu (or $IMAGE) as its user (uid 1000), DIR mounted at /runs
#
# The base image: pulled from the registry where one is reachable; otherwise (this project's machines reach
# no registry) a stand-in is made with debootstrap: Debian bookworm with its Python, tagged as the
# Dockerfile's base, with the Python headers that the official image ships too (the builder stage compiles
# against them). It checks every RUN step, user, path and permission of the Dockerfile, not the exact
# base (Python 3.11 from Debian instead of 3.12 in /usr/local). ASYNCRL_STANDIN=1 skips the pull.
# Where /opt/wheels holds a local CPU torch wheel (this project's machines), the build reads it through a
# mounted pip.conf; elsewhere it uses the Dockerfile's TORCH_INDEX_URL. Needs root, buildah, podman (to
# import the stand-in) and debootstrap: apt-get install -y buildah podman debootstrap.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STORE=(--storage-driver=vfs)
BASE=$(sed -n 's/^FROM \(python:[^ ]*\) AS cpu-base$/docker.io\/library\/\1/p' "$ROOT/Dockerfile")
WORK=${ASYNCRL_IMAGE_WORK:-/var/tmp/asyncrl-image-test}

need() {
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "image-test: $tool is missing (apt-get install -y buildah podman debootstrap)" >&2; exit 3; }
  done
}

have_image() { buildah "${STORE[@]}" inspect --type image "$1" >/dev/null 2>&1; }

base_image() {
  [[ -n "$BASE" ]] || { echo "image-test: no 'FROM python:... AS cpu-base' in the Dockerfile" >&2; exit 3; }
  have_image "$BASE" && return 0
  if [[ "${ASYNCRL_STANDIN:-0}" != 1 ]] && timeout 60 buildah "${STORE[@]}" pull -q "$BASE" >/dev/null 2>&1; then
    return 0
  fi
  need debootstrap podman
  echo "image-test: no registry; making a stand-in for $BASE with debootstrap (a few minutes, once)" >&2
  local rootfs="$WORK/rootfs"
  rm -rf "$rootfs" && mkdir -p "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev bookworm "$rootfs" >"$WORK/debootstrap.log" 2>&1 \
    || { echo "image-test: debootstrap failed, see $WORK/debootstrap.log" >&2; exit 1; }
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
  tar -C "$rootfs" -c . | podman "${STORE[@]}" import - "$BASE" >/dev/null
  rm -rf "$rootfs"
}

build() {
  need buildah
  mkdir -p "$WORK"
  base_image
  local args=(--pull=never --isolation=chroot --network=host --layers -f "$ROOT/Dockerfile")
  if [[ -d /etc/ssl/certs ]]; then args+=(-v /etc/ssl/certs:/etc/ssl/certs:ro); fi
  if compgen -G "/opt/wheels/torch-*.whl" >/dev/null; then
    printf '[global]\nfind-links = /opt/wheels\n' >"$WORK/pip.conf"
    args+=(-v /opt/wheels:/opt/wheels:ro -v "$WORK/pip.conf:/etc/pip.conf:ro" --build-arg TORCH_INDEX_URL=)
  fi
  for target in cpu dev; do
    local start=$SECONDS
    buildah "${STORE[@]}" bud "${args[@]}" --target "$target" -t "asyncrl:$target" "$ROOT" >"$WORK/build-$target.log" 2>&1 \
      || { tail -n 30 "$WORK/build-$target.log" >&2; echo "image-test: building $target failed, see $WORK/build-$target.log" >&2; exit 1; }
    echo "image-test: built asyncrl:$target in $((SECONDS - start)) s"
  done
}

run_in() {
  need buildah
  local dir=$1
  shift
  local c
  c=$(buildah "${STORE[@]}" from --pull=never "${IMAGE:-asyncrl:cpu}")
  trap 'buildah "${STORE[@]}" rm "$c" >/dev/null' RETURN
  # the image's user owns nothing on the host: give it the folder mounted at /runs
  chown 1000:1000 "$dir"
  buildah "${STORE[@]}" run --isolation=chroot --network=host --user 1000:1000 --workingdir /runs -v "$dir:/runs" "$c" -- "$@"
}

case "${1:-}" in
  build) build ;;
  run) shift; [[ $# -ge 2 ]] || { echo "usage: $0 run DIR CMD..." >&2; exit 2; }; run_in "$@" ;;
  *) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
