#!/usr/bin/env bash
# End to end on a kind cluster (for users with Docker): create the cluster, build and `kind load` the operator
# and worker images (the same docker/*.Dockerfile that e2e/images.sh builds with buildah), `helm install` the chart, apply the CPU example, wait for the PDCluster to be Ready,
# send a completion through the router Service and check the answer. `--keep` leaves the cluster up.
#
#   e2e/kind/run.sh [--keep]
# Needs: docker, kind, kubectl, helm on PATH (helm/kubectl: e2e/build.sh builds the pinned ones; this
# script puts them on PATH when they are in the cache).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
KEEP=0; [[ "${1:-}" == "--keep" ]] && KEEP=1
CLUSTER=pdcluster-e2e
NS=pdcluster-system
APP_NS=pdcluster-e2e
TAG="${PDCLUSTER_IMAGE_TAG:-e2e}"
OP_IMAGE="pdcluster/operator:$TAG"
WORKER_IMAGE="pdcluster/worker:$TAG"
EXAMPLE="${PDCLUSTER_EXAMPLE:-examples/pdcluster-cpu.yaml}"

log() { printf '[kind-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# the pinned helm/kubectl from e2e/build.sh, when present
if BIN="$(e2e/build.sh --print-bin-dir 2>/dev/null)" && [[ -d "$BIN" ]]; then
  source e2e/versions.env
  TOOLS="$(mktemp -d)"; trap 'rm -rf "$TOOLS"' EXIT
  [[ -x "$BIN/helm-$HELM_VERSION" ]] && ln -s "$BIN/helm-$HELM_VERSION" "$TOOLS/helm"
  [[ -x "$BIN/kubectl-$K8S_VERSION" ]] && ln -s "$BIN/kubectl-$K8S_VERSION" "$TOOLS/kubectl"
  export PATH="$TOOLS:$PATH"
fi
for t in docker kind kubectl helm; do
  command -v "$t" >/dev/null || { echo "e2e-kind needs $t on PATH" >&2; exit 1; }
done

dump() {
  log "FAILED: dumping state"
  kubectl -n "$NS" logs deploy/pdcluster-operator --tail=200 || true
  kubectl -n "$APP_NS" get all,pdc -o wide || true
  kubectl -n "$APP_NS" describe pdc || true
  kubectl get events -A --sort-by=.lastTimestamp | tail -50 || true
}
PF=""
cleanup() {
  local rc=$?
  [[ -n "$PF" ]] && kill "$PF" 2>/dev/null
  [[ $rc -ne 0 ]] && dump
  if [[ $KEEP -eq 0 ]]; then kind delete cluster --name "$CLUSTER" || true; fi
  exit $rc
}

log "creating kind cluster $CLUSTER"
kind get clusters 2>/dev/null | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --config e2e/kind/config.yaml --wait 120s
trap cleanup EXIT
kubectl config use-context "kind-$CLUSTER" >/dev/null

log "building images"
DOCKER_BUILDKIT=1 docker build -f docker/operator.Dockerfile -t "$OP_IMAGE" .
DOCKER_BUILDKIT=1 docker build -f docker/worker.Dockerfile -t "$WORKER_IMAGE" .
kind load docker-image --name "$CLUSTER" "$OP_IMAGE" "$WORKER_IMAGE"

log "installing the chart"
helm upgrade --install pdcluster-operator helm/pdcluster-operator -n "$NS" --create-namespace \
  --set image.repository="${OP_IMAGE%:*}" --set image.tag="$TAG" --set image.pullPolicy=Never --wait --timeout 180s

log "applying $EXAMPLE (image $WORKER_IMAGE)"
kubectl create namespace "$APP_NS" --dry-run=client -o yaml | kubectl apply -f -
NAME="$(python3 -c 'import sys,yaml; print(yaml.safe_load(open(sys.argv[1]))["metadata"]["name"])' "$EXAMPLE")"
python3 - "$EXAMPLE" "$WORKER_IMAGE" <<'PY' | kubectl -n "$APP_NS" apply -f -
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc["spec"]["image"] = sys.argv[2]
doc["metadata"].pop("namespace", None)
print(yaml.safe_dump(doc))
PY
kubectl -n "$APP_NS" wait "pdc/$NAME" --for=condition=Ready --timeout=600s
kubectl -n "$APP_NS" get pdc,deploy,svc,pods

log "sending a completion through the router Service"
kubectl -n "$APP_NS" port-forward "svc/$NAME-router" 18080:8000 >/dev/null 2>&1 &
PF=$!
for _ in $(seq 1 30); do curl -fsS http://127.0.0.1:18080/health >/dev/null 2>&1 && break; sleep 1; done
MODEL="$(curl -fsS http://127.0.0.1:18080/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
ANSWER="$(curl -fsS http://127.0.0.1:18080/v1/completions -H 'content-type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello, my name is\", \"max_tokens\": 8, \"temperature\": 0, \"return_token_ids\": true}")"
echo "$ANSWER"
python3 - "$ANSWER" <<'PY'
import json, sys
r = json.loads(sys.argv[1])
c = r["choices"][0]
assert r["usage"]["completion_tokens"] >= 1, r
assert c.get("token_ids") or c["text"], r
print("kind e2e: completion OK:", repr(c["text"]))
PY
log "PASSED"
