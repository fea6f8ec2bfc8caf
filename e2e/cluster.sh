#!/usr/bin/env bash
# A real Kubernetes control plane on loopback, with kwok simulating nodes and pods, and one real node
# (kubelet + containerd + kube-proxy on a bridge of its own, e2e/node.sh) when run as root with the node's
# packages.
#
#   e2e/cluster.sh up       build (first time; cached by version), start etcd, kube-apiserver,
#                           kube-controller-manager, kube-scheduler and kwok, create fake GPU nodes;
#                           idempotent: a running cluster is reused. Last line: `export KUBECONFIG=<path>`.
#   e2e/cluster.sh down     stop every process `up` started (by pid) and delete the cluster's state; the real
#                           node's sysctls and iptables go back to what they were before `up`.
#   e2e/cluster.sh status   which components run (exit 0 when the API server is ready).
#   e2e/cluster.sh routes   assert that every pod/service address of the real node routes via its bridge
#                           (and, while the bridge forwards, that PDC-NODE-FWD is first in FORWARD).
#   e2e/cluster.sh env      print `export KUBECONFIG=...` and `export PATH=<bin dir>:$PATH`.
#
# Nothing listens off loopback: every component binds 127.0.0.1. Certificates and the service-account key
# pair are generated with openssl in the state dir; RBAC is on.
# Environment: PDCLUSTER_CACHE (binaries; default ~/.cache/pdcluster), PDCLUSTER_CLUSTER_DIR (state; default
# $PDCLUSTER_CACHE/cluster), PDCLUSTER_PORT_BASE (default 26400: etcd +0/+1, apiserver +43, kcm +57,
# scheduler +59, kwok +80, kubelet health +48, CoreDNS health +53, kube-proxy health +46 and metrics +47),
# PDCLUSTER_FAKE_NODES (default 3), PDCLUSTER_NODE_GPUS (default 8), PDCLUSTER_REAL_NODE (1: the real node,
# 0: kwok only; default 1 when root and containerd is installed), PDCLUSTER_NODE_NET (default 10.213: bridge 10.213.0.1/24, Services
# 10.213.128.0/20).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE="${PDCLUSTER_CACHE:-$HOME/.cache/pdcluster}"
BIN="$CACHE/bin"
DIR="${PDCLUSTER_CLUSTER_DIR:-$CACHE/cluster}"
PORT_BASE="${PDCLUSTER_PORT_BASE:-26400}"
ETCD_PORT=$((PORT_BASE + 0)); ETCD_PEER_PORT=$((PORT_BASE + 1)); API_PORT=$((PORT_BASE + 43))
KCM_PORT=$((PORT_BASE + 57)); SCHED_PORT=$((PORT_BASE + 59)); KWOK_PORT=$((PORT_BASE + 80))
NODES="${PDCLUSTER_FAKE_NODES:-3}"
GPUS="${PDCLUSTER_NODE_GPUS:-8}"
POD_CIDR=127.244.0.0/16      # kwok pods: loopback, so nothing may ever send their traffic off the machine
                             # (the operator POSTs /drain to pod IPs)
if [[ -z "${PDCLUSTER_REAL_NODE:-}" ]]; then
  if [[ $EUID -eq 0 ]] && command -v containerd >/dev/null 2>&1; then PDCLUSTER_REAL_NODE=1; else PDCLUSTER_REAL_NODE=0; fi
fi
REAL_NODE="$PDCLUSTER_REAL_NODE"
NODE_NET="${PDCLUSTER_NODE_NET:-10.213}"
if [[ "$REAL_NODE" == 1 ]]; then
  # pods of the real node need Service addresses that are not loopback (127/8 never leaves a pod's own
  # netns): a range routed to the node's bridge only (e2e/node.sh checks the routes before any traffic)
  SERVICE_CIDR="$NODE_NET.128.0/20"; KUBERNETES_SVC_IP="$NODE_NET.128.1"
else
  SERVICE_CIDR=127.96.0.0/16; KUBERNETES_SVC_IP=127.96.0.1
fi
export DIR BIN API_PORT PORT_BASE SERVICE_CIDR KUBERNETES_SVC_IP KUBECONFIG_PATH="$DIR/admin.kubeconfig"
export NODE_BRIDGE="${PDCLUSTER_NODE_BRIDGE:-pdc0}" NODE_IP="$NODE_NET.0.1" NODE_POD_CIDR="$NODE_NET.0.0/24"
KUBECONFIG_PATH="$DIR/admin.kubeconfig"
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)

log() { printf '[cluster %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bin_of() {  # component -> versioned binary path
  case "$1" in
    etcd) echo "$BIN/etcd-$ETCD_VERSION" ;;
    kwok) echo "$BIN/kwok-$KWOK_VERSION" ;;
    helm) echo "$BIN/helm-$HELM_VERSION" ;;
    *) echo "$BIN/$1-$K8S_VERSION" ;;
  esac
}

# A directory with unversioned names (kubectl, helm, ...) pointing at the pinned binaries, for PATH.
link_tools() {
  mkdir -p "$DIR/bin"
  local c
  for c in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm; do
    [[ -x "$(bin_of "$c")" ]] && ln -sfn "$(bin_of "$c")" "$DIR/bin/$c"
  done
  return 0
}

kc() { "$(bin_of kubectl)" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

pid_alive() {  # component -> 0 if its recorded pid runs our binary
  local f="$DIR/run/$1.pid" pid exe
  [[ -f "$f" ]] || return 1
  pid="$(cat "$f")"
  [[ -n "$pid" && -d "/proc/$pid" ]] || return 1
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null || true)"
  [[ "$exe" == "$(readlink -f "$(bin_of "$1")")" ]]
}

api_ready() {
  curl -fsS --max-time 3 --cacert "$DIR/pki/ca.crt" --cert "$DIR/pki/admin.crt" --key "$DIR/pki/admin.key" \
    "https://127.0.0.1:$API_PORT/readyz" >/dev/null 2>&1
}

wait_for() {  # description timeout_s command...
  local what="$1" t="$2"; shift 2
  local end=$((SECONDS + t))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < end)) || return 1
    sleep 0.5
  done
  log "$what ready"
}

# ---------------------------------------------------------------- certificates
gen_pki() {
  local p="$DIR/pki"
  [[ -f "$p/.done" ]] && return 0
  log "generating certificates and service-account keys in $p"
  rm -rf "$p" && mkdir -p "$p" && chmod 700 "$p"
  (
    cd "$p"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 \
      -subj "/CN=pdcluster-e2e-ca" >/dev/null 2>&1
    openssl genrsa -out sa.key 2048 >/dev/null 2>&1
    openssl rsa -in sa.key -pubout -out sa.pub >/dev/null 2>&1
    cat > server.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=IP:127.0.0.1,IP:127.96.0.1,IP:$KUBERNETES_SVC_IP,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
EOF
    cat > client.ext <<EOF
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=clientAuth
EOF
    sign() {  # name subject extfile
      openssl req -new -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" >/dev/null 2>&1
      openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$1.crt" -days 3650 \
        -extfile "$3" >/dev/null 2>&1
      rm -f "$1.csr"
    }
    sign apiserver "/CN=kube-apiserver" server.ext
    # The admin and the control-plane components are members of system:masters (a throw-away test cluster);
    # the operator under test never uses these: it authenticates with a ServiceAccount token.
    sign admin "/O=system:masters/CN=pdcluster-e2e-admin" client.ext
    sign controller-manager "/O=system:masters/CN=system:kube-controller-manager" client.ext
    sign scheduler "/O=system:masters/CN=system:kube-scheduler" client.ext
    sign kwok "/O=system:masters/CN=kwok" client.ext
    # the real node: the kubelet as a node (Node authorizer), the API server's client cert for the kubelet
    # (logs, exec, port-forward), CoreDNS (reads Services and EndpointSlices), kube-proxy (the user the
    # default `system:node-proxier` ClusterRoleBinding names)
    sign kubelet "/O=system:nodes/CN=system:node:${PDCLUSTER_NODE_NAME:-pdc-node-0}" client.ext
    sign apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" client.ext
    sign coredns "/O=system:masters/CN=coredns" client.ext
    sign kube-proxy "/CN=system:kube-proxy" client.ext
    touch .done
  )
}

write_kubeconfig() {  # file user
  cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: pdcluster-e2e
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $DIR/pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $DIR/pki/$2.crt
    client-key: $DIR/pki/$2.key
contexts:
- name: pdcluster-e2e
  context: {cluster: pdcluster-e2e, user: $2}
current-context: pdcluster-e2e
EOF
  chmod 600 "$1"
}

# ---------------------------------------------------------------- processes
start() {  # component args...
  local c="$1"; shift
  if pid_alive "$c"; then log "$c already running (pid $(cat "$DIR/run/$c.pid"))"; return 0; fi
  mkdir -p "$DIR/run" "$DIR/logs"
  # setsid: own session, so the component survives the shell (and pytest) that started it and a
  # Ctrl-C in the calling terminal does not reach it; `down` stops it by pid.
  setsid "$(bin_of "$c")" "$@" </dev/null >>"$DIR/logs/$c.log" 2>&1 &
  echo $! > "$DIR/run/$c.pid"
  log "$c started (pid $!, log $DIR/logs/$c.log)"
}

stop() {  # component
  local c="$1" f="$DIR/run/$1.pid" pid i
  [[ -f "$f" ]] || return 0
  pid="$(cat "$f")"
  if pid_alive "$c"; then
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 40); do [[ -d "/proc/$pid" ]] || break; sleep 0.25; done
    if [[ -d "/proc/$pid" ]]; then kill -KILL "$pid" 2>/dev/null || true; sleep 0.2; fi
    log "$c stopped (pid $pid)"
  fi
  rm -f "$f"
}

fake_nodes() {
  local i manifest=""
  for i in $(seq 0 $((NODES - 1))); do
    manifest+="---
apiVersion: v1
kind: Node
metadata:
  name: kwok-gpu-$i
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: \"0\"
  labels:
    kubernetes.io/arch: amd64
    kubernetes.io/os: linux
    kubernetes.io/hostname: kwok-gpu-$i
    kubernetes.io/role: agent
    node-role.kubernetes.io/agent: \"\"
    type: kwok
    nvidia.com/gpu.present: \"true\"
spec: {}
status:
  allocatable: {cpu: \"64\", memory: 512Gi, pods: \"110\", nvidia.com/gpu: \"$GPUS\", ephemeral-storage: 1Ti}
  capacity: {cpu: \"64\", memory: 512Gi, pods: \"110\", nvidia.com/gpu: \"$GPUS\", ephemeral-storage: 1Ti}
  nodeInfo: {architecture: amd64, operatingSystem: linux, kubeletVersion: fake, kubeProxyVersion: fake}
"
  done
  printf '%s' "$manifest" | kc apply -f - >/dev/null
}

up() {
  local t0=$SECONDS t
  for t in openssl curl setsid; do
    command -v "$t" >/dev/null || die "$t is required (Debian: apt-get install openssl curl util-linux)"
  done
  "$HERE/build.sh" all >&2
  mkdir -p "$DIR"
  link_tools
  if api_ready && pid_alive kube-controller-manager && pid_alive kube-scheduler && pid_alive kwok \
     && { [[ "$REAL_NODE" != 1 ]] || [[ "$("$HERE/node.sh" status)" == *"kubelet: running"*"kube-proxy: running"* ]]; }; then
    log "cluster already running (reused)"
    if [[ "$REAL_NODE" == 1 ]]; then "$HERE/node.sh" import; fi
    echo "export KUBECONFIG=$KUBECONFIG_PATH"
    return 0
  fi
  gen_pki
  write_kubeconfig "$KUBECONFIG_PATH" admin
  write_kubeconfig "$DIR/controller-manager.kubeconfig" controller-manager
  write_kubeconfig "$DIR/scheduler.kubeconfig" scheduler
  write_kubeconfig "$DIR/kwok.kubeconfig" kwok
  write_kubeconfig "$DIR/kubelet.kubeconfig" kubelet
  write_kubeconfig "$DIR/coredns.kubeconfig" coredns
  write_kubeconfig "$DIR/kube-proxy.kubeconfig" kube-proxy

  start etcd --name pdcluster-e2e --data-dir "$DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "pdcluster-e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
    --unsafe-no-fsync --quota-backend-bytes 2147483648 --log-level warn
  wait_for etcd 30 curl -fsS --max-time 2 "http://127.0.0.1:$ETCD_PORT/health" \
    || die "etcd did not become healthy; see $DIR/logs/etcd.log"

  start kube-apiserver \
    --etcd-servers "http://127.0.0.1:$ETCD_PORT" \
    --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$API_PORT" \
    --tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
    --client-ca-file "$DIR/pki/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$DIR/pki/sa.pub" --service-account-signing-key-file "$DIR/pki/sa.key" \
    --authorization-mode Node,RBAC --anonymous-auth=false \
    --enable-admission-plugins PodNodeSelector,PodTolerationRestriction \
    --kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types InternalIP \
    --service-cluster-ip-range "$SERVICE_CIDR" --allow-privileged=true \
    --enable-priority-and-fairness=false --profiling=false \
    --endpoint-reconciler-type none
  wait_for kube-apiserver 120 api_ready || die "kube-apiserver not ready; see $DIR/logs/kube-apiserver.log"

  start kube-controller-manager \
    --kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$KCM_PORT" --leader-elect=false \
    --service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
    --cluster-cidr "$POD_CIDR" --service-cluster-ip-range "$SERVICE_CIDR" \
    --concurrent-gc-syncs 5
  start kube-scheduler \
    --kubeconfig "$DIR/scheduler.kubeconfig" \
    --authentication-kubeconfig "$DIR/scheduler.kubeconfig" \
    --authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
    --bind-address 127.0.0.1 --secure-port "$SCHED_PORT" --leader-elect=false
  start kwok \
    --kubeconfig "$DIR/kwok.kubeconfig" \
    --config "$BIN/kwok-stages-$KWOK_VERSION.yaml" \
    --manage-all-nodes=false \
    --manage-nodes-with-annotation-selector kwok.x-k8s.io/node=fake \
    --node-ip 127.0.0.1 --cidr "$POD_CIDR" \
    --server-address "127.0.0.1:$KWOK_PORT"

  # The namespace controller and the service-account controller must have made `default`'s ServiceAccount
  # before any pod can be admitted.
  wait_for "default ServiceAccount" 60 kc get serviceaccount default -n default -o name \
    || die "kube-controller-manager did not create the default ServiceAccount; see $DIR/logs/kube-controller-manager.log"
  fake_nodes
  wait_for "fake nodes" 60 nodes_ready || die "kwok did not mark nodes Ready; see $DIR/logs/kwok.log"
  if [[ "$REAL_NODE" == 1 ]]; then "$HERE/node.sh" up || die "the real node did not come up (PDCLUSTER_REAL_NODE=0: kwok only)"; fi
  log "cluster up in $((SECONDS - t0))s (API https://127.0.0.1:$API_PORT, logs in $DIR/logs)"
  echo "export KUBECONFIG=$KUBECONFIG_PATH"
}

nodes_ready() {
  local n
  n="$(kc get nodes -l type=kwok -o jsonpath='{range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' 2>/dev/null | grep -c True || true)"
  [[ "$n" -ge "$NODES" ]]
}

down() {
  local i
  # the node first: its kubelet needs the API server to stop its pods
  if [[ -d "$DIR/node" ]]; then "$HERE/node.sh" down || log "node.sh down failed (see above)"; fi
  for ((i = ${#COMPONENTS[@]} - 1; i >= 0; i--)); do stop "${COMPONENTS[$i]}"; done
  # state (etcd data) goes too: the next `up` starts from an empty cluster. Certificates are cheap to remake.
  rm -rf "$DIR/etcd" "$DIR/run" "$DIR/pki" "$DIR"/*.kubeconfig
  log "cluster down"
}

status() {
  local c rc=0
  for c in "${COMPONENTS[@]}"; do
    if pid_alive "$c"; then echo "$c: running (pid $(cat "$DIR/run/$c.pid"))"; else echo "$c: stopped"; fi
  done
  [[ -d "$DIR/node" ]] && "$HERE/node.sh" status
  if api_ready; then echo "apiserver: ready (https://127.0.0.1:$API_PORT)"; else echo "apiserver: not ready"; rc=1; fi
  return $rc
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  routes) "$HERE/node.sh" routes ;;
  env) link_tools; echo "export PATH=$DIR/bin:\$PATH"; echo "export KUBECONFIG=$KUBECONFIG_PATH" ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
