{{/* Names and labels, Bitnami style: one place for each. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "tandem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: (dict "root" $ "component" "router") */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The worker pools this release runs, by role: prefill and decode, or both. */}}
{{- define "tandem.pools" -}}
{{- if eq .Values.mode "aggregated" -}}
aggregated: both
{{- else -}}
prefill: prefill
decode: decode
{{- end -}}
{{- end -}}

{{/* A pool's headless Service name: (dict "root" $ "pool" "prefill") */}}
{{- define "tandem.poolService" -}}
{{- printf "%s-%s" (include "tandem.fullname" .root) .pool | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The model argument of the workers. */}}
{{- define "tandem.modelArg" -}}
{{- if eq .Values.model.source "builtin" -}}
{{- printf "builtin:%s" .Values.model.builtin.name -}}
{{- else -}}
{{- trimSuffix "/" (printf "%s/%s" .Values.model.mountPath .Values.model.subPath) -}}
{{- end -}}
{{- end -}}

{{/* The router's tokenizer: builtin, or tokenizer.json beside the checkpoint. */}}
{{- define "tandem.tokenizer" -}}
{{- if .Values.model.tokenizer -}}
{{- .Values.model.tokenizer -}}
{{- else if eq .Values.model.source "builtin" -}}
builtin
{{- else -}}
{{- printf "%s/tokenizer.json" (include "tandem.modelArg" .) -}}
{{- end -}}
{{- end -}}

{{/* The model volume (none for builtin). */}}
{{- define "tandem.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" $m.hostPath.path }}
    type: Directory
{{- else if eq $m.source "init" }}
- name: model
  emptyDir:
    sizeLimit: {{ $m.init.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "tandem.modelMount" -}}
{{- if ne .Values.model.source "builtin" }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* The TLS Secret's name (required when TLS is on). */}}
{{- define "tandem.tlsSecret" -}}
{{- required "tls.secretName is required with tls.enabled (tandem certs --out DIR; kubectl create secret generic NAME --from-file=DIR), or set tls.enabled=false" .Values.tls.secretName -}}
{{- end -}}

{{- define "tandem.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "tandem.securityContext" -}}
{{- toYaml .Values.securityContext -}}
{{- end -}}
