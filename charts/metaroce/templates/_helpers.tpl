{{/* Names and labels shared by every template. */}}
{{- define "metaroce.fullname" -}}
{{- printf "%s-metaroce" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "metaroce.labels" -}}
app.kubernetes.io/name: metaroce
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "metaroce.operatorSelector" -}}
app.kubernetes.io/name: metaroce
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Images: pinned by tag, the chart's appVersion unless a tag is given. */}}
{{- define "metaroce.operatorImage" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{- define "metaroce.agentImage" -}}
{{- printf "%s:%s" .Values.agent.image.repository (default .Chart.AppVersion .Values.agent.image.tag) -}}
{{- end -}}

{{- define "metaroce.webhookService" -}}
{{- printf "%s-webhook" (include "metaroce.fullname" .) -}}
{{- end -}}

{{- define "metaroce.certSecret" -}}
{{- printf "%s-webhook-tls" (include "metaroce.fullname" .) -}}
{{- end -}}
