# shellcheck shell=bash
# The real node's network, sourced by e2e/node.sh (which defines N, log, die, start, stop, wait_for): the
# bridge, the route check, the one NAT rule to the API server, kube-proxy (ClusterIP Services for pods) and
# the snapshot of the host's sysctls, iptables and nfacct objects that `down` restores and compares against.
#
# Safety (docs/e2e.md, "Services from pods: kube-proxy"): forwarding is enabled on the bridge only
# (net.ipv4.conf.$NODE_BRIDGE.forwarding, never the global ip_forward), and only once PDC-NODE-FWD, which
# drops anything between the bridge and another interface, is the first rule of FORWARD; kube-proxy runs in
# iptables mode with masqueradeAll (a pod -> ClusterIP -> pod packet is routed back out of the bridge with
# the bridge's own address as source, so the reply returns through the host's conntrack), node ports only on
# the bridge address, no localhost node ports (no global route_localnet) and conntrack sysctls left alone.

KUBE_PROXY_HEALTH_PORT=$((PORT_BASE + 46)); KUBE_PROXY_METRICS_PORT=$((PORT_BASE + 47))
# global sysctls the node or kube-proxy could touch: recorded before `up`, restored by `down` if changed
HOST_SYSCTLS=(net.ipv4.ip_forward net.ipv4.conf.all.forwarding net.ipv4.conf.default.forwarding
  net.ipv4.conf.all.route_localnet net.ipv4.conf.default.route_localnet net.ipv4.conf.all.send_redirects
  net.ipv6.conf.all.forwarding net.ipv6.conf.default.forwarding net.netfilter.nf_conntrack_max
  net.netfilter.nf_conntrack_tcp_timeout_established net.netfilter.nf_conntrack_tcp_timeout_close_wait
  net.netfilter.nf_conntrack_tcp_be_liberal net.netfilter.nf_conntrack_udp_timeout
  net.netfilter.nf_conntrack_udp_timeout_stream net.bridge.bridge-nf-call-iptables
  net.bridge.bridge-nf-call-ip6tables)
FWD_FIRST="-A FORWARD -j PDC-NODE-FWD"

# ------------------------------------------------------------------------------------------ host state
ipt_rules() { "$1-save" 2>/dev/null | grep -v '^#' | sed 's/ \[[0-9]*:[0-9]*\]$//' || true; }

host_snapshot() {  # once per node lifetime, before anything is changed
  local b="$N/host-before" k v
  [[ -f "$b/sysctl" ]] && return 0
  mkdir -p "$b"
  for k in "${HOST_SYSCTLS[@]}"; do v="$(sysctl -n "$k" 2>/dev/null)" && echo "$k=$v"; done > "$b/sysctl"
  ipt_rules iptables > "$b/iptables"; ipt_rules ip6tables > "$b/ip6tables"
  python3 "$HERE/nfacct.py" list > "$b/nfacct"
}

# kube-proxy's nfacct counters (kernel objects that outlive it), once no rule uses them; not those from before
nfacct_down() {
  local name
  for name in $(python3 "$HERE/nfacct.py" list | grep -vxF -f <(cat "$N/host-before/nfacct" 2>/dev/null; echo '^$')); do
    python3 "$HERE/nfacct.py" delete "$name" && removed+=("nfacct $name")
  done
}

host_restore() {  # sysctls back to their recorded values; iptables compared with the recorded rules
  local b="$N/host-before" k v cur ipt changed=()
  [[ -f "$b/sysctl" ]] || { log "no host snapshot (node made before it existed): nothing to compare"; return 0; }
  while IFS='=' read -r k v; do
    cur="$(sysctl -n "$k" 2>/dev/null)" || continue
    [[ "$cur" == "$v" ]] || { sysctl -qw "$k=$v" && changed+=("$k $cur -> $v"); }
  done < "$b/sysctl"
  if [[ ${#changed[@]} -gt 0 ]]; then log "sysctls restored: ${changed[*]}"
  else log "sysctls as before up (${#HOST_SYSCTLS[@]} checked)"; fi
  for ipt in iptables ip6tables; do
    if diff -q "$b/$ipt" <(ipt_rules "$ipt") >/dev/null; then log "$ipt rules as before up"
    else log "WARNING: $ipt rules differ from before up:"; diff "$b/$ipt" <(ipt_rules "$ipt") >&2 || true; fi
  done
  if diff -q "$b/nfacct" <(python3 "$HERE/nfacct.py" list) >/dev/null; then log "nfacct objects as before up"
  else log "WARNING: nfacct objects differ from before up: $(python3 "$HERE/nfacct.py" list | tr '\n' ' ')"; fi
}

# ------------------------------------------------------------------------------------------ routes
# Every address a pod or Service gets must route through the bridge; checked before any traffic is sent.
# While the bridge forwards, PDC-NODE-FWD must come first in FORWARD (kube-proxy prepends its own jumps).
routes() {
  local a dev bad=0
  for a in "$NODE_IP" "${NODE_POD_CIDR%.*}.10" "${NODE_POD_CIDR%.*}.250" "$KUBERNETES_SVC_IP" "$(last_svc_ip)"; do
    dev="$(ip -4 route get "$a" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -1)"
    if [[ "$a" == "$NODE_IP" ]]; then [[ "$dev" == lo || "$dev" == "$NODE_BRIDGE" ]] || { log "route to $a goes via '$dev'"; bad=1; }
    elif [[ "$dev" != "$NODE_BRIDGE" ]]; then log "route to $a goes via '$dev', not $NODE_BRIDGE"; bad=1; fi
  done
  if [[ "$(sysctl -n "net.ipv4.conf.$NODE_BRIDGE.forwarding" 2>/dev/null)" == 1 ]]; then
    [[ "$(iptables -S FORWARD | sed -n 2p)" == "$FWD_FIRST" ]] \
      || { log "$NODE_BRIDGE forwards but PDC-NODE-FWD is not the first rule of FORWARD"; bad=1; }
    [[ "$(iptables -S PDC-NODE-FWD 2>/dev/null | grep -c -- '-j DROP')" == 2 ]] \
      || { log "PDC-NODE-FWD lacks its two DROP rules"; bad=1; }
  fi
  return $bad
}
last_svc_ip() { python3 -c "import ipaddress,sys; print(ipaddress.ip_network(sys.argv[1])[-2])" "$SERVICE_CIDR"; }

# PDC-NODE-FWD at position 1 of FORWARD: inserted first, then any later copy removed (never a moment without it)
fwd_first() {
  [[ "$(iptables -S FORWARD | sed -n 2p)" == "$FWD_FIRST" ]] && return 0
  iptables -I FORWARD 1 -j PDC-NODE-FWD
  iptables -L FORWARD --line-numbers -n | awk '$2 == "PDC-NODE-FWD" && $1 > 1 {print $1}' | sort -rn \
    | while read -r i; do iptables -D FORWARD "$i"; done
}

net_up() {
  host_snapshot
  if ip link show "$NODE_BRIDGE" >/dev/null 2>&1; then
    [[ -f "$N/bridge.owner" ]] || die "$NODE_BRIDGE exists but was not made by this cluster ($N); refusing to touch it"
  else
    # the ranges must be unused on this machine: no route other than the default may cover them
    local r
    r="$(ip -4 route show | grep -v '^default' | awk '{print $1}' | while read -r net; do
          python3 -c "import ipaddress,sys; a=ipaddress.ip_network(sys.argv[1],False); print(sys.argv[1]) if any(a.overlaps(ipaddress.ip_network(x)) for x in sys.argv[2:]) else None" \
            "$net" "$NODE_POD_CIDR" "$SERVICE_CIDR"; done | grep -v None || true)"
    [[ -z "$r" ]] || die "routes $r overlap the node's ranges ($NODE_POD_CIDR, $SERVICE_CIDR); set PDCLUSTER_NODE_NET"
    mkdir -p "$N"
    ip link add "$NODE_BRIDGE" type bridge
    echo "$DIR" > "$N/bridge.owner"
    ip addr add "$NODE_IP/24" dev "$NODE_BRIDGE"
    ip link set "$NODE_BRIDGE" up
    ip route add "$SERVICE_CIDR" dev "$NODE_BRIDGE"
    log "bridge $NODE_BRIDGE $NODE_IP/24, route $SERVICE_CIDR dev $NODE_BRIDGE"
  fi
  # forwarding stays off on the bridge until kube-proxy has synced and PDC-NODE-FWD is first (proxy_up)
  sysctl -qw "net.ipv4.conf.$NODE_BRIDGE.forwarding=0"
  # pods reach the API server (127.0.0.1) through the `kubernetes` Service: DNAT to loopback, which the
  # kernel accepts from this bridge only (route_localnet on this interface, not globally). The Service has
  # no endpoints (loopback ones are refused), so kube-proxy leaves it to this rule.
  sysctl -qw "net.ipv4.conf.$NODE_BRIDGE.route_localnet=1"
  iptables -t nat -N PDC-NODE 2>/dev/null || iptables -t nat -F PDC-NODE
  iptables -t nat -A PDC-NODE -d "$KUBERNETES_SVC_IP/32" -p tcp --dport 443 -j DNAT --to-destination "127.0.0.1:$API_PORT"
  iptables -t nat -C PREROUTING -i "$NODE_BRIDGE" -j PDC-NODE 2>/dev/null \
    || iptables -t nat -I PREROUTING -i "$NODE_BRIDGE" -j PDC-NODE
  # nothing is forwarded between the bridge and any other interface: only bridge -> host -> bridge
  iptables -N PDC-NODE-FWD 2>/dev/null || iptables -F PDC-NODE-FWD
  iptables -A PDC-NODE-FWD -i "$NODE_BRIDGE" ! -o "$NODE_BRIDGE" -j DROP
  iptables -A PDC-NODE-FWD -o "$NODE_BRIDGE" ! -i "$NODE_BRIDGE" -j DROP
  fwd_first
  routes || die "a pod/service address does not route via $NODE_BRIDGE; stopping before any traffic"
}

# ------------------------------------------------------------------------------------------ kube-proxy
proxy_up() {
  cat > "$N/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: $DIR/kube-proxy.kubeconfig}
hostnameOverride: $NODE_NAME
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:$KUBE_PROXY_HEALTH_PORT
metricsBindAddress: 127.0.0.1:$KUBE_PROXY_METRICS_PORT
mode: iptables
# masqueradeAll: pod -> ClusterIP -> pod on the same bridge needs the reply to come back through the host
# (the endpoint would otherwise answer the client directly, from its own address); no br_netfilter tricks.
# localhostNodePorts false: no global net.ipv4.conf.all.route_localnet.
iptables: {masqueradeAll: true, localhostNodePorts: false, syncPeriod: 30s, minSyncPeriod: 1s}
detectLocalMode: ClusterCIDR
clusterCIDR: $NODE_POD_CIDR
# node ports (none are used) only on the bridge's own address
nodePortAddresses: [$NODE_IP/32]
# kube-proxy's default -999 is denied in this VM (as the sandboxes' -998 was); 0 leaves it as it is
oomScoreAdj: 0
# 0 = leave the host's conntrack table size and timeouts alone (the defaults would rewrite four sysctls)
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
  start kube-proxy "$BIN/kube-proxy-$K8S_VERSION" --config "$N/kube-proxy.yaml"
  # healthz answers 200 once the first sync wrote the rules; then its jumps are in FORWARD
  wait_for kube-proxy 90 proxy_synced || die "kube-proxy did not sync; see $DIR/logs/kube-proxy.log"
  fwd_first
  routes || die "routes or FORWARD order wrong before enabling forwarding; stopping"
  sysctl -qw "net.ipv4.conf.$NODE_BRIDGE.forwarding=1"
  log "forwarding on $NODE_BRIDGE only (global ip_forward=$(sysctl -n net.ipv4.ip_forward)), PDC-NODE-FWD first"
}
proxy_synced() {
  curl -fsS --max-time 2 "http://127.0.0.1:$KUBE_PROXY_HEALTH_PORT/healthz" >/dev/null \
    && iptables -S FORWARD | grep -q -- '-j KUBE-FORWARD'
}

# ------------------------------------------------------------------------------------------ teardown
# Every KUBE-* chain (the kubelet's and kube-proxy's) and every jump to one from a built-in chain, in both
# families, one iptables-restore per table. `kube-proxy --cleanup` is not used: it runs `modprobe ip_vs`.
# Chains that existed before `up` (the snapshot) are left alone.
kube_chains_down() {
  local ipt t save chains c keep script n
  for ipt in iptables ip6tables; do
    command -v "$ipt-save" >/dev/null || continue
    keep="$(grep -o '^:KUBE-[^ ]*' "$N/host-before/$ipt" 2>/dev/null | cut -c2- || true)"
    for t in filter nat mangle; do
      save="$("$ipt-save" -t "$t" 2>/dev/null)" || continue
      chains="$(grep -o '^:KUBE-[^ ]*' <<<"$save" | cut -c2- | grep -vxF -f <(echo "${keep:-^$}") || true)"
      [[ -n "$chains" ]] || continue
      n="$(wc -l <<<"$chains")"
      script="*$t"$'\n'
      script+="$(grep -E '^-A (PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) .*-j KUBE-' <<<"$save" | sed 's/^-A /-D /' || true)"$'\n'
      for c in $chains; do script+="-F $c"$'\n'; done
      for c in $chains; do script+="-X $c"$'\n'; done
      "$ipt-restore" --noflush <<<"${script}COMMIT" && removed+=("$ipt $t: $n KUBE-* chains")
    done
  done
}

net_down() {
  local removed=()
  # forwarding off first, so no moment exists with forwarding on and PDC-NODE-FWD gone
  sysctl -qw "net.ipv4.conf.$NODE_BRIDGE.forwarding=0" 2>/dev/null && removed+=("forwarding on $NODE_BRIDGE")
  kube_chains_down
  nfacct_down
  iptables -t nat -D PREROUTING -i "$NODE_BRIDGE" -j PDC-NODE 2>/dev/null && removed+=("nat PREROUTING jump")
  iptables -t nat -F PDC-NODE 2>/dev/null && iptables -t nat -X PDC-NODE 2>/dev/null && removed+=("nat PDC-NODE")
  while iptables -D FORWARD -j PDC-NODE-FWD 2>/dev/null; do :; done
  iptables -F PDC-NODE-FWD 2>/dev/null && iptables -X PDC-NODE-FWD 2>/dev/null && removed+=("filter PDC-NODE-FWD")
  if ip link show "$NODE_BRIDGE" >/dev/null 2>&1 && [[ -f "$N/bridge.owner" ]]; then
    ip link del "$NODE_BRIDGE" && removed+=("bridge $NODE_BRIDGE (and its routes)")
  fi
  log "network removed: $( ((${#removed[@]})) && printf '%s; ' "${removed[@]}" || echo "nothing left")"
  host_restore
}
