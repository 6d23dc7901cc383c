{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "wasma.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name; RayCluster names become pod-name prefixes, so keep them short. */}}
{{- define "wasma.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "wasma.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "wasma.labels" -}}
helm.sh/chart: {{ include "wasma.chart" . }}
{{ include "wasma.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "wasma.selectorLabels" -}}
app.kubernetes.io/name: {{ include "wasma.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Pods (and the Service, ServiceMonitor, PDB, NetworkPolicy) select the gateway by these. */}}
{{- define "wasma.gatewaySelectorLabels" -}}
{{ include "wasma.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "wasma.engineSelectorLabels" -}}
{{ include "wasma.selectorLabels" . }}
app.kubernetes.io/component: engine
{{- end }}

{{- define "wasma.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "wasma.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "wasma.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Engine URLs of openai mode: the static list, then the StatefulSet's pods. */}}
{{- define "wasma.openaiUrls" -}}
{{- $urls := list }}
{{- range .Values.openai.urls }}
{{- $urls = append $urls (trimSuffix "/" .) }}
{{- end }}
{{- with .Values.openai.statefulSet }}
{{- if and .name (gt (int .replicas) 0) }}
{{- if not .serviceName }}
{{- fail "openai.statefulSet.serviceName (the headless Service) is required with openai.statefulSet.name" }}
{{- end }}
{{- $ns := default $.Release.Namespace .namespace }}
{{- range $i := until (int .replicas) }}
{{- $urls = append $urls (printf "%s://%s-%d.%s.%s.svc.%s:%d" $.Values.openai.statefulSet.scheme $.Values.openai.statefulSet.name $i $.Values.openai.statefulSet.serviceName $ns $.Values.openai.clusterDomain (int $.Values.openai.statefulSet.port)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if not $urls }}
{{- fail "openai mode (ray.enabled=false) needs engines: set openai.urls or openai.statefulSet" }}
{{- end }}
{{- join "," $urls }}
{{- end }}

{{- define "wasma.configPath" -}}/etc/wasma/config.yaml{{- end }}
{{- define "wasma.apiKeyPath" -}}/var/run/secrets/wasma/api-keys{{- end }}

{{/* `wasma serve` arguments, one per line of a YAML list. */}}
{{- define "wasma.gatewayArgs" -}}
- serve
- --engines
{{- if .Values.ray.enabled }}
- {{ printf "vllm:%d" (int .Values.ray.engines.count) | quote }}
{{- else }}
- {{ printf "openai:%s" (include "wasma.openaiUrls" .) | quote }}
{{- end }}
{{- if .Values.model.path }}
- --model
- {{ .Values.model.path | quote }}
{{- end }}
- --policy
- {{ .Values.policy.name | quote }}
- --host
- "0.0.0.0"
- --port
- {{ .Values.gateway.port | quote }}
- --config
- {{ include "wasma.configPath" . | quote }}
{{- if .Values.ray.enabled }}
- --address
- {{ .Values.ray.address | quote }}
{{- if .Values.ray.sharedRouter }}
{{- /* One detached router actor for every gateway process that joins the cluster. */}}
- --shared-router
- {{ printf "%s-router" (include "wasma.fullname" .) | quote }}
{{- end }}
{{- else }}
{{- /* Gateway mode: the router runs in the gateway's process; no local Ray is started. */}}
- --router-in-process
{{- end }}
{{- if and .Values.apiKeys.existingSecret .Values.apiKeys.mountAsFile }}
- --api-key-file
- {{ include "wasma.apiKeyPath" . | quote }}
{{- end }}
{{- range .Values.gateway.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}

{{/* Environment of the gateway container; API keys only ever by reference to a Secret. */}}
{{- define "wasma.gatewayEnv" -}}
- name: HOME
  value: /tmp
- name: PYTHONUNBUFFERED
  value: "1"
{{- if and .Values.apiKeys.existingSecret (not .Values.apiKeys.mountAsFile) }}
- name: WASMA_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.existingSecret | quote }}
      key: {{ .Values.apiKeys.secretKey | quote }}
{{- end }}
{{- with .Values.gateway.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The gateway container, shared by the Deployment and the Ray head pod. */}}
{{- define "wasma.gatewayContainer" -}}
- name: gateway
  image: {{ include "wasma.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["wasma"]
  args:
    {{- include "wasma.gatewayArgs" . | nindent 4 }}
  env:
    {{- include "wasma.gatewayEnv" . | nindent 4 }}
  ports:
    - name: http
      containerPort: {{ .Values.gateway.port }}
      protocol: TCP
  {{- with .Values.gateway.livenessProbe }}
  livenessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.gateway.readinessProbe }}
  readinessProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.gateway.startupProbe }}
  startupProbe:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .Values.gateway.preStopSleepSeconds }}
  lifecycle:
    preStop:
      exec:
        command: ["sleep", {{ .Values.gateway.preStopSleepSeconds | quote }}]
  {{- end }}
  resources:
    {{- toYaml .Values.gateway.resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: config
      mountPath: /etc/wasma
      readOnly: true
    {{- if .Values.model.volume }}
    - name: model
      mountPath: {{ .Values.model.mountPath }}
      readOnly: true
    {{- end }}
    {{- if and .Values.apiKeys.existingSecret .Values.apiKeys.mountAsFile }}
    - name: api-keys
      mountPath: {{ dir (include "wasma.apiKeyPath" .) }}
      readOnly: true
    {{- end }}
    {{- if .Values.ray.enabled }}
    - name: ray-session
      mountPath: /tmp/ray
    {{- end }}
{{- end }}

{{/* Volumes the gateway container mounts. */}}
{{- define "wasma.gatewayVolumes" -}}
- name: tmp
  emptyDir: {}
- name: config
  configMap:
    name: {{ include "wasma.fullname" . }}-config
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- if and .Values.apiKeys.existingSecret .Values.apiKeys.mountAsFile }}
- name: api-keys
  secret:
    secretName: {{ .Values.apiKeys.existingSecret | quote }}
    defaultMode: 0440  # group-readable: fsGroup gives the non-root user access
    items:
      - key: {{ .Values.apiKeys.secretKey | quote }}
        path: {{ base (include "wasma.apiKeyPath" .) }}
{{- end }}
{{- end }}

{{/* Seconds Kubernetes waits after SIGTERM: preStop, then the drain's delay and timeout. */}}
{{- define "wasma.terminationGracePeriod" -}}
{{- $g := .Values.gateway -}}
{{- add (int $g.preStopSleepSeconds) (int $g.drain.delaySeconds) (int $g.drain.timeoutSeconds) 10 -}}
{{- end }}
