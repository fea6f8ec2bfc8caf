#!/usr/bin/env bash
# Build (once) the binaries of the local control plane from the Go module proxy and cache them by version:
#   ${PDCLUSTER_CACHE:-~/.cache/pdcluster}/bin/{etcd,kube-apiserver,kube-controller-manager,kube-scheduler,kubectl,kwok,helm}-<version>
# and, for the real node (target `node`), kubelet-<version>, kube-proxy-<version> and coredns-<version>.
# Versions come from e2e/versions.env. A binary already in the cache is not rebuilt, so a warm run takes
# well under a second.
#
# usage: e2e/build.sh [all|k8s|etcd|kwok|helm|kubectl|node]...   (default: all; `node` = kubelet + kube-proxy + coredns)
#        e2e/build.sh --print-bin-dir                       (print the cache bin dir and exit)
#
# Environment: PDCLUSTER_CACHE, GO (go binary; default: go on PATH, else /usr/local/go/bin/go),
#   PDCLUSTER_BUILD_JOBS (go build -p; default 2), PDCLUSTER_BUILD_NICE (default 10).
# k8s.io/kubernetes cannot be `go install`ed (its go.mod pins the staging modules k8s.io/api, ... at
# v0.0.0 and replaces them with ./staging paths), so a throw-away wrapper module requires it and replaces
# each staging module with its published v0.<minor>.<patch>. etcd's own go.mod has local replaces too, so
# it gets a wrapper module of its own.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
BIN="$CACHE/bin"
SRC="$CACHE/src"
JOBS="${PDCLUSTER_BUILD_JOBS:-2}"
NICE="${PDCLUSTER_BUILD_NICE:-10}"

if [[ "${1:-}" == "--print-bin-dir" ]]; then echo "$BIN"; exit 0; fi

if [[ -z "${GO:-}" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "build.sh: no Go toolchain found (set GO=...)" >&2; exit 1; fi
fi
export CGO_ENABLED=0
mkdir -p "$BIN" "$SRC"

log() { printf '[build %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
gob() { nice -n "$NICE" "$GO" "$@"; }
BUILDFLAGS=(-p "$JOBS" -trimpath -ldflags "-s -w")

have() { [[ -x "$BIN/$1-$2" ]]; }
# drop `go: downloading ...` chatter, keep errors; never fails by itself (pipefail keeps go's status)
quiet() { grep -v '^go: \(downloading\|added\|upgraded\|finding\)' >&2 || true; }

# wrapper module dir: $SRC/<name>; writes go.mod with `module pdcluster.local/<name>`
new_wrapper() {
  local dir="$SRC/$1"
  rm -rf "$dir" && mkdir -p "$dir"
  (cd "$dir" && gob mod init "pdcluster.local/$1" >/dev/null 2>&1)
  echo "$dir"
}

build_k8s() {  # [component...] (default: the control plane and kubectl)
  local want=(kube-apiserver kube-controller-manager kube-scheduler kubectl) missing=() c
  [[ $# -gt 0 ]] && want=("$@")
  for c in "${want[@]}"; do have "$c" "$K8S_VERSION" || missing+=("$c"); done
  if [[ ${#missing[@]} -eq 0 ]]; then log "kubernetes $K8S_VERSION: cached"; return; fi
  local t0=$SECONDS staging_ver="v0.${K8S_VERSION#v1.}" dir gomod
  dir="$(new_wrapper "k8s-$K8S_VERSION")"
  log "kubernetes $K8S_VERSION: resolving (staging modules at $staging_ver)"
  gomod="$(cd "$dir" && gob mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -f "$gomod" ]] || { echo "build.sh: could not download k8s.io/kubernetes@$K8S_VERSION" >&2; exit 1; }
  # every `k8s.io/<x> => ./staging/src/k8s.io/<x>` replace of kubernetes' go.mod becomes `=> k8s.io/<x> v0.Y.Z`
  local mods=() m
  mapfile -t mods < <(sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/.*#\1#p' "$gomod" | sort -u)
  [[ ${#mods[@]} -gt 5 ]] || { echo "build.sh: found no staging replaces in $gomod" >&2; exit 1; }
  local edits=()
  for m in "${mods[@]}"; do edits+=(-replace "$m=$m@$staging_ver"); done
  (cd "$dir" && gob mod edit "${edits[@]}" \
     && gob get "k8s.io/kubernetes@$K8S_VERSION" 2>&1 | quiet \
     && gob get "k8s.io/kubernetes/cmd/kube-apiserver@$K8S_VERSION" \
          "k8s.io/kubernetes/cmd/kube-controller-manager@$K8S_VERSION" \
          "k8s.io/kubernetes/cmd/kube-scheduler@$K8S_VERSION" "k8s.io/kubernetes/cmd/kubectl@$K8S_VERSION" \
          "k8s.io/kubernetes/cmd/kubelet@$K8S_VERSION" "k8s.io/kubernetes/cmd/kube-proxy@$K8S_VERSION" 2>&1 | quiet \
     && grep -q "k8s.io/kubernetes $K8S_VERSION" go.mod) \
    || { echo "build.sh: resolving k8s.io/kubernetes@$K8S_VERSION failed (see above)" >&2; exit 1; }
  log "kubernetes $K8S_VERSION: resolved in $((SECONDS - t0))s"
  local v="$K8S_VERSION" ver_ld
  # stamp the version so `kubectl version` and /version tell the truth
  ver_ld="-X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$v" | cut -d. -f2) -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/client-go/pkg/version.gitVersion=$v"
  for c in "${missing[@]}"; do
    local t1=$SECONDS
    log "kubernetes $K8S_VERSION: building $c"
    (cd "$dir" && gob build -p "$JOBS" -trimpath -ldflags "-s -w $ver_ld" -o "$BIN/.$c-$v.tmp" "k8s.io/kubernetes/cmd/$c")
    mv -f "$BIN/.$c-$v.tmp" "$BIN/$c-$v"
    log "kubernetes $K8S_VERSION: $c built in $((SECONDS - t1))s"
  done
  log "kubernetes $K8S_VERSION: done in $((SECONDS - t0))s"
}

build_etcd() {
  if have etcd "$ETCD_VERSION"; then log "etcd $ETCD_VERSION: cached"; return; fi
  local t0=$SECONDS dir
  dir="$(new_wrapper "etcd-$ETCD_VERSION")"
  log "etcd $ETCD_VERSION: building"
  # go.etcd.io/etcd/server/v3 (the module root package) is the `etcd` main package
  (cd "$dir" && gob get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" 2>&1 | quiet \
     && gob build "${BUILDFLAGS[@]}" -o "$BIN/.etcd-$ETCD_VERSION.tmp" go.etcd.io/etcd/server/v3)
  mv -f "$BIN/.etcd-$ETCD_VERSION.tmp" "$BIN/etcd-$ETCD_VERSION"
  log "etcd $ETCD_VERSION: built in $((SECONDS - t0))s"
}

# `go install pkg@version` into a temp GOBIN, then move to the versioned name
go_install() {  # name pkg version [extra ldflags]
  local name="$1" pkg="$2" v="$3" extra="${4:-}"
  if have "$name" "$v"; then log "$name $v: cached"; return; fi
  local t0=$SECONDS tmp
  tmp="$(mktemp -d "$SRC/gobin.XXXXXX")"
  log "$name $v: building"
  GOBIN="$tmp" gob install -p "$JOBS" -trimpath -ldflags "-s -w $extra" "$pkg@$v" 2>&1 | quiet
  mv -f "$tmp/$name" "$BIN/$name-$v"
  rm -rf "$tmp"
  log "$name $v: built in $((SECONDS - t0))s"
}

build_kwok() {
  go_install kwok sigs.k8s.io/kwok/cmd/kwok "$KWOK_VERSION"
  # The kwok binary alone simulates nothing: kwokctl hands it the "fast" node and pod Stages (node
  # initialize + heartbeat, pod ready/complete/delete). Take the same Stage files from the kwok module of
  # the pinned version and keep them next to the binary.
  local stages="$BIN/kwok-stages-$KWOK_VERSION.yaml" dir f
  [[ -s "$stages" ]] && return 0
  dir="$(gob mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
  [[ -d "$dir/kustomize/stage" ]] || { echo "build.sh: kwok module source not found ($dir)" >&2; exit 1; }
  : > "$stages.tmp"
  for f in node/fast/node-initialize.yaml node/heartbeat/node-heartbeat.yaml \
           pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    { echo "---"; echo "# from sigs.k8s.io/kwok@$KWOK_VERSION kustomize/stage/$f"; cat "$dir/kustomize/stage/$f"; } >> "$stages.tmp"
  done
  mv -f "$stages.tmp" "$stages"
  log "kwok $KWOK_VERSION: stages written to $stages"
}
# CoreDNS for the real node's pods (the operator's router finds workers by headless-Service DNS names);
# its main package is the module root.
build_coredns() { go_install coredns github.com/coredns/coredns "$COREDNS_VERSION"; }

build_helm() {
  # Stamp helm's version and its default Kubernetes version (what `helm template` and `helm lint` assume
  # without a cluster; unstamped it is v1.20) to the Kubernetes we pin, as helm's own release build does.
  local h="helm.sh/helm/v${HELM_VERSION:1:1}" minor
  minor="$(echo "$K8S_VERSION" | cut -d. -f2)"
  go_install helm "$h/cmd/helm" "$HELM_VERSION" \
    "-X $h/internal/version.version=$HELM_VERSION -X $h/internal/version.gitTreeState=clean -X $h/pkg/lint/rules.k8sVersionMajor=1 -X $h/pkg/lint/rules.k8sVersionMinor=$minor -X $h/pkg/chartutil.k8sVersionMajor=1 -X $h/pkg/chartutil.k8sVersionMinor=$minor"
}

targets=("$@"); [[ ${#targets[@]} -eq 0 ]] && targets=(all)
T0=$SECONDS
for t in "${targets[@]}"; do
  case "$t" in
    all) build_helm; build_etcd; build_kwok; build_k8s ;;
    k8s|kubernetes|kubectl) build_k8s ;;
    etcd) build_etcd ;;
    kwok) build_kwok ;;
    helm) build_helm ;;
    node) build_k8s kubelet kube-proxy; build_coredns ;;
    *) echo "build.sh: unknown target $t" >&2; exit 2 ;;
  esac
done
log "all requested binaries present in $BIN ($((SECONDS - T0))s)"
