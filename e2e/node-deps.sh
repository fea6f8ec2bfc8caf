#!/usr/bin/env bash
# Install the Debian packages the real node and the image build need (once; a no-op when present):
#   containerd, runc, containernetworking-plugins (the node), buildah + debootstrap (the images),
#   iptables (the node's one NAT rule: pods -> the API server on loopback, see docs/e2e.md).
# Needs root and apt. No service is started: e2e/node.sh runs its own containerd with its own
# config, root, state and socket.
set -euo pipefail
PKGS=(containerd runc containernetworking-plugins buildah debootstrap iptables)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
[[ $EUID -eq 0 ]] || { echo "node-deps.sh: installing ${missing[*]} needs root" >&2; exit 1; }
echo "[node-deps] apt-get install ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
# policy-rc.d 101: a package's postinst must not start a system containerd beside ours
had_policy=0; [[ -e /usr/sbin/policy-rc.d ]] && had_policy=1
if [[ $had_policy -eq 0 ]]; then printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; fi
rc=0
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
[[ $had_policy -eq 0 ]] && rm -f /usr/sbin/policy-rc.d
exit $rc
