{{/* An image of anneal's registry: include "anneal.image" (list . "manager") */}}
{{- define "anneal.image" -}}
{{- $root := index . 0 -}}
{{- $registry := required "image.registry is required: the registry holding anneal's images (REGISTRY of REGISTRY/manager, REGISTRY/agent, REGISTRY/bootd; docs/kubernetes.md)" $root.Values.image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $registry) (index . 1) (default $root.Chart.AppVersion $root.Values.image.tag) -}}
{{- end -}}

{{- define "anneal.labels" -}}
app.kubernetes.io/part-of: anneal
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The agent API certificate's names, one a line: provisioning.address,
loadBalancerIP, externalIPs, then agentApi.names; duplicates dropped. */}}
{{- define "anneal.agentApiNames" -}}
{{- $names := list -}}
{{- with .Values.provisioning.address }}{{ $names = append $names . }}{{ end -}}
{{- with .Values.agentApi.loadBalancerIP }}{{ $names = append $names . }}{{ end -}}
{{- range .Values.agentApi.externalIPs }}{{ $names = append $names . }}{{ end -}}
{{- range .Values.agentApi.names }}{{ $names = append $names . }}{{ end -}}
{{- range uniq $names }}
{{ . }}
{{- end -}}
{{- end -}}

{{/* The agent API URL bootd writes into boot scripts (empty: none known). */}}
{{- define "anneal.agentApiUrl" -}}
{{- if .Values.agentApi.url -}}
{{ .Values.agentApi.url }}
{{- else -}}
{{- $names := include "anneal.agentApiNames" . | trim | splitList "\n" | compact -}}
{{- if $names -}}
{{- $host := first $names -}}
{{- if contains ":" $host }}{{ $host = printf "[%s]" $host }}{{ end -}}
{{- $port := ternary .Values.agentApi.nodePort .Values.agentApi.port (eq .Values.agentApi.expose "NodePort") -}}
https://{{ $host }}:{{ $port }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Contradictory values fail the render, naming the value to change. */}}
{{- define "anneal.validate" -}}
{{- $expose := .Values.agentApi.expose -}}
{{- if not (has $expose (list "LoadBalancer" "NodePort" "hostNetwork" "ClusterIP")) -}}
{{- fail (printf "agentApi.expose must be LoadBalancer, NodePort, hostNetwork or ClusterIP, not %q" $expose) -}}
{{- end -}}
{{- $hostNet := or (eq $expose "hostNetwork") .Values.provisioning.hostNetwork -}}
{{- if and $hostNet (ne .Values.namespace.podSecurity "privileged") .Values.namespace.create -}}
{{- fail (printf "namespace.podSecurity %q refuses pods on the host's network (agentApi.expose=hostNetwork or provisioning.hostNetwork=true): set namespace.podSecurity=privileged or provisioning.hostNetwork=false" .Values.namespace.podSecurity) -}}
{{- end -}}
{{- if not (has .Values.namespace.podSecurity (list "privileged" "baseline" "restricted")) -}}
{{- fail (printf "namespace.podSecurity must be privileged, baseline or restricted, not %q" .Values.namespace.podSecurity) -}}
{{- end -}}
{{- if and (eq $expose "hostNetwork") (gt (int .Values.manager.replicas) 1) -}}
{{- fail "agentApi.expose=hostNetwork runs the manager on the node's network: set manager.replicas=1 (two replicas would need two nodes holding provisioning.address)" -}}
{{- end -}}
{{- if and .Values.contentStore.hostPath (ne .Values.contentStore.accessMode "ReadWriteOnce") -}}
{{- fail "contentStore.hostPath is one node's directory: set contentStore.accessMode=ReadWriteOnce" -}}
{{- end -}}
{{- end -}}
