{{/* Names and labels shared by every template. */}}
{{/* fullnameOverride, else "<release>-metaroce", or the release name when it already
says metaroce. Cluster-scoped objects (ClusterRoles, webhook configurations, policies)
carry it, so two releases need two fullnames. */}}
{{- define "metaroce.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else if contains "metaroce" .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-metaroce" .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
The namespace of the operator, its agents, the lease and the webhook Secret:
namespace.name, else the release namespace (`helm install -n X`), except that a release
in `default` (no -n) puts them in metaroce-system: the agents run privileged, and
`default` is no place to label privileged.
*/}}
{{- define "metaroce.namespace" -}}
{{- if .Values.namespace.name -}}
{{- .Values.namespace.name -}}
{{- else if eq .Release.Namespace "default" -}}
metaroce-system
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{/* "true" when the chart makes the namespace: never the release namespace, which
exists before Helm renders (`--create-namespace` or you made it). */}}
{{- define "metaroce.createNamespace" -}}
{{- if and .Values.namespace.create (ne (include "metaroce.namespace" .) .Release.Namespace) -}}true{{- end -}}
{{- end -}}

{{/*
Refuse, with what to do, a namespace the agents cannot run in. Only `helm install` and
`helm upgrade` see the cluster (lookup); `helm template` checks the names only.
*/}}
{{- define "metaroce.checkNamespace" -}}
{{- $ns := include "metaroce.namespace" . -}}
{{- if has $ns (list "default" "kube-system" "kube-public" "kube-node-lease") -}}
{{- fail (printf "namespace %q: the node agents run privileged and need a namespace of their own labelled privileged. Install with `helm install %s charts/metaroce -n metaroce-system --create-namespace` (or set namespace.name)" $ns .Release.Name) -}}
{{- end -}}
{{- if not (include "metaroce.createNamespace" .) -}}
{{- $found := lookup "v1" "Namespace" "" $ns -}}
{{- if $found -}}
{{- $level := get (default (dict) $found.metadata.labels) "pod-security.kubernetes.io/enforce" -}}
{{- if or (and $level (ne $level "privileged")) (and (not $level) (ne .Values.admission.podSecurityDefault "privileged")) -}}
{{- fail (printf "namespace %q enforces Pod Security level %q, which refuses the privileged node agents: run `kubectl label --overwrite namespace %s pod-security.kubernetes.io/enforce=privileged` and install again (only this namespace needs it; the operator's own pods meet restricted)" $ns (default (printf "%s, the cluster default" .Values.admission.podSecurityDefault) $level) $ns) -}}
{{- end -}}
{{- end -}}
{{- end -}}
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

{{/*
Images: pinned by digest when one is given (repository@sha256:...), else by tag (the
chart's appVersion unless a tag is given). global.imageRegistry replaces the registry
of the repository (its first part when that has a '.' or ':' or is localhost), for
mirrors and air-gapped clusters. Call with (list $ .Values.<x>.image).
*/}}
{{- define "metaroce.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $repository := $image.repository -}}
{{- with $root.Values.global.imageRegistry -}}
{{- $parts := splitn "/" 2 $repository -}}
{{- if and $parts._1 (or (contains "." $parts._0) (contains ":" $parts._0) (eq $parts._0 "localhost")) -}}
{{- $repository = $parts._1 -}}
{{- end -}}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository -}}
{{- end -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "metaroce.operatorImage" -}}
{{- include "metaroce.image" (list . .Values.operator.image) -}}
{{- end -}}

{{- define "metaroce.agentImage" -}}
{{- include "metaroce.image" (list . .Values.agent.image) -}}
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
{{- /* The agents' cluster-wide pod values: cli.py AgentPodDefaults.arguments(), each
only when it is not the operator's default. */}}
{{- with .Values.agent }}
{{- if ne .image.pullPolicy "IfNotPresent" }}
- --agent-image-pull-policy={{ .image.pullPolicy }}
{{- end }}
{{- range .tolerations }}
- {{ printf "--agent-toleration=%s" (toJson .) | toJson }}
{{- end }}
{{- if ne .priorityClassName "system-node-critical" }}
- {{ printf "--agent-priority-class=%s" .priorityClassName | toJson }}
{{- end }}
{{- if ne .kubeletRootDir "/var/lib/kubelet" }}
- {{ printf "--kubelet-root-dir=%s" .kubeletRootDir | toJson }}
{{- end }}
{{- range $key, $value := .podLabels }}
- {{ printf "--agent-pod-label=%s=%s" $key $value | toJson }}
{{- end }}
{{- range $key, $value := .podAnnotations }}
- {{ printf "--agent-pod-annotation=%s=%s" $key $value | toJson }}
{{- end }}
{{- end }}
{{- end -}}
