"""build_configmap: one ConfigMap per revision holding the plan, its engine flags and the spec snapshot.

The spec snapshot makes a revision rebuildable on its own: a rollback re-renders the last good
Deployment from this ConfigMap even after the user has changed the spec.
"""

from __future__ import annotations

import json
from typing import Any

from headroom.operator.labels import REVISION_LABEL, child_metadata, config_map_name
from headroom.operator.planning import PlannedRevision


def build_configmap(owner: dict[str, Any], planned: PlannedRevision) -> dict[str, Any]:
    """ConfigMap `<server>-plan-<revision>` with keys plan.json, engine-args, spec.json, revision."""
    name = config_map_name(owner["metadata"]["name"], planned.revision)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(owner, name, {REVISION_LABEL: planned.revision}),
        "data": {
            "plan.json": json.dumps(planned.plan.to_dict(), indent=1, sort_keys=True),
            # One flag or value per line, in order: easy to read and to paste.
            "engine-args": "\n".join(planned.plan.engine_args) + "\n",
            "spec.json": json.dumps(planned.spec.model_dump(by_alias=True, exclude_none=True), sort_keys=True),
            "revision": planned.revision,
        },
    }
