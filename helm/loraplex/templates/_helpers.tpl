{{- define "loraplex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.labels" -}}
{{ include "loraplex.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "loraplex.secretName" -}}
{{- default (include "loraplex.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "loraplex.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "loraplex.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "loraplex.poolLabels" -}}
{{ include "loraplex.selectorLabels" . }}
inference.loraplex.io/pool: {{ include "loraplex.fullname" . }}
{{- end -}}

{{- define "loraplex.eppName" -}}
{{- default (printf "%s-epp" (include "loraplex.fullname" .)) .Values.inferencePool.endpointPicker.serviceName | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.eppSelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}-epp
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "loraplex.vllmName" -}}
{{- printf "%s-vllm" (include "loraplex.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplex.vllmSelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplex.name" . }}-vllm
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- /* The vLLM servers' URLs (and their agents'), comma-separated: each StatefulSet pod by its
stable name under the headless Service, or the URLs given. */ -}}
{{- define "loraplex.vllmUrls" -}}
{{- $v := .Values.dataPlane.vllm -}}
{{- if $v.deploy -}}
{{- $name := include "loraplex.vllmName" . -}}
{{- $urls := list -}}
{{- range $i := until (int $v.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int $v.port)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- join "," $v.urls -}}
{{- end -}}
{{- end -}}

{{- define "loraplex.vllmAgentUrls" -}}
{{- $v := .Values.dataPlane.vllm -}}
{{- if $v.deploy -}}
{{- $name := include "loraplex.vllmName" . -}}
{{- $urls := list -}}
{{- range $i := until (int $v.replicas) -}}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc:%d" $name $i $name $.Release.Namespace (int $v.agent.port)) -}}
{{- end -}}
{{- join "," $urls -}}
{{- else -}}
{{- join "," $v.agentUrls -}}
{{- end -}}
{{- end -}}
