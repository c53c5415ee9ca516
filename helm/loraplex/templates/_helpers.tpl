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
