{{/* Names and labels shared by every template. */}}
{{/* "<release>-metaroce", or the release name when it already says metaroce. */}}
{{- define "metaroce.fullname" -}}
{{- if contains "metaroce" .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-metaroce" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The namespace of the operator, its agents, the lease and the webhook Secret. */}}
{{- define "metaroce.namespace" -}}
{{- .Values.namespace.name -}}
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

{{- define "metaroce.serviceAccount" -}}
{{- include "metaroce.fullname" . -}}
{{- end -}}

{{- define "metaroce.webhookService" -}}
{{- printf "%s-webhook" (include "metaroce.fullname" .) -}}
{{- end -}}

{{- define "metaroce.certSecret" -}}
{{- printf "%s-webhook-tls" (include "metaroce.fullname" .) -}}
{{- end -}}

{{- define "metaroce.podsWebhook" -}}
{{- printf "%s-pods" (include "metaroce.fullname" .) -}}
{{- end -}}

{{- define "metaroce.networksWebhook" -}}
{{- printf "%s-networks" (include "metaroce.fullname" .) -}}
{{- end -}}

{{/*
How annotated pods are admitted: "policy" (a MutatingAdmissionPolicy per network, rendered
by the operator, run inside the apiserver; the chart's ValidatingAdmissionPolicy refuses)
or "webhook" (the operator's pod webhook). admission.mode auto: policy where the cluster
serves admissionregistration.k8s.io/v1 MutatingAdmissionPolicy (helm install/upgrade read
the cluster's API; `helm template` needs `--api-versions
admissionregistration.k8s.io/v1/MutatingAdmissionPolicy` to pick it), else webhook. Never
both: the pod webhook's configuration exists only in webhook mode.
*/}}
{{- define "metaroce.admissionMode" -}}
{{- if eq .Values.admission.mode "auto" -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}policy{{- else -}}webhook{{- end -}}
{{- else -}}
{{- .Values.admission.mode -}}
{{- end -}}
{{- end -}}

{{- define "metaroce.podsPolicy" -}}
{{- printf "%s-pods" (include "metaroce.fullname" .) -}}
{{- end -}}

{{/* The operator's fixed ports (operator/metaroce_operator/cli.py METRICS_PORT, HEALTH_PORT). */}}
{{- define "metaroce.metricsPort" -}}8080{{- end -}}
{{- define "metaroce.healthPort" -}}8081{{- end -}}

{{/*
The operator's arguments: exactly operator/metaroce_operator/cli.py chart_arguments(
namespace, agent image, fullname, webhook port, cert-manager, allowed agent images,
admission mode, image pull secrets), with
the log level from values (tests/integration/chart checks that they agree).
*/}}
{{- define "metaroce.operatorArgs" -}}
{{- $fullname := include "metaroce.fullname" . -}}
- --namespace={{ include "metaroce.namespace" . }}
- --agent-image={{ include "metaroce.agentImage" . }}
- --agent-cluster-role={{ $fullname }}-agent
- --metrics-port={{ include "metaroce.metricsPort" . }}
- --health-port={{ include "metaroce.healthPort" . }}
- --log-level={{ .Values.operator.logLevel }}
- --webhook-port={{ .Values.webhook.port }}
- --webhook-cert-secret={{ include "metaroce.namespace" . }}/{{ include "metaroce.certSecret" . }}
- --webhook-service={{ include "metaroce.webhookService" . }}
{{- if eq (include "metaroce.admissionMode" .) "policy" }}
- --admission-mode=policy
{{- else }}
- --webhook-mutating-config={{ include "metaroce.podsWebhook" . }}
{{- end }}
- --webhook-validating-config={{ include "metaroce.networksWebhook" . }}
{{- if .Values.webhook.certManager.enabled }}
- --webhook-cert-manager
{{- end }}
{{- range .Values.agent.allowedImages }}
- --allowed-agent-image={{ . }}
{{- end }}
{{- range .Values.imagePullSecrets }}
- --agent-image-pull-secret={{ .name }}
{{- end }}
{{- end -}}
