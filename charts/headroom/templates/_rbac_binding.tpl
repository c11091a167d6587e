{{/*
Binds one ClusterRole to the operator's ServiceAccount: cluster-wide when every namespace is watched,
otherwise one RoleBinding per watched namespace, so namespaced rights stop at those namespaces.
Arguments: (dict "root" $ "role" "<ClusterRole name>" "clusterScoped" bool).
*/}}
{{- define "headroom.bindClusterRole" -}}
{{- $root := .root }}
{{- if or .clusterScoped (empty $root.Values.operator.watchNamespaces) }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: {{ .role }}
  labels:
    {{- include "headroom.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ .role }}
subjects:
  - kind: ServiceAccount
    name: {{ include "headroom.serviceAccountName" $root }}
    namespace: {{ $root.Release.Namespace }}
{{- else }}
{{- range $namespace := $root.Values.operator.watchNamespaces }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: {{ $.role }}
  namespace: {{ $namespace }}
  labels:
    {{- include "headroom.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $.role }}
subjects:
  - kind: ServiceAccount
    name: {{ include "headroom.serviceAccountName" $root }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}
{{- end }}
