{{/* The install notes (NOTES.txt renders them; tests/helm renders them from a packaged chart too). */}}
{{- define "pdcluster-operator.notes" -}}
{{- $name := include "pdcluster-operator.fullname" . -}}
The pdcluster operator {{ .Chart.AppVersion }} is installed in namespace {{ .Release.Namespace }}
{{- if .Values.operator.watchNamespaces }} and watches: {{ join ", " .Values.operator.watchNamespaces }}.
{{- else }} and watches all namespaces.
{{- end }}
{{- if eq (int .Values.replicaCount) 0 }}
It is paused (replicaCount: 0): nothing is reconciled.
{{- else if include "pdcluster-operator.ha" . }}
{{ .Values.replicaCount }} replicas, one active (kopf peering object {{ include "pdcluster-operator.peeringName" . }}):
  kubectl get {{ if .Values.operator.watchNamespaces }}kopfpeerings -A{{ else }}clusterkopfpeerings{{ end }} {{ include "pdcluster-operator.peeringName" . }} -o yaml
{{- end }}

Create a PDCluster (its pods run pdcluster/worker:{{ .Chart.AppVersion }} unless spec.image names another image):
  kubectl apply -n {{ if .Values.operator.watchNamespaces }}{{ first .Values.operator.watchNamespaces }}{{ else }}default{{ end }} -f - <<'YAML'
  apiVersion: pdcluster.dev/v1alpha1
  kind: PDCluster
  metadata:
    name: demo
  spec:
    model:
      name: my-model
      uri: pvc://models/my-model   # or hostpath:///DIR, file:///DIR inside the image
  YAML
  kubectl get pdc -A
  kubectl explain pdcluster.spec

Operator logs:
  kubectl logs -n {{ .Release.Namespace }} deploy/{{ $name }}
{{- if .Values.metrics.podMonitor.enabled }}

Workers and routers are scraped through the PodMonitor {{ $name }}-workloads (labels `pdcluster`, `role`).
{{- end }}

The CRDs are installed on first install only (Helm never upgrades or deletes CRDs); after `helm upgrade`:
  helm show crds {{ .Chart.Name }} --version {{ .Chart.Version }} | kubectl apply --server-side -f -
(with the chart's path or .tgz in place of {{ .Chart.Name }} when it is not from a repository)
{{- end }}
