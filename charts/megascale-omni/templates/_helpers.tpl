{{- define "omni.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "omni.fullname" -}}
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

{{- define "omni.selectorLabels" -}}
app.kubernetes.io/name: {{ include "omni.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "omni.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "omni.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: megascale-omni
{{- end }}

{{- define "omni.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "omni.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "omni.peeringName" -}}
{{- default (include "omni.fullname" .) .Values.operator.peering.name }}
{{- end }}

{{- define "omni.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The namespaces the operator watches, as JSON: operator.watchNamespaces, else the release's own
namespace; [] (every namespace, a ClusterRole) only with operator.clusterWide.
*/}}
{{- define "omni.watchNamespaces" -}}
{{- if and .Values.operator.clusterWide .Values.operator.watchNamespaces }}
{{- fail "operator.clusterWide and operator.watchNamespaces exclude each other: choose one" }}
{{- end }}
{{- if .Values.operator.clusterWide }}[]{{ else }}{{ .Values.operator.watchNamespaces | default (list .Release.Namespace) | toJson }}{{ end }}
{{- end }}
