"""An APPROXIMATION of API-server validation of custom resources, for tests without a cluster.

openAPIV3Schema -> JSON Schema (jsonschema), structural defaults applied first as the API server
does, then every x-kubernetes-validations rule evaluated with cel-python on the object at its
path. Not covered: Kubernetes' CEL extension functions, oldSelf transition rules, list-type
semantics, pruning of unknown fields, cost limits.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

_K8S_KEYS = ("x-kubernetes-validations", "x-kubernetes-preserve-unknown-fields", "x-kubernetes-int-or-string")


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in schema.items() if k not in _K8S_KEYS and k not in ("properties", "items", "additionalProperties")}
    if schema.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if "properties" in schema:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            # Unknown fields are pruned by the API server; a test treats them as errors to catch typos.
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = to_json_schema(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = to_json_schema(schema["items"])
    return out


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill defaults, and type JSON integers in `number` fields as doubles (as CEL sees them there)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, dict):
        return value
    for key, sub in (schema.get("properties") or {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = apply_defaults(value[key], sub)
    return value


def cel_violations(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Messages of every failing rule, prefixed with the field path."""
    env = celpy.Environment()
    messages: list[str] = []
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        try:
            admitted = bool(program.evaluate({"self": celpy.json_to_cel(value)}))
        except celpy.CELEvalError as exc:
            # The API server rejects an object whose rule fails to evaluate, naming the error.
            admitted, rule = False, {**rule, "message": f"{rule.get('message', '')} (evaluation error: {exc.args[0]})"}
        if not admitted:
            messages.append(f"{path or '<root>'}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                messages += cel_violations(value[key], sub, f"{path}.{key}" if path else key)
    return messages


def validate_custom_resource(obj: dict[str, Any], crd: dict[str, Any]) -> list[str]:
    """Errors an API server would (approximately) report for obj; [] when it would admit it."""
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    # The API server supplies these for every kind; the CRD's schema leaves them out.
    schema["properties"].update({
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
    })
    obj = apply_defaults(copy.deepcopy(obj), schema)
    validator = jsonschema.Draft7Validator(to_json_schema(schema))
    errors = [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(obj)]
    return errors or cel_violations(obj, schema)
