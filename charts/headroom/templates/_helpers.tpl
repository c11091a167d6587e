{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "headroom.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Prefix of every resource name: the release name, plus the chart name unless it is already in it. */}}
{{- define "headroom.fullname" -}}
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

{{/* Labels every object carries. */}}
{{- define "headroom.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "headroom.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: headroom
{{- end }}

{{/* Labels the operator Deployment selects its pods by (immutable once installed). */}}
{{- define "headroom.selectorLabels" -}}
app.kubernetes.io/name: {{ include "headroom.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "headroom.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "headroom.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Webhook Service name; the serving certificate's DNS names are derived from it. */}}
{{- define "headroom.webhookServiceName" -}}
{{- printf "%s-webhook" (include "headroom.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Secret holding the webhook's serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "headroom.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "headroom.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "headroom.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "headroom.engineImage" -}}
{{- $engine := .Values.operator.engineImage }}
{{- printf "%s:%s" $engine.repository (default .Chart.AppVersion $engine.tag) }}
{{- end }}

{{/* Path of the mounted serving certificate inside the operator container. */}}
{{- define "headroom.webhookCertDir" -}}
/etc/headroom/webhook-tls
{{- end }}

{{/* URL path of the admission handler: kopf serves each handler at /<handler id>. */}}
{{- define "headroom.webhookPath" -}}
/validate_inferenceserver
{{- end }}
