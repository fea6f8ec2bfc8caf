{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "pdcluster-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name alone when it already contains the chart name. */}}
{{- define "pdcluster-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdcluster-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades. */}}
{{- define "pdcluster-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcluster-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pdcluster-operator.labels" -}}
helm.sh/chart: {{ include "pdcluster-operator.chart" . }}
{{ include "pdcluster-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdcluster
{{- end }}

{{- define "pdcluster-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdcluster-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pdcluster-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* "true" when the operator runs as active/standby replicas through kopf peering (replicaCount >= 2). */}}
{{- define "pdcluster-operator.ha" -}}
{{- if ge (int .Values.replicaCount) 2 }}true{{ end }}
{{- end }}

{{/* The kopf peering object: a ClusterKopfPeering, or a KopfPeering in each watched namespace. */}}
{{- define "pdcluster-operator.peeringName" -}}
{{- include "pdcluster-operator.fullname" . }}
{{- end }}
