#!/usr/bin/env bash
# One real Kubernetes node beside the kwok ones: kubelet + containerd + runc + CNI bridge + CoreDNS, on a
# bridge of its own. Called by e2e/cluster.sh (up/down/status), which exports the variables below.
#
#   node.sh up       start containerd, import the images, start the kubelet, CoreDNS and kube-proxy; wait
#                    for Ready and kube-proxy's first sync, then enable forwarding on the bridge only
#   node.sh down     cordon, delete the node's pods, stop everything, remove every mount, netns, veth,
#                    iptables rule, cgroup and interface this script made, restore the host's sysctls and
#                    compare iptables with the snapshot taken before `up`; says what it removed
#   node.sh status   which node processes run
#   node.sh import   import images rebuilt since (a no-op for unchanged ones; `cluster.sh up` runs it)
#   node.sh routes   assert that every pod/service address routes via the node's bridge (exit 1 if not)
#
# Network (docs/e2e.md, e2e/node-net.sh): bridge $NODE_BRIDGE with $NODE_IP/24, pods in $NODE_POD_CIDR (no
# default route in the pods: they reach only the bridge and the service range), Services in $SERVICE_CIDR,
# routed to the bridge on the host too. Our NAT rule: pods -> the `kubernetes` Service -> the API server on
# loopback; kube-proxy's: pods -> any other ClusterIP -> its endpoint pods, masqueraded. Nothing here
# forwards off the machine: the global ip_forward stays as it was, the bridge alone forwards, and only to
# itself (PDC-NODE-FWD first in FORWARD); containerd and the kubelet get a loopback HTTP(S) proxy so that
# an image pull can never leave the machine.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"
: "${DIR:?}" "${BIN:?}" "${API_PORT:?}" "${KUBECONFIG_PATH:?}" "${SERVICE_CIDR:?}" "${KUBERNETES_SVC_IP:?}"
: "${NODE_BRIDGE:?}" "${NODE_IP:?}" "${NODE_POD_CIDR:?}" "${PORT_BASE:?}"
CACHE="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
NODE_NAME="${PDCLUSTER_NODE_NAME:-pdc-node-0}"
N="$DIR/node"                                # state: removed by `down`
CROOT="$CACHE/containerd"                    # containerd's content and snapshots: kept, so images stay imported
SOCK="$N/containerd.sock"
KUBELET_HEALTH_PORT=$((PORT_BASE + 48)); COREDNS_HEALTH_PORT=$((PORT_BASE + 53))
NO_PULL_PROXY=http://127.0.0.1:9              # discard port: a pull fails at once, on this machine
CNI_BIN="$(dirname "$(dpkg -L containernetworking-plugins 2>/dev/null | grep '/bridge$' | head -1)" 2>/dev/null || echo /usr/lib/cni)"

log() { printf '[node %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
kc() { "$BIN/kubectl-$K8S_VERSION" --kubeconfig "$KUBECONFIG_PATH" "$@"; }
ctr_() { ctr --address "$SOCK" -n k8s.io "$@"; }

pid_of() { [[ -f "$N/run/$1.pid" ]] && cat "$N/run/$1.pid"; }
alive() { local p; p="$(pid_of "$1" 2>/dev/null)" && [[ -n "$p" && -d "/proc/$p" ]]; }
start() {  # name log-env... -- cmd...   (own session; stopped by pid)
  local name="$1"; shift
  alive "$name" && { log "$name already running"; return 0; }
  mkdir -p "$N/run" "$DIR/logs"
  setsid env HTTP_PROXY="$NO_PULL_PROXY" HTTPS_PROXY="$NO_PULL_PROXY" NO_PROXY="127.0.0.1,localhost,$NODE_IP" \
    "$@" </dev/null >>"$DIR/logs/$name.log" 2>&1 &
  echo $! > "$N/run/$name.pid"
  log "$name started (pid $!, log $DIR/logs/$name.log)"
}
stop() {
  local name="$1" p i
  p="$(pid_of "$name" 2>/dev/null)" || return 0
  if [[ -n "$p" && -d "/proc/$p" ]]; then
    kill -TERM "$p" 2>/dev/null || true
    for i in $(seq 1 60); do [[ -d "/proc/$p" ]] || break; sleep 0.25; done
    [[ -d "/proc/$p" ]] && kill -KILL "$p" 2>/dev/null || true
    log "$name stopped (pid $p)"
  fi
  rm -f "$N/run/$name.pid"
}
wait_for() { local what="$1" t="$2"; shift 2; local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do ((SECONDS < end)) || return 1; sleep 0.5; done; log "$what ready"; }

# the bridge, the route check, kube-proxy and the host snapshot `down` restores
# shellcheck source=node-net.sh
source "$HERE/node-net.sh"

# ------------------------------------------------------------------------------------------ containerd
containerd_up() {
  mkdir -p "$N/cni/net.d" "$N/cni-ipam" "$CROOT" "$N/containerd-state"
  cat > "$N/containerd.toml" <<EOF
version = 2
root = "$CROOT"
state = "$N/containerd-state"
[grpc]
  address = "$SOCK"
[ttrpc]
  address = "$SOCK.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$N/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/$PAUSE_IMAGE"
  # writing oom_score_adj -998 for the sandbox is denied in this VM; without this every sandbox fails
  # with runc's "can't get final child's PID from pipe: EOF"
  restrict_oom_score_adj = true
  # pod network namespaces under our state dir (not /var/run/netns): node.sh down finds and unmounts them
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "$N/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$CNI_BIN"
    conf_dir = "$N/cni/net.d"
EOF
  # host-local keeps its leases in our state dir; no default route in pods, only the service range
  cat > "$N/cni/net.d/10-pdcluster.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "pdcluster", "plugins": [
  {"type": "bridge", "bridge": "$NODE_BRIDGE", "isGateway": false, "ipMasq": false, "hairpinMode": false,
   "ipam": {"type": "host-local", "dataDir": "$N/cni-ipam",
            "ranges": [[{"subnet": "$NODE_POD_CIDR", "rangeStart": "${NODE_POD_CIDR%.*}.10",
                         "rangeEnd": "${NODE_POD_CIDR%.*}.250", "gateway": "$NODE_IP"}]],
            "routes": [{"dst": "$SERVICE_CIDR"}]}}]}
EOF
  start containerd containerd --config "$N/containerd.toml"
  wait_for containerd 60 ctr_ version || die "containerd did not start; see $DIR/logs/containerd.log"
}

# Re-importing a tag moves it to the new manifest before the unpack finishes; the old manifest is then
# unreferenced and containerd's GC may delete the shared lower-layer snapshots the unpack has just found
# (containerd#3787: "parent snapshot ... does not exist"). A keep-tag holds the old image until the new one
# is unpacked, so unchanged layers (torch) are neither lost nor re-extracted; one retry covers any other
# race. The listing of images present arrives on stdin.
import_one() {
  local ref="$1" tar="$2" keep="pdcluster.local/keep/${1##*/}" try
  if grep -qx "$ref" -; then ctr_ images tag --force "$ref" "$keep" >/dev/null; fi
  for try in 1 2; do
    if ctr_ images import --no-unpack=false "$tar" >/dev/null; then break; fi
    ((try < 2)) || { ctr_ images rm "$keep" >/dev/null 2>&1 || true; die "importing $ref failed twice"; }
    log "$ref: import failed (attempt $try); retrying"
  done
  ctr_ images rm "$keep" >/dev/null 2>&1 || true
}

import_images() {
  local name id marker have
  mkdir -p "$CROOT/imported"
  for name in $("$HERE/images.sh" names); do
    id="$("$HERE/images.sh" id "$name")"
    [[ -n "$id" ]] || die "image $name is not built (make images / e2e/images.sh)"
    marker="$CROOT/imported/$(echo "$name" | tr '/:' '__').id"
    # (the listing is captured first: `ctr ... | grep -q` fails under pipefail when grep exits early)
    have="$(ctr_ images ls -q 2>/dev/null || true)"
    if [[ "$(cat "$marker" 2>/dev/null)" == "$id" ]] && grep -qx "docker.io/$name" <<<"$have"; then
      log "$name: already in containerd"; continue
    fi
    local t0=$SECONDS tar="$N/import.tar"
    # only the layers containerd lacks (images.sh archive); a failed import retries with the whole image
    "$HERE/images.sh" archive "$name" "$tar" "$CROOT/io.containerd.content.v1.content/blobs/sha256"
    if ! (import_one "docker.io/$name" "$tar" <<<"$have"); then
      log "$name: import of the partial archive failed; importing the whole image"
      "$HERE/images.sh" archive "$name" "$tar"
      import_one "docker.io/$name" "$tar" <<<"$have"
    fi
    rm -f "$tar"
    echo "$id" > "$marker"
    log "$name: imported into containerd in $((SECONDS - t0))s"
  done
}

# ------------------------------------------------------------------------------------------ kubelet, DNS
kubelet_up() {
  mkdir -p "$N/kubelet" "$N/pod-logs"
  cat > "$N/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $KUBELET_HEALTH_PORT
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: AlwaysAllow}
# this VM: cgroup v1 hybrid without systemd as init, swap allowed
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$SOCK
clusterDNS: [$NODE_IP]
clusterDomain: cluster.local
# no host resolv.conf: pods resolve cluster names only (CoreDNS answers nothing else)
resolvConf: ""
enforceNodeAllocatable: []
podLogsDir: $N/pod-logs
maxPods: 40
serializeImagePulls: false
# never evict or garbage-collect the imported images on a busy shared disk
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 100Mi, nodefs.available: "1%", imagefs.available: "1%"}
EOF
  start kubelet "$BIN/kubelet-$K8S_VERSION" --config "$N/kubelet.yaml" --kubeconfig "$DIR/kubelet.kubeconfig" \
    --root-dir "$N/kubelet" --cert-dir "$N/kubelet-pki" --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" \
    --node-labels "type=real,pdcluster.dev/node=real" \
    --register-with-taints "pdcluster.dev/real-node=true:NoSchedule"
}

coredns_up() {
  cat > "$N/Corefile" <<EOF
cluster.local:53 {
    bind $NODE_IP
    errors
    health 127.0.0.1:$COREDNS_HEALTH_PORT
    kubernetes cluster.local {
        kubeconfig $DIR/coredns.kubeconfig pdcluster-e2e
        pods disabled
    }
}
.:53 {
    bind $NODE_IP
    # no forwarding: names outside the cluster get no answer, nothing leaves the machine
    template ANY ANY {
        rcode REFUSED
    }
}
EOF
  start coredns "$BIN/coredns-$COREDNS_VERSION" -conf "$N/Corefile"
  wait_for coredns 30 curl -fsS --max-time 2 "http://127.0.0.1:$COREDNS_HEALTH_PORT/health" \
    || die "CoreDNS did not start; see $DIR/logs/coredns.log"
}

node_ready() {
  [[ "$(kc get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" == True ]]
}

PAUSE_IMAGE="$("$HERE/images.sh" names | tail -1)"
# Paths the kubelet and containerd create at fixed places whatever their config says (device-plugin
# socket, CNI result cache, shim sockets, /var/log/containers links): recorded when this node made them,
# removed by `down`.
SYSTEM_PATHS=(/var/lib/kubelet /var/lib/cni /run/containerd /var/log/containers)
record_system_paths() {
  local p; mkdir -p "$N"
  for p in "${SYSTEM_PATHS[@]}"; do [[ -e "$p" ]] || echo "$p" >> "$N/created-paths"; done
}
remove_system_paths() {
  local p; [[ -f "$N/created-paths" ]] || return 0
  while read -r p; do [[ -n "$p" && -e "$p" ]] && rm -rf -- "$p" && log "removed $p (made by this node)"; done < "$N/created-paths"
}
runtime_up() { [[ -f "$N/created-paths" ]] || record_system_paths; net_up; containerd_up; import_images; }

up() {
  local t0=$SECONDS c
  [[ $EUID -eq 0 ]] || die "the real node needs root (PDCLUSTER_REAL_NODE=0 runs kwok nodes only)"
  for c in containerd runc ctr ip iptables; do command -v "$c" >/dev/null || die "$c missing (run e2e/node-deps.sh)"; done
  [[ -x "$CNI_BIN/bridge" && -x "$CNI_BIN/host-local" && -x "$CNI_BIN/loopback" ]] || die "CNI plugins missing in $CNI_BIN"
  [[ -x "$BIN/kubelet-$K8S_VERSION" && -x "$BIN/kube-proxy-$K8S_VERSION" && -x "$BIN/coredns-$COREDNS_VERSION" ]] \
    || die "kubelet/kube-proxy/coredns not built (e2e/build.sh node)"
  [[ -f "$DIR/pki/kube-proxy.crt" ]] || die "no kube-proxy certificate: a cluster started by an older cluster.sh (cluster.sh down, then up)"
  runtime_up
  coredns_up
  kubelet_up
  wait_for "node $NODE_NAME" 120 node_ready || die "node $NODE_NAME not Ready; see $DIR/logs/kubelet.log"
  proxy_up
  log "real node up in $((SECONDS - t0))s ($NODE_NAME, $NODE_IP, bridge $NODE_BRIDGE)"
}

# ------------------------------------------------------------------------------------------ teardown
down() {
  [[ -d "$N" ]] || { log "no real node state"; return 0; }
  if alive kubelet && kc get node "$NODE_NAME" >/dev/null 2>&1; then
    # the kubelet itself stops the pods' containers and sandboxes (CNI DEL frees the IPs and veths)
    kc cordon "$NODE_NAME" >/dev/null 2>&1 || true
    kc delete pods -A --field-selector "spec.nodeName=$NODE_NAME" --grace-period=2 --wait=false >/dev/null 2>&1 || true
    local end=$((SECONDS + 60))
    while ((SECONDS < end)) && [[ -n "$(ctr_ tasks ls -q 2>/dev/null)" ]]; do sleep 1; done
    kc delete node "$NODE_NAME" --wait=false >/dev/null 2>&1 || true
  fi
  stop kube-proxy; stop coredns; stop kubelet
  local left=0 id
  if alive containerd; then
    for id in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; left=$((left + 1)); done
    sleep 1
    for id in $(ctr_ containers ls -q 2>/dev/null); do
      ctr_ tasks delete -f "$id" >/dev/null 2>&1 || true; ctr_ containers delete "$id" >/dev/null 2>&1 || true
    done
  fi
  stop containerd
  kill_shims
  unmount_all
  rmdir_cgroups
  net_down
  remove_system_paths
  rm -rf "$N"
  log "real node down (${left} containers killed after the kubelet stopped; mounts, netns, cgroups removed)"
}

# containerd-shim-runc-v2 processes of *our* containerd: their command line names our socket
kill_shims() {
  local p n=0
  for p in $(pgrep -f -x ".*containerd-shim-runc-v2 .*-address $SOCK.*" 2>/dev/null || true); do
    kill -KILL "$p" 2>/dev/null && n=$((n + 1))
  done
  [[ $n -gt 0 ]] && log "killed $n leftover containerd shims" || true
}

unmount_all() {  # everything mounted under our state dir (pod volumes, netns, rootfs), deepest first
  local m n=0
  while read -r m; do umount -l "$m" 2>/dev/null && n=$((n + 1)); done < <(
    awk -v p="$N/" 'index($5, p) == 1 {print $5}' /proc/self/mountinfo | sort -r)
  log "unmounted $n mounts under $N"
}

rmdir_cgroups() {  # the kubelet's kubepods hierarchy in each cgroup v1 controller, once empty
  local d
  for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
    [[ -d "$d" ]] && find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true
  done
}

status() {
  local c
  for c in containerd kubelet coredns kube-proxy; do
    if alive "$c"; then echo "node $c: running (pid $(pid_of "$c"))"; else echo "node $c: stopped"; fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  runtime) runtime_up ;;   # bridge, containerd and the images only (debugging)
  import) alive containerd || die "containerd is not running"; import_images ;;
  routes) routes && echo "routes ok: $NODE_POD_CIDR and $SERVICE_CIDR via $NODE_BRIDGE" ;;
  *) echo "usage: $0 up|down|status|routes" >&2; exit 2 ;;
esac
