{{/* Names and labels shared by every template. */}}

{{- define "afd-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "afd-operator.serviceAccountName" -}}
{{- default (include "afd-operator.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{- define "afd-operator.webhookServiceName" -}}
{{- printf "%s-webhook" (include "afd-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "afd-operator.policyName" -}}
{{- printf "%s-policy" (include "afd-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* What AFDDeployments may use of the nodes and how their pods are isolated: the operator's --policy file. */}}
{{- define "afd-operator.policy" -}}
{{- toYaml (dict "hostAccess" .Values.hostAccess "networkPolicy" .Values.networkPolicy) -}}
{{- end -}}

{{- define "afd-operator.webhookSecretName" -}}
{{- if eq .Values.webhook.certificate.source "existingSecret" -}}
{{- required "webhook.certificate.existingSecret.name: the Secret (kubernetes.io/tls) to serve the webhook with" .Values.webhook.certificate.existingSecret.name -}}
{{- else -}}
{{- printf "%s-webhook-tls" (include "afd-operator.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "afd-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "afd-operator.labels" -}}
{{ include "afd-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: afd-operator
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
What the operator does in the namespaces it watches, and nothing more (see
operator/afd_operator/writer.py and handlers/):
- AFDDeployments: kopf lists and watches them and patches its finalizer and annotations;
  the reconciler writes the status subresource.
- Pods, Services, ConfigMaps: watched for kopf's indexes; pods and services are created,
  patched and deleted; revision ConfigMaps are immutable (create, delete). A create refused as
  "already exists" reads that one object (get) to see whether its deployment controls it.
- Events: posted by the reconciler and by kopf.
- PodDisruptionBudgets, NetworkPolicies (one of each per instance): watched for kopf's
  indexes, created (get as above), patched and deleted.
- PodMonitors, Volcano PodGroups: read to avoid needless writes, then created, patched (not
  PodGroups) and deleted.
*/}}
{{- define "afd-operator.namespacedRules" -}}
- apiGroups: [afd.inference.dev]
  resources: [afddeployments]
  # get: the webhook reads the object a /scale request changes.
  verbs: [get, list, watch, patch]
- apiGroups: [afd.inference.dev]
  resources: [afddeployments/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [pods, services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, delete]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, create, delete]
{{- end -}}

{{/* An alert's labels: its severity and the chart's alerts.alertLabels (templates/alerts.yaml). */}}
{{- define "afd-operator.alertLabels" -}}
severity: {{ .severity }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- end }}
