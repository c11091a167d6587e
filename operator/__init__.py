"""kopf operator: InferenceServer -> plan -> ConfigMap + Deployment + Service, gated by the smoke test."""
