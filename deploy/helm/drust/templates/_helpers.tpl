{{/* Names, labels and checks shared by the templates. */}}

{{- define "drust.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's prefix for namespaced and cluster-wide objects. */}}
{{- define "drust.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "drust.labels" -}}
app.kubernetes.io/name: {{ include "drust.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "drust.selectorLabels" -}}
app.kubernetes.io/name: {{ include "drust.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: kubelet-plugin
{{- end -}}

{{- define "drust.serviceAccountName" -}}
{{- default (printf "%s-kubelet-plugin" (include "drust.fullname" .)) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The user name the API server gives the plugin's ServiceAccount tokens. */}}
{{- define "drust.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "drust.serviceAccountName" .) -}}
{{- end -}}

{{/* The DRA driver name: NVIDIA's in compatibility mode, else driverName. */}}
{{- define "drust.driverName" -}}
{{- if .Values.nvidiaCompatibility -}}gpu.nvidia.com{{- else -}}{{ .Values.driverName }}{{- end -}}
{{- end -}}

{{/* DeviceClass names: <kind>.<domain>, domain = the driver name without a leading "gpu.". */}}
{{- define "drust.classDomain" -}}
{{- trimPrefix "gpu." (include "drust.driverName" .) -}}
{{- end -}}

{{- define "drust.gpuClassName" -}}
{{- default (printf "gpu.%s" (include "drust.classDomain" .)) .Values.deviceClasses.gpu.name -}}
{{- end -}}

{{- define "drust.migClassName" -}}
{{- default (printf "mig.%s" (include "drust.classDomain" .)) .Values.deviceClasses.mig.name -}}
{{- end -}}

{{- define "drust.imexChannelClassName" -}}
{{- default (printf "imex-channel.%s" (include "drust.classDomain" .)) .Values.deviceClasses.imexChannel.name -}}
{{- end -}}

{{- define "drust.shareClassName" -}}
{{- printf "gpu-share.%s" (include "drust.classDomain" .) -}}
{{- end -}}

{{- define "drust.extendedClassName" -}}
{{- default (printf "gpu-extended.%s" (include "drust.classDomain" .)) .Values.deviceClasses.extendedResource.name -}}
{{- end -}}

{{- define "drust.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The plugins' HTTP endpoint's scheme, as probes and scrape configs name it. */}}
{{- define "drust.httpScheme" -}}
{{- if .Values.http.tls.enabled -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}

{{/* Combinations the schema cannot express; fails the install with the reason. */}}
{{- define "drust.validate" -}}
{{- if and .Values.nodeLabels.nvlinkClique (not .Values.admissionPolicy.enabled) -}}
{{- fail "nodeLabels.nvlinkClique needs admissionPolicy.enabled: without its policy the plugin's patch on nodes would reach every label and field of every node" -}}
{{- end -}}
{{- if eq .Values.security.deviceAccess "runtime" -}}
{{- if eq .Values.features.migStrategy "partitionable" -}}
{{- fail "security.deviceAccess=runtime cannot be combined with features.migStrategy=partitionable: creating MIG devices needs CAP_SYS_ADMIN and /dev/nvidia-caps, so the plugin must be privileged" -}}
{{- end -}}
{{- if .Values.features.sharing -}}
{{- fail "security.deviceAccess=runtime cannot be combined with features.sharing=true: time-slicing and MPS change the GPU's compute policy and start the MPS control daemon, so the plugin must be privileged (or set features.sharing=false)" -}}
{{- end -}}
{{- end -}}
{{- if and .Values.features.consumableCapacity (not .Values.features.sharing) -}}
{{- fail "features.consumableCapacity=true needs features.sharing=true: every share runs under its GPU's MPS control daemon, which the plugin starts only with sharing on" -}}
{{- end -}}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) -}}
{{- fail "serviceAccount.create=false needs serviceAccount.name: the existing ServiceAccount the plugin runs as" -}}
{{- end -}}
{{- end -}}

{{/* nvidia-cuda-mps-control inside the driver root: the plugin's --mps-control-binary (under
/driver-root) and the daemon Pods' command, which the admission policy pins. */}}
{{- define "drust.mpsControlBinary" -}}
/usr/bin/nvidia-cuda-mps-control
{{- end -}}
