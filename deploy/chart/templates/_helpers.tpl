{{/* The backends each driver name serves. */}}
{{- /* The backends each driver ("local" or "remote") serves: the chart's
one list of them (tests/deploy.rs holds it to the driver's kinds and the
overlays). */ -}}
{{- define "ferrovol.driverBackends" -}}
{{- if eq . "local" -}}file lvm{{- else -}}nfs iscsi rbd nvmf{{- end -}}
{{- end -}}

{{- /* Every backend, the local driver's first. */ -}}
{{- define "ferrovol.backends" -}}
{{- include "ferrovol.driverBackends" "local" }} {{ include "ferrovol.driverBackends" "remote" -}}
{{- end -}}

{{- /* The driver ("local" or "remote") that serves a backend. */ -}}
{{- define "ferrovol.driverOf" -}}
{{- ternary "local" "remote" (has . (splitList " " (include "ferrovol.driverBackends" "local"))) -}}
{{- end -}}

{{- define "ferrovol.driverName" -}}
{{- if eq . "local" -}}local.csi.ferrovol.io{{- else -}}csi.ferrovol.io{{- end -}}
{{- end -}}

{{/* The labels every object carries: who made it. */}}
{{- define "ferrovol.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{/*
A container's image, pull policy and resources: (list $ sidecar $resources
container), sidecar "" for ferrovol's own image (image.pullPolicy), else a
key of .Values.sidecars (sidecars.pullPolicy).
*/}}
{{- define "ferrovol.container" -}}
{{- $root := index . 0 -}}
{{- $side := index . 1 -}}
{{- if $side -}}
{{- $s := index $root.Values.sidecars $side -}}
image: {{ printf "%s/%s:%s" $root.Values.sidecars.registry $s.image $s.tag }}
{{- else -}}
image: {{ printf "%s:%s" $root.Values.image.repository $root.Values.image.tag }}
{{- end }}
{{- with ternary $root.Values.sidecars.pullPolicy $root.Values.image.pullPolicy (ne $side "") }}
imagePullPolicy: {{ . }}
{{- end }}
{{- with index (index . 2) (index . 3) }}
resources:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
The backends as one node group sees them: the top-level backends with the
group's `enabled` and `config` over them. (list $ $group), $group may be
an empty dict.
*/}}
{{- define "ferrovol.groupBackends" -}}
{{- $root := index . 0 -}}
{{- $group := index . 1 -}}
{{- $out := dict -}}
{{- range $name, $b := $root.Values.backends -}}
{{- $over := index ($group.backends | default dict) $name | default dict -}}
{{- $_ := set $out $name (dict "enabled" (ternary $over.enabled $b.enabled (hasKey $over "enabled")) "config" ($over.config | default $b.config) "store" $b.store) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* "true" when a driver ("local" or "remote") has a backend on anywhere. */}}
{{- define "ferrovol.driverOn" -}}
{{- $root := index . 0 -}}
{{- $driver := index . 1 -}}
{{- $groups := list (dict) -}}
{{- range (index $root.Values $driver).nodeGroups -}}
{{- $groups = append $groups . -}}
{{- end -}}
{{- range $g := $groups -}}
{{- $b := include "ferrovol.groupBackends" (list $root $g) | fromYaml -}}
{{- range $name := splitList " " (include "ferrovol.driverBackends" $driver) -}}
{{- if (index $b $name).enabled -}}true{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when a backend is on anywhere: at the top level or in a node group
(list $ name). Its classes, Secrets and controller config follow.
*/}}
{{- define "ferrovol.on" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- if (index $root.Values.backends $name).enabled -}}true{{- end -}}
{{- range $driver := list "local" "remote" -}}
{{- range (index $root.Values $driver).nodeGroups -}}
{{- if (index (.backends | default dict) $name | default dict).enabled -}}true{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The config central pieces (the controller, the classes' checks) take for
a backend that is on anywhere: the top level's when it is on there, else
the one config the groups that turn it on give it (list $ name).
*/}}
{{- define "ferrovol.centralConfig" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $b := index $root.Values.backends $name -}}
{{- if $b.enabled -}}
{{- $b.config -}}
{{- else -}}
{{- $configs := list -}}
{{- $groups := list -}}
{{- range $driver := list "local" "remote" -}}
{{- range (index $root.Values $driver).nodeGroups -}}
{{- $over := index (.backends | default dict) $name | default dict -}}
{{- if $over.enabled -}}
{{- $configs = append $configs ($over.config | default $b.config) | uniq -}}
{{- $groups = append $groups .name -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if gt (len $configs) 1 -}}
{{- fail (printf "backends.%s is off at the top level and on in node groups %s with different configs: the controller and the classes need one; turn it on at the top level with that config (the groups keep their own)" $name (join ", " $groups)) -}}
{{- end -}}
{{- first $configs | default "" -}}
{{- end -}}
{{- end -}}

{{/* "true" when a node group's view of the backends has one of the driver's on: (list $ $backends driver). */}}
{{- define "ferrovol.serves" -}}
{{- $b := index . 1 -}}
{{- range $name := splitList " " (include "ferrovol.driverBackends" (index . 2)) -}}
{{- if (index $b $name).enabled -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/*
A node plugin's config directory: 00-driver.toml (the node settings) and a
file per backend on. (list $ $backends driver).
*/}}
{{- define "ferrovol.nodeConfig" -}}
{{- $root := index . 0 -}}
{{- $b := index . 1 -}}
{{- $driver := index . 2 -}}
00-driver.toml: |
  [node]
  max_volumes_per_node = {{ int $root.Values.node.maxVolumesPerNode }}
  # Staging paths and publish targets only under the kubelet's root.
  allowed_paths = [{{ $root.Values.kubeletDir | quote }}]
{{- if eq $driver "remote" }}
  # Changes to volumes' I/O limits (ControllerModifyVolume, a claim moved to
  # another VolumeAttributesClass) are asked of the controller's Service.
  limits_from = "http://ferrovol-controller.{{ $root.Release.Namespace }}.svc:9809"
  limits_refresh_seconds = 10
{{- else }}
  # Changes to volumes' I/O limits (a claim moved to another
  # VolumeAttributesClass) reach the central controller, which offers them:
  # each node asks it, and takes its own volumes'.
  limits_from = "http://ferrovol-local-controller.{{ $root.Release.Namespace }}.svc:9809"
  limits_refresh_seconds = 10
{{- end }}
{{- range $name := splitList " " (include "ferrovol.driverBackends" $driver) }}
{{- $one := index $b $name }}
{{- if $one.enabled }}
{{ $name }}.toml: |
  {{- $one.config | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The remote controller's config directory. */}}
{{- define "ferrovol.controllerConfig" -}}
{{- $root := . -}}
00-driver.toml: |
  # Each backend has its own file here.
{{- range $name := splitList " " (include "ferrovol.driverBackends" "remote") }}
{{- $one := index $root.Values.backends $name }}
{{- if include "ferrovol.on" (list $root $name) }}
{{ $name }}.toml: |
  {{- include "ferrovol.centralConfig" (list $root $name) | nindent 2 }}
  {{- with $one.store }}
  {{- . | nindent 2 }}
  {{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The node affinity that keeps a driver's main DaemonSet off its groups'
nodes: (list $ driver).
*/}}
{{- define "ferrovol.affinity" -}}
{{- $root := index . 0 -}}
{{- $pods := index $root.Values (index . 1) -}}
{{- $affinity := deepCopy ($pods.node.affinity | default dict) -}}
{{- if $pods.nodeGroups -}}
{{- if ($affinity.nodeAffinity | default dict).requiredDuringSchedulingIgnoredDuringExecution -}}
{{- fail (printf "%s.node.affinity: a required node affinity and nodeGroups do not mix (the groups' exclusion is the DaemonSet's required node affinity)" (index . 1)) -}}
{{- end -}}
{{- $exprs := list -}}
{{- range $pods.nodeGroups -}}
{{- range $k, $v := .nodeSelector -}}
{{- $exprs = append $exprs (dict "key" $k "operator" "NotIn" "values" (list $v)) -}}
{{- end -}}
{{- end -}}
{{- $na := deepCopy ($affinity.nodeAffinity | default dict) -}}
{{- $_ := set $na "requiredDuringSchedulingIgnoredDuringExecution" (dict "nodeSelectorTerms" (list (dict "matchExpressions" $exprs))) -}}
{{- $_ := set $affinity "nodeAffinity" $na -}}
{{- end -}}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/*
Where a driver's node DaemonSet runs: (list $ driver group). A group's on
the nodes its label picks; the main one where its own values say, kept off
every group's nodes.
*/}}
{{- define "ferrovol.nodePlacement" -}}
{{- $root := index . 0 -}}
{{- $driver := index . 1 -}}
{{- $group := index . 2 -}}
{{- $p := (index $root.Values $driver).node -}}
{{- if $group.name }}
nodeSelector:
  {{- toYaml (merge (deepCopy $group.nodeSelector) $p.nodeSelector) | nindent 2 }}
{{- with $group.tolerations | default $p.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $group.affinity | default $p.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- else }}
{{- with $p.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $p.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- include "ferrovol.affinity" (list $root $driver) }}
{{- end }}
{{- end -}}

{{/* Checks a node group: a name and a one-label nodeSelector. */}}
{{- define "ferrovol.checkGroup" -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$" (.name | default "")) -}}
{{- fail (printf "nodeGroups: name %q is no DNS label of at most 32 characters" (.name | default "")) -}}
{{- end -}}
{{- if ne (len (.nodeSelector | default dict)) 1 -}}
{{- fail (printf "nodeGroups %s: the nodeSelector names exactly one label (the other node plugins stay off where it matches)" .name) -}}
{{- end -}}
{{- end -}}

{{/*
The v1.13 volume health capabilities on a ferrovol container, when
volumeHealth is on: an env entry, under the container's `env:`.
*/}}
{{- define "ferrovol.volumeHealthEnv" -}}
{{- if .Values.volumeHealth.enabled }}
- name: FERROVOL_VOLUME_HEALTH
  value: "true"
{{- end }}
{{- end -}}

{{/*
A controller pod's securityContext under Pod Security `restricted`: a
non-root user (with its fsGroup) and the runtime's seccomp profile.
*/}}
{{- define "ferrovol.restrictedPod" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 65532
  runAsGroup: 65532
  fsGroup: 65532
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{/*
A container's securityContext under Pod Security `restricted` (with the
pod's non-root user and seccomp profile).
*/}}
{{- define "ferrovol.restricted" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{/*
Checks that a class of backend `name` names only what that backend's
config has: (list $ name $class $configText). The config is read as the
driver reads it (TOML): the class's `backend` (by name, the type by
default), an nfs `export`, an rbd `pool`, an lvm or iscsi-store
`deviceClass`, and the Secret the chart makes for the backend.
*/}}
{{- define "ferrovol.checkClass" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $sc := index . 2 -}}
{{- $where := index . 3 -}}
{{- $text := index . 4 -}}
{{- $values := index $root.Values.backends $name -}}
{{- $config := fromToml $text -}}
{{- if hasKey $config "Error" -}}
{{- fail (printf "%s: not TOML the driver can read: %s" $where $config.Error) -}}
{{- end -}}
{{- $params := $sc.parameters | default dict -}}
{{- $ofType := list -}}
{{- range $config.backend | default list -}}
{{- if eq .type $name -}}{{- $ofType = append $ofType . -}}{{- end -}}
{{- end -}}
{{- /* A class without `backend` gets the config's default_backend, or its
one backend. */ -}}
{{- $wanted := $params.backend | default $config.default_backend | default (ternary (first $ofType | default dict).name $name (eq (len $ofType) 1)) | default $name -}}
{{- $found := dict -}}
{{- range $ofType -}}
{{- if eq (.name | default .type) $wanted -}}
{{- $found = . -}}
{{- end -}}
{{- end -}}
{{- $class := printf "class %s (backends.%s)" $sc.name $name -}}
{{- if not $found -}}
{{- fail (printf "%s names backend %q, but %s has no [[backend]] of type %q named so" $class $wanted $where $name) -}}
{{- end -}}
{{- with $params.export -}}
{{- $names := list -}}
{{- range $found.export | default list -}}{{- $names = append $names .name -}}{{- end -}}
{{- if not (has . $names) -}}
{{- fail (printf "%s names export %q, but %s has exports %v: add it there or change the class" $class . $where $names) -}}
{{- end -}}
{{- end -}}
{{- with $params.pool -}}
{{- if not (has . ($found.pools | default list)) -}}
{{- fail (printf "%s names pool %q, but %s has pools %v: add it there or change the class" $class . $where ($found.pools | default list)) -}}
{{- end -}}
{{- end -}}
{{- with $params.deviceClass -}}
{{- $names := list -}}
{{- range (($found.store | default dict).device_class | default $found.device_class) | default list -}}{{- $names = append $names .name -}}{{- end -}}
{{- if not (has . $names) -}}
{{- fail (printf "%s names device class %q, but %s has device classes %v: add it there or change the class" $class . $where $names) -}}
{{- end -}}
{{- end -}}
{{- range $k, $v := $params -}}
{{- if hasSuffix "-secret-name" $k -}}
{{- $secret := tpl (toString $v) $root -}}
{{- if ne $secret (($values.secret | default dict).name | default "") -}}
{{- fail (printf "%s hands %s Secret %q, but the chart's Secret for %s is %q (backends.%s.secret.name): name that one, or set secret.name to yours with secret.create=false" $class $k $secret $name (($values.secret | default dict).name | default "none") $name) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
Refuses a pool of image files (a `file` backend's, an iSCSI store's) that
is not below the folder the pod mounts from the host for its state: one
elsewhere would be inside the container, lost whenever the pod is
replaced. (list $where $configText $dir)
*/}}
{{- define "ferrovol.checkPools" -}}
{{- $where := index . 0 -}}
{{- $dir := index . 2 -}}
{{- $config := fromToml (index . 1) -}}
{{- range $config.backend | default list -}}
{{- range $pool := list .pool ((.store | default dict).pool) -}}
{{- if and $pool (not (hasPrefix (printf "%s/" $dir) (printf "%s/" (clean $pool)))) -}}
{{- fail (printf "%s: pool %q is not below %s, the folder the pod mounts from the host: inside the container it would be lost with every restart of the pod. Put it below %s (%s/pool)" $where $pool $dir $dir $dir) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
