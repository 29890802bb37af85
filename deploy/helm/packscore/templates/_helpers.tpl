{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "packscore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects. */}}
{{- define "packscore.fullname" -}}
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

{{- define "packscore.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "packscore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "packscore.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "packscore.labels" -}}
helm.sh/chart: {{ include "packscore.chart" . }}
{{ include "packscore.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: scoring
{{- end }}

{{- define "packscore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "packscore.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "packscore.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* Worker processes: parallel.worldSize, or one per GPU when it is 0. */}}
{{- define "packscore.worldSize" -}}
{{- $ws := int .Values.parallel.worldSize }}
{{- if eq $ws 0 }}{{ $ws = int .Values.gpus }}{{ end }}
{{- $ws }}
{{- end }}

{{/* The server's --max-batch-tokens: server.maxBatchTokens, or the server's default (service/settings.py). */}}
{{- define "packscore.maxBatchTokens" -}}
{{- if kindIs "invalid" .Values.server.maxBatchTokens }}16384{{ else }}{{ int64 .Values.server.maxBatchTokens }}{{ end }}
{{- end }}

{{/* The HPA's target: autoscaling.targetQueuedTokens, or one full row per GPU (max-batch-tokens x world size), a
third of the admission bound's floor of 3 rows per GPU, which packscore_queued_tokens reaches under overload whatever the model's speed. */}}
{{- define "packscore.targetQueuedTokens" -}}
{{- $target := .Values.autoscaling.targetQueuedTokens }}
{{- if kindIs "invalid" $target }}{{ mul (int64 (include "packscore.maxBatchTokens" .)) (int64 (include "packscore.worldSize" .)) }}{{ else }}{{ int64 $target }}{{ end }}
{{- end }}

{{/* Fails the render when the layout cannot work, showing the arithmetic. */}}
{{- define "packscore.validateLayout" -}}
{{- $gpus := int .Values.gpus }}
{{- $ws := int (include "packscore.worldSize" .) }}
{{- $sp := int .Values.parallel.sp }}
{{- if gt $ws $gpus }}
{{- fail (printf "parallel.worldSize(%d) > gpus(%d): each worker process needs its own GPU" $ws $gpus) }}
{{- end }}
{{- if ne (mod $ws $sp) 0 }}
{{- fail (printf "parallel.worldSize(%d) %% parallel.sp(%d) = %d, must be 0 (dp * sp = world size)" $ws $sp (mod $ws $sp)) }}
{{- end }}
{{- /* deployment.yaml adds the GPU resource from gpus after these: Helm keeps the last of two keys (the user's dropped without a word), GitOps post-renderers refuse the YAML. */}}
{{- range $part := list "requests" "limits" }}
{{- if hasKey (get $.Values.resources $part | default dict) "nvidia.com/gpu" }}
{{- fail (printf "resources.%s[nvidia.com/gpu] is set by the chart from gpus(%d), request and limit alike: set gpus instead" $part (int $.Values.gpus)) }}
{{- end }}
{{- end }}
{{- /* Labels of one's own after the chart's: Helm keeps the last of two keys (a selector label moved: the Deployment refused), GitOps post-renderers refuse the YAML. */}}
{{- $chartLabels := include "packscore.labels" . | fromYaml }}
{{- $own := dict "podLabels" .Values.podLabels }}
{{- if .Values.serviceMonitor.enabled }}{{ $_ := set $own "serviceMonitor.labels" .Values.serviceMonitor.labels }}{{ end }}
{{- if .Values.prometheusRule.enabled }}{{ $_ := set $own "prometheusRule.labels" .Values.prometheusRule.labels }}{{ end }}
{{- range $value, $labels := $own }}
{{- range $key, $_ := $labels | default dict }}
{{- if hasKey $chartLabels $key }}
{{- fail (printf "%s(%s) is a label the chart sets itself (%s): choose another key" $value $key (keys $chartLabels | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* uid 1000 with every capability dropped (no CAP_NET_BIND_SERVICE): binding below the pod network's
net.ipv4.ip_unprivileged_port_start fails (EACCES), and runtimes differ on it (containerd 2 lowers it to 0; containerd 1.x and CRI-O keep 1024). */}}
{{- $port := int64 .Values.server.port }}
{{- $unprivileged := 1024 }}
{{- range get (.Values.podSecurityContext | default dict) "sysctls" | default list }}
{{- if eq (toString .name) "net.ipv4.ip_unprivileged_port_start" }}{{ $unprivileged = int64 .value }}{{ end }}
{{- end }}
{{- if lt $port (int64 $unprivileged) }}
{{- fail (printf "server.port(%d) < net.ipv4.ip_unprivileged_port_start(%d): the server runs as a non-root user with every capability dropped, so it may bind a port below that only where the node's runtime lowers the sysctl (containerd 2 does, containerd 1.x and CRI-O do not: EACCES at start, a crash loop); keep server.port at 1024 or above and give clients port %d through service.port, or set that sysctl in podSecurityContext.sysctls (a safe sysctl since Kubernetes 1.22) to at most %d" $port (int64 $unprivileged) $port $port) }}
{{- end }}
{{- $as := .Values.autoscaling }}
{{- if and $as.enabled (gt (int64 $as.minReplicas) (int64 $as.maxReplicas)) }}
{{- fail (printf "autoscaling.minReplicas(%d) > autoscaling.maxReplicas(%d): the API server would refuse the HorizontalPodAutoscaler" (int64 $as.minReplicas) (int64 $as.maxReplicas)) }}
{{- end }}
{{- $bound := .Values.server.maxQueuedTokens }}
{{- if and $as.enabled (not (kindIs "invalid" $bound)) }}
{{- $target := int64 (include "packscore.targetQueuedTokens" .) }}
{{- if ge $target (int64 $bound) }}
{{- fail (printf "autoscaling.targetQueuedTokens(%d) >= server.maxQueuedTokens(%d): pods would reject work (429) before the HPA scales out" $target (int64 $bound)) }}
{{- end }}
{{- end }}
{{- $src := .Values.model.source }}
{{- if and (eq $src.type "pvc") (not $src.pvc.claimName) }}
{{- fail "model.source.type is pvc but model.source.pvc.claimName is empty" }}
{{- end }}
{{- if and (eq $src.type "hostPath") (not $src.hostPath.path) }}
{{- fail "model.source.type is hostPath but model.source.hostPath.path is empty" }}
{{- end }}
{{- if and (eq $src.type "nfs") (or (not $src.nfs.server) (not $src.nfs.path)) }}
{{- fail "model.source.type is nfs but model.source.nfs.server or model.source.nfs.path is empty" }}
{{- end }}
{{- $wts := .Values.weights }}
{{- /* Two mounts at one path: the API server refuses the pod template (mountPath must be unique). */}}
{{- if ne $src.type "none" }}
{{- $own := include "packscore.podMounts" . | fromJsonArray }}
{{- if has (trimSuffix "/" .Values.model.mountPath) $own }}
{{- fail (printf "model.mountPath(%s) is already a mount of the pod (%s): give the model volume a path of its own" .Values.model.mountPath (join ", " $own)) }}
{{- end }}
{{- /* A read-only volume around one of the pod's mounts (/var around /var/lib/packscore, / around all): as with two nested
read-only volumes below, runc's mkdir of the inner mount point in it fails (the container never starts), or that mount hides the directory. */}}
{{- range $own }}
{{- if hasPrefix (printf "%s/" (trimSuffix "/" $.Values.model.mountPath)) . }}
{{- fail (printf "model.mountPath(%s) holds %s, a mount of the pod (%s): the model volume is mounted read-only, so the container cannot start unless %s already exists as a directory in it (runc: read-only file system), and then that mount hides what the model volume holds there; give the model volume a path outside the pod's mounts (e.g. /models)" $.Values.model.mountPath . (join ", " $own) .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $wts.enabled }}
{{- $own := include "packscore.podMounts" . | fromJsonArray }}
{{- $taken := $own }}
{{- if ne $src.type "none" }}{{ $taken = append $taken .Values.model.mountPath }}{{ end }}
{{- if has (trimSuffix "/" $wts.mountPath) $taken }}
{{- fail (printf "weights.mountPath(%s) is already a mount of the pod (%s): give the checkpoints a path of their own" $wts.mountPath (join ", " $taken)) }}
{{- end }}
{{- /* Around one of the pod's own mounts: as model.mountPath above (the model volume's nesting is the check below). */}}
{{- range $own }}
{{- if hasPrefix (printf "%s/" (trimSuffix "/" $wts.mountPath)) . }}
{{- fail (printf "weights.mountPath(%s) holds %s, a mount of the pod (%s): the checkpoint volume is mounted read-only, so the container cannot start unless %s already exists as a directory in it (runc: read-only file system), and then that mount hides what the checkpoint volume holds there; give the checkpoints a path outside the pod's mounts (e.g. /weights)" $wts.mountPath . (join ", " $own) .) }}
{{- end }}
{{- end }}
{{- /* One read-only volume inside the other: the API server takes it, but the kubelet pre-creates nested mount points only in
Secret/ConfigMap volumes, so runc's mkdir in the read-only outer one fails (the container never starts); where the directory exists, the inner volume hides it. */}}
{{- $model := trimSuffix "/" .Values.model.mountPath }}
{{- $ckpt := trimSuffix "/" $wts.mountPath }}
{{- if and (ne $src.type "none") (or (hasPrefix (printf "%s/" $model) $ckpt) (hasPrefix (printf "%s/" $ckpt) $model)) }}
{{- fail (printf "weights.mountPath(%s) and model.mountPath(%s) lie one inside the other: both volumes are mounted read-only, so the container cannot start unless the inner path already exists as a directory in the outer volume (runc: read-only file system), and then the inner volume hides what the outer one holds there; give each a path outside the other (e.g. /models and /weights)" $wts.mountPath .Values.model.mountPath) }}
{{- end }}
{{- if and $wts.recordClaim (not $wts.record) }}
{{- fail (printf "weights.recordClaim(%s) holds the record, which weights.record false turns off: set record true, or recordClaim empty" $wts.recordClaim) }}
{{- end }}
{{- end }}
{{- range $probe := list "startup" "readiness" "liveness" }}
{{- $p := index $.Values.probes $probe }}
{{- /* /readyz waits up to 4 s for its scoring pass behind a running forward (service/readiness.py _READY_WAIT_S) */}}
{{- if and (eq (trimSuffix "/" $p.path) "/readyz") (le (int $p.timeoutSeconds) 4) }}
{{- fail (printf "probes.%s.timeoutSeconds(%d) <= 4: /readyz may take 4 s to answer (its scoring pass waits behind a running forward), so the probe would fail a busy pod; at least 5" $probe (int $p.timeoutSeconds)) }}
{{- end }}
{{- end }}
{{- include "packscore.validateOptions" . }}
{{- end }}

{{/* Fails the render when server.extraArgs names, or abbreviates as argparse allows, an option the chart
sets itself (the last one given wins, and the probes, ports, grace period and volumes follow the chart's value)
or a key (on the command line, ps and the pod spec show it); and when env names the variable of such an option
(PACKSCORE_<OPTION>, which the server reads where the command line leaves it, whatever its case), or repeats a
cache or scratch variable the chart sets (Kubernetes keeps the last of two names, and the server sets the kernel
caches again from --triton-cache-dir: the user's would move a cache off its volume, or be dropped without a word). */}}
{{- define "packscore.validateOptions" -}}
{{- $managed := dict
  "--host" "the chart (0.0.0.0, where the probes and the Service reach the pod)"
  "--port" "server.port"
  "--world-size" "parallel.worldSize"
  "--sp" "parallel.sp"
  "--fsdp" "parallel.fsdp"
  "--no-fsdp" "parallel.fsdp"
  "--drain-timeout-s" "server.drainTimeoutS"
  "--triton-cache-dir" "the chart (/cache/triton, on the cache volume)"
  "--max-batch-tokens" "server.maxBatchTokens"
  "--max-wait-ms" "server.maxWaitMs"
  "--max-queued-tokens" "server.maxQueuedTokens"
  "--max-request-bytes" "server.maxRequestBytes"
  "--max-model-len" "server.maxModelLen"
  "--dtype" "server.dtype"
  "--allow-slow-kernels" "server.allowSlowKernels"
  "--no-allow-slow-kernels" "server.allowSlowKernels"
  "--kernels" "server.kernels"
  "--weights-root" "weights.enabled and weights.mountPath"
  "--admin-key-file" "weights.adminKey"
  "--weights-record" "weights.record and weights.recordClaim"
  "--api-key-file" "apiKey.secretName"
}}
{{- $keys := dict
  "--api-key" "apiKey.secretName (a Secret, passed as PACKSCORE_API_KEY)"
  "--admin-key" "weights.adminKey.secretName (a Secret, mounted as the file --admin-key-file reads)"
}}
{{- range $arg := .Values.server.extraArgs }}
{{- $name := index (splitList "=" $arg) 0 }}
{{- /* "--flag value" in one element: one argv word the server refuses at start (argparse takes a word with a space for a positional); its flag is checked too. */}}
{{- $word := regexFind "^\\S*" $name }}
{{- $joined := and (hasPrefix "-" $name) (ne $word $name) }}
{{- $shown := ternary $arg $name $joined }}
{{- $name = $word }}
{{- if and (hasPrefix "--" $name) (gt (len $name) 2) }}
{{- /* Keys first: --admin-key is an option of its own, not an abbreviation of --admin-key-file; the message names the option alone, never the key. */}}
{{- range $flag, $from := $keys }}
{{- if hasPrefix $name $flag }}
{{- fail (printf "server.extraArgs(%s) is (or abbreviates) %s, which would put a key on the command line, where ps and the pod spec show it: set %s instead" $name $flag $from) }}
{{- end }}
{{- end }}
{{- range $flag, $from := $managed }}
{{- if hasPrefix $name $flag }}
{{- fail (printf "server.extraArgs(%s) is (or abbreviates) %s, which the chart sets from %s: set that value instead" $shown $flag $from) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $joined }}
{{- fail (printf "server.extraArgs(%s) holds an option and its value in one element, which the server refuses at start (unrecognized arguments): give them as two elements (%s, %s) or as %s=%s" $arg (quote $name) (quote (trimPrefix $name $arg | trim)) $name (trimPrefix $name $arg | trim)) }}
{{- end }}
{{- end }}
{{- $variables := dict "PACKSCORE_MODEL" (list "--model" "model.path (more models: --model NAME=PATH in server.extraArgs)") }}
{{- range $flag, $from := merge (dict) $managed $keys }}
{{- if not (hasPrefix "--no-" $flag) }}
{{- $_ := set $variables (printf "PACKSCORE_%s" (trimPrefix "--" $flag | replace "-" "_" | upper)) (list $flag $from) }}
{{- end }}
{{- end }}
{{- /* The cache and scratch variables of deployment.yaml, and the one the server derives from --triton-cache-dir. */}}
{{- $cache := "cache.existingClaim or cache.sizeLimit (the /cache volume)" }}
{{- $chartEnv := dict
  "HOME" (list "the chart's HOME=/cache" $cache)
  "TRITON_HOME" (list "the chart's TRITON_HOME=/cache" $cache)
  "TRITON_CACHE_DIR" (list "the chart's TRITON_CACHE_DIR=/cache/triton, which the server sets again from --triton-cache-dir, dropping yours" $cache)
  "TORCHINDUCTOR_CACHE_DIR" (list "TORCHINDUCTOR_CACHE_DIR=/cache/triton/inductor, which the server sets from the chart's --triton-cache-dir, dropping yours" $cache)
  "XDG_CACHE_HOME" (list "the chart's XDG_CACHE_HOME=/cache/xdg" $cache)
  "TMPDIR" (list "the chart's TMPDIR=/tmp" "tmp.sizeLimit (the /tmp volume)")
}}
{{- range $entry := .Values.env }}
{{- $name := toString $entry.name }}
{{- with get $variables (upper $name) }}
{{- fail (printf "env(%s) sets %s, which the chart sets from %s: set that value instead" $name (index . 0) (index . 1)) }}
{{- end }}
{{- with get $chartEnv $name }}
{{- fail (printf "env(%s) repeats %s: caches and scratch space stay on the pod's volumes (the root filesystem is read-only); set %s instead" $name (index . 0) (index . 1)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The pod's affinity: .Values.affinity, with `nvidia.com/gpu.product In gpuProducts` added to every required
node term (terms are ORed, expressions in one ANDed), or as the only term; left out when gpuProducts is empty or
nodeSelector or a required term names that label itself (the user's choice of GPU replaces the default). */}}
{{- define "packscore.affinity" -}}
{{- $label := "nvidia.com/gpu.product" }}
{{- $affinity := deepCopy (.Values.affinity | default dict) }}
{{- $node := get $affinity "nodeAffinity" | default dict }}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict }}
{{- $terms := get $required "nodeSelectorTerms" | default list }}
{{- $chosen := hasKey (.Values.nodeSelector | default dict) $label }}
{{- range $terms }}
{{- range get . "matchExpressions" | default list }}
{{- if eq .key $label }}{{ $chosen = true }}{{ end }}
{{- end }}
{{- end }}
{{- if and .Values.gpuProducts (not $chosen) }}
{{- $product := dict "key" $label "operator" "In" "values" .Values.gpuProducts }}
{{- $withProduct := list }}
{{- range $terms }}
{{- $withProduct = append $withProduct (set . "matchExpressions" (append (get . "matchExpressions" | default list) $product)) }}
{{- end }}
{{- if not $withProduct }}{{ $withProduct = list (dict "matchExpressions" (list $product)) }}{{ end }}
{{- $_ := set $required "nodeSelectorTerms" $withProduct }}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required }}
{{- $_ := set $affinity "nodeAffinity" $node }}
{{- end }}
{{- with $affinity }}{{ toYaml . }}{{ end }}
{{- end }}

{{/* Seconds from SIGTERM to SIGKILL: preStop sleep + drain + margin. */}}
{{- define "packscore.terminationGracePeriod" -}}
{{- add (int .Values.preStopSleepS) (int .Values.server.drainTimeoutS) (int .Values.terminationGraceMarginS) }}
{{- end }}

{{/* The admin key Secret's mount (a directory of its own) and the file --admin-key-file reads. */}}
{{- define "packscore.adminKeyDir" -}}
/run/secrets/packscore-admin
{{- end }}

{{- define "packscore.adminKeyFileName" -}}
admin-key
{{- end }}

{{- define "packscore.adminKeyFile" -}}
{{- printf "%s/%s" (include "packscore.adminKeyDir" .) (include "packscore.adminKeyFileName" .) }}
{{- end }}

{{/* The mount paths of the pod's own volumes, as deployment.yaml mounts them (a JSON list): the record's and the
admin key's only where that volume exists, so a values file that leaves them out may use those paths. */}}
{{- define "packscore.podMounts" -}}
{{- $wts := .Values.weights }}
{{- $own := list "/dev/shm" "/tmp" "/cache" }}
{{- if and $wts.enabled $wts.adminKey.secretName }}{{ $own = append $own (include "packscore.adminKeyDir" .) }}{{ end }}
{{- if and $wts.enabled $wts.record }}{{ $own = append $own (include "packscore.weightsRecordDir" .) }}{{ end }}
{{- toJson $own }}
{{- end }}

{{/* The volume holding --weights-record (weights.record: an emptyDir, or weights.recordClaim), and the file in it. */}}
{{- define "packscore.weightsRecordDir" -}}
/var/lib/packscore
{{- end }}

{{- define "packscore.weightsRecordFile" -}}
{{- printf "%s/weights-record.json" (include "packscore.weightsRecordDir" .) }}
{{- end }}

{{/* The read-only volume source of model.source or weights.source: pvc, hostPath or nfs. */}}
{{- define "packscore.readOnlyVolumeSource" -}}
{{- if eq .type "pvc" -}}
persistentVolumeClaim:
  claimName: {{ .pvc.claimName }}
  readOnly: true
{{- else if eq .type "hostPath" -}}
hostPath:
  path: {{ .hostPath.path }}
  type: {{ .hostPath.type }}
{{- else if eq .type "nfs" -}}
nfs:
  server: {{ .nfs.server }}
  path: {{ .nfs.path }}
  readOnly: true
{{- end }}
{{- end }}
