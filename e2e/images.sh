#!/usr/bin/env bash
# Build the project's images without a Docker daemon or a registry: buildah, on a Debian base made here.
#
#   e2e/images.sh [all|base|uv|pause|operator|worker|worker-vllm]...   (default: all)
#   e2e/images.sh archive NAME FILE [HAVE]  write image NAME (e.g. pdcluster/worker:0.1.0) as an OCI archive,
#                                       leaving out the layers whose blobs are in directory HAVE
#   e2e/images.sh names                 print the operator, worker, worker-vllm and pause image names, one a line
#
# - base:   `debootstrap --variant=minbase bookworm` + python3.11, committed as localhost/pdcluster/python-base:<key>;
#           the rootfs tarball is cached as $CACHE/images/python-base-<key>.tar, <key> = hash of what it was
#           built from (suite, packages, mirror), so a rebuild of the images never re-runs debootstrap.
# - uv:     the host's uv binary (the uv that wrote uv.lock) as localhost/pdcluster/uv:<version>, /uv inside,
#           the same layout as ghcr.io/astral-sh/uv (the Dockerfiles' default UV_IMAGE).
# - pause:  kubernetes' own build/pause/linux/pause.c (from the pinned k8s.io/kubernetes module), built
#           static with gcc, as localhost/pdcluster/pause:<K8S_VERSION>: the node's pod sandbox image.
# - operator, worker: docker/<name>.Dockerfile, unchanged, with --build-arg PYTHON_IMAGE=<base> and
#           UV_IMAGE=<uv>, the host's uv cache bind-mounted as the Dockerfiles' UV_CACHE_DIR (torch is
#           copied from it, not downloaded) and the host CA bundle at the base's CA path (build time only).
# - worker-vllm: docker/worker-vllm.Dockerfile FROM the worker's `deps` stage (tagged
#           localhost/pdcluster/worker-deps:<version>, a layer-cache hit after `worker`): the two images share
#           the torch/CUDA layer, and this one adds vLLM and NIXL only.
# buildah's storage lives in $CACHE/containers (layers are cached there: `--layers`); every RUN step uses
# the host network (`--network host`): buildah's default would create a CNI bridge and iptables chains of
# its own and leave them behind.
# Environment: PDCLUSTER_CACHE, PDCLUSTER_BUILD_NICE (default 10), PDCLUSTER_DEBIAN_MIRROR.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
NICE="${PDCLUSTER_BUILD_NICE:-10}"
MIRROR="${PDCLUSTER_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -1)"
OPERATOR_IMAGE="pdcluster/operator:$VERSION"
WORKER_IMAGE="pdcluster/worker:$VERSION"
WORKER_VLLM_IMAGE="pdcluster/worker-vllm:$VERSION"   # engine: vllm pools (docker/worker-vllm.Dockerfile)
WORKER_DEPS_IMAGE="localhost/pdcluster/worker-deps:$VERSION"   # worker.Dockerfile's deps stage, worker-vllm's base
PAUSE_IMAGE="pdcluster/pause:$K8S_VERSION"
BASE_PACKAGES="python3.11"
BASE_KEY="$(printf '%s\n' "bookworm minbase $BASE_PACKAGES $MIRROR v1" | sha256sum | cut -c1-12)"
BASE_IMAGE="localhost/pdcluster/python-base:$BASE_KEY"
UV_BIN="${PDCLUSTER_UV_BIN:-$(command -v uv || python3 -c 'import uv; print(uv.find_uv_bin())')}"
UV_VERSION="$("$UV_BIN" --version | awk '{print $2}')"
UV_IMAGE="localhost/pdcluster/uv:$UV_VERSION"
HOST_UV_CACHE="$("$UV_BIN" cache dir 2>/dev/null || echo "$HOME/.cache/uv")"
HOST_CA=/etc/ssl/certs/ca-certificates.crt

log() { printf '[images %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
bh() { nice -n "$NICE" buildah --root "$CACHE/containers/storage" --runroot "$CACHE/containers/run" \
         --storage-driver overlay "$@"; }
have_image() { bh images --quiet "$1" >/dev/null 2>&1; }

build_base() {
  if have_image "$BASE_IMAGE"; then log "base $BASE_IMAGE: cached"; return; fi
  local tarball="$CACHE/images/python-base-$BASE_KEY.tar" t0=$SECONDS
  mkdir -p "$CACHE/images"
  if [[ ! -s "$tarball" ]]; then
    command -v debootstrap >/dev/null || die "debootstrap is required (e2e/node-deps.sh installs it)"
    local rootfs; rootfs="$(mktemp -d "$CACHE/images/rootfs.XXXXXX")"
    log "base: debootstrap --variant=minbase bookworm + $BASE_PACKAGES"
    nice -n "$NICE" debootstrap --variant=minbase --include="${BASE_PACKAGES// /,}" bookworm "$rootfs" "$MIRROR" \
      >"$CACHE/images/debootstrap.log" 2>&1 || { rm -rf "$rootfs"; die "debootstrap failed; see $CACHE/images/debootstrap.log"; }
    # what an image does not need: package lists, caches, docs (apt-get update brings the lists back)
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/{doc,man,info}/* \
      "$rootfs"/var/log/*.log "$rootfs"/debootstrap
    tar --numeric-owner -C "$rootfs" -cf "$tarball.tmp" . && mv -f "$tarball.tmp" "$tarball"
    rm -rf "$rootfs"
  fi
  local ctr; ctr="$(bh from scratch)"
  bh add "$ctr" "$tarball" / >/dev/null
  bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
    --cmd python3.11 --label "org.opencontainers.image.title=pdcluster-python-base" "$ctr"
  bh commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
  log "base $BASE_IMAGE: built in $((SECONDS - t0))s"
}

build_uv() {
  if have_image "$UV_IMAGE"; then log "uv $UV_IMAGE: cached"; return; fi
  local ctr; ctr="$(bh from scratch)"
  bh copy "$ctr" "$UV_BIN" /uv >/dev/null
  bh commit --quiet --rm "$ctr" "$UV_IMAGE" >/dev/null
  log "uv $UV_IMAGE: built"
}

build_pause() {
  if have_image "$PAUSE_IMAGE"; then log "pause $PAUSE_IMAGE: cached"; return; fi
  local src gomod out t0=$SECONDS
  gomod="$(cd "$CACHE" && "${GO:-/usr/local/go/bin/go}" env GOMODCACHE)"
  src="$gomod/k8s.io/kubernetes@$K8S_VERSION/build/pause/linux/pause.c"
  [[ -f "$src" ]] || die "pause.c not found at $src (run e2e/build.sh k8s first)"
  out="$(mktemp -d)"
  gcc -Os -static -Wall -Werror -DVERSION="$K8S_VERSION" -o "$out/pause" "$src"
  strip "$out/pause"
  local ctr; ctr="$(bh from scratch)"
  bh copy "$ctr" "$out/pause" /pause >/dev/null
  bh config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  bh commit --quiet --rm "$ctr" "$PAUSE_IMAGE" >/dev/null
  rm -rf "$out"
  log "pause $PAUSE_IMAGE: built in $((SECONDS - t0))s"
}

build_dockerfile() {  # name image [extra buildah bud arguments]
  local name="$1" image="$2" t0=$SECONDS
  shift 2
  build_base; build_uv
  [[ -d "$HOST_UV_CACHE" ]] || mkdir -p "$HOST_UV_CACHE"
  log "$image: buildah bud -f docker/$name.Dockerfile (base $BASE_IMAGE)"
  # --force-rm: a failed step's container is removed too (each holds an overlay mount)
  (cd "$ROOT" && bh bud --layers --force-rm --network host --pull-never \
      -f "docker/$name.Dockerfile" --ignorefile "docker/$name.Dockerfile.dockerignore" \
      --build-arg "PYTHON_IMAGE=$BASE_IMAGE" --build-arg "UV_IMAGE=$UV_IMAGE" \
      --build-arg "UV_CACHE_DIR=/host-uv-cache" -v "$HOST_UV_CACHE:/host-uv-cache" \
      -v "$HOST_CA:$HOST_CA:ro" "$@" \
      -t "$image" . ) >"$CACHE/images/$name.build.log" 2>&1 \
    || { rm_stage_containers; tail -40 "$CACHE/images/$name.build.log" >&2; die "$image: build failed; see $CACHE/images/$name.build.log"; }
  rm_stage_containers
  log "$image: built in $((SECONDS - t0))s ($(image_size "$image"))"
}

# the deps stage of worker.Dockerfile (cached layers when `worker` was built), then worker-vllm FROM it
build_worker_vllm() {
  local t0=$SECONDS
  build_dockerfile worker "$WORKER_DEPS_IMAGE" --target deps
  build_dockerfile worker-vllm "$WORKER_VLLM_IMAGE" --build-arg "DEPS_IMAGE=$WORKER_DEPS_IMAGE"
  log "$WORKER_VLLM_IMAGE: deps stage + vLLM layer in $((SECONDS - t0))s"
}

# buildah 1.28 keeps the working container of a stage that is only mounted (`RUN --mount=from=uv`),
# with its overlay mount, after the build: remove those of the uv image (nothing else uses it)
rm_stage_containers() {
  local ids
  ids="$(bh containers --format '{{.ContainerID}} {{.ImageName}}' 2>/dev/null | awk -v i="$UV_IMAGE" '$2 == i {print $1}')"
  [[ -z "$ids" ]] || bh rm $ids >/dev/null 2>&1 || true
}

image_size() { bh images --format '{{.Size}}' "$1" 2>/dev/null | head -1; }

# write NAME as an OCI archive for `ctr images import`. With HAVE (containerd's blobs/sha256 directory), the image
# goes out uncompressed (`docker-archive:`, IO only) and e2e/oci_subset.py repacks it as an OCI archive leaving
# out the layers whose blobs HAVE holds: a layer shared by two images (worker and worker-vllm: torch) or unchanged
# under a source edit crosses once. Without HAVE, buildah's own oci-archive (which gzips every layer).
archive() {  # name file [have]
  have_image "$1" || die "no image $1 (run e2e/images.sh first)"
  rm -f "$2"
  if [[ -z "${3:-}" ]]; then
    bh push --quiet --disable-compression "$1" "oci-archive:$2:$(normalize "$1")" >/dev/null
    return
  fi
  local full="$2.docker.tar" out
  rm -f "$full"
  bh push --quiet "$1" "docker-archive:$full:$(normalize "$1")" >/dev/null || { rm -f "$full"; die "buildah push $1"; }
  out="$(python3 "$HERE/oci_subset.py" "$full" "$2" "$(normalize "$1")" "$3")" || { rm -f "$full" "$2"; die "oci_subset $1"; }
  rm -f "$full"
  log "$1: archive $(du -h "$2" | cut -f1): $out"
}

# the name a kubelet/containerd resolves an unqualified image to
normalize() { case "$1" in */*/*|*.*/*|localhost/*) echo "$1" ;; */*) echo "docker.io/$1" ;; *) echo "docker.io/library/$1" ;; esac; }

[[ $EUID -eq 0 ]] || die "buildah here runs as root (no rootless setup); run as root"
command -v buildah >/dev/null || die "buildah is required (e2e/node-deps.sh installs it)"
targets=("$@"); [[ ${#targets[@]} -eq 0 ]] && targets=(all)
case "${targets[0]}" in
  names) echo "$OPERATOR_IMAGE"; echo "$WORKER_IMAGE"; echo "$WORKER_VLLM_IMAGE"; echo "$PAUSE_IMAGE"; exit 0 ;;
  archive) archive "$2" "$3" "${4:-}"; exit 0 ;;
  id) bh images --no-trunc --quiet "$2" | head -1; exit 0 ;;
esac
T0=$SECONDS
for t in "${targets[@]}"; do
  case "$t" in
    all) build_pause; build_dockerfile operator "$OPERATOR_IMAGE"; build_dockerfile worker "$WORKER_IMAGE"
         build_worker_vllm ;;
    base) build_base ;;
    uv) build_uv ;;
    pause) build_pause ;;
    operator) build_dockerfile operator "$OPERATOR_IMAGE" ;;
    worker) build_dockerfile worker "$WORKER_IMAGE" ;;
    worker-vllm) build_worker_vllm ;;
    *) die "unknown target $t" ;;
  esac
done
log "images ready in $((SECONDS - T0))s"
