{{- define "npm-agent.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "npm-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "npm-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "npm-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "npm-agent.labels" -}}
{{ include "npm-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "npm-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "npm-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "npm-agent.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
The CNI presets (see values.yaml, cniPreset): what each one sets. A key a
preset leaves out keeps the chart's default.
*/}}
{{- define "npm-agent.presets" -}}
"": {}
calico:
  interfacePattern: "cali*"
flannel:
  interfacePattern: "veth*"
kindnet:
  interfacePattern: "veth*"
aws-vpc-cni:
  interfacePattern: "eni*"
bridge:
  interfacePattern: "veth*"
ptp:
  interfacePattern: "veth*"
k3s:
  interfacePattern: "veth*"
  confDir: /var/lib/rancher/k3s/agent/etc/cni/net.d
  binDir: /var/lib/rancher/k3s/data/cni
gke:
  interfacePattern: "gke*"
  binDir: /home/kubernetes/bin
{{- end -}}

{{/* The selected preset as a dict; fails on an unknown name. */}}
{{- define "npm-agent.preset" -}}
{{- $presets := include "npm-agent.presets" . | fromYaml -}}
{{- if not (hasKey $presets .Values.cniPreset) -}}
{{- fail (printf "values.cniPreset must be one of %s, got %q" (without (keys $presets | sortAlpha) "" | join ", ") .Values.cniPreset) -}}
{{- end -}}
{{- get $presets .Values.cniPreset | toYaml -}}
{{- end -}}

{{/* Interface pattern: the explicit value, else the preset's, else empty. */}}
{{- define "npm-agent.interfacePattern" -}}
{{- $p := include "npm-agent.preset" . | fromYaml -}}
{{- .Values.interfacePattern | default (get $p "interfacePattern") -}}
{{- end -}}

{{/* Host CNI config directory: the explicit value, else the preset's, else /etc/cni/net.d. */}}
{{- define "npm-agent.cniConfDir" -}}
{{- $p := include "npm-agent.preset" . | fromYaml -}}
{{- .Values.cni.confDir | default (get $p "confDir") | default "/etc/cni/net.d" -}}
{{- end -}}

{{/* Host CNI plugin directory: the explicit value, else the preset's, else /opt/cni/bin. */}}
{{- define "npm-agent.cniBinDir" -}}
{{- $p := include "npm-agent.preset" . | fromYaml -}}
{{- .Values.cni.binDir | default (get $p "binDir") | default "/opt/cni/bin" -}}
{{- end -}}

{{/* Host directory of the agent's CNI socket (mounted into the agent). */}}
{{- define "npm-agent.cniSocketDir" -}}
{{- $s := .Values.cni.socket -}}
{{- if or (not (isAbs $s)) (eq (dir $s) "/") -}}
{{- fail (printf "values.cni.socket must be an absolute path below a directory other than /, got %q" $s) -}}
{{- end -}}
{{- dir $s -}}
{{- end -}}

{{/*
securityContext of the containers that touch the kernel's BPF and network
state (the agent, the cleanup): privileged, or root with exactly
.Values.capabilities. Kubernetes gives capabilities to root only (no ambient
capabilities), hence runAsUser 0 whatever the image's user.
*/}}
{{- define "npm-agent.kernelSecurityContext" -}}
{{- if .Values.privileged -}}
privileged: true
runAsUser: 0
{{- else -}}
privileged: false
runAsUser: 0
capabilities:
  drop: ["ALL"]
  add:
    {{- toYaml .Values.capabilities | nindent 4 }}
{{- with .Values.seLinuxOptions }}
seLinuxOptions:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Name of the uninstall hooks' objects (ServiceAccount, Role, Jobs' prefix). */}}
{{- define "npm-agent.uninstallName" -}}
{{- printf "%s-uninstall" (include "npm-agent.fullname" . | trunc 52 | trimSuffix "-") -}}
{{- end -}}

{{/* Name of the cleanup DaemonSet of the uninstall hooks. */}}
{{- define "npm-agent.cleanupName" -}}
{{- printf "%s-cleanup" (include "npm-agent.fullname" . | trunc 54 | trimSuffix "-") -}}
{{- end -}}

{{- define "npm-agent.cleanupSelectorLabels" -}}
app.kubernetes.io/name: {{ include "npm-agent.name" . }}-cleanup
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: cleanup
{{- end -}}

{{/* Annotations of a pre-delete hook of weight `.` (the uninstall hooks). */}}
{{- define "npm-agent.uninstallHook" -}}
helm.sh/hook: pre-delete
helm.sh/hook-weight: {{ . | quote }}
helm.sh/hook-delete-policy: before-hook-creation,hook-succeeded
{{- end -}}

{{/* securityContext of the hook containers that need no privilege at all. */}}
{{- define "npm-agent.unprivilegedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65534
runAsGroup: 65534
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
