"""`make demo`: the operator's story on one machine, printed as a user would see it.

API emulator + the real `headroom operator` (validating webhook included) + the node agent + the engine on
the embedded tiny model: kubectl apply -> the plan -> the Deployment's engine -> the smoke report -> one
answer through the Service -> a change whose engine fails the smoke test -> the rollback.
Run from a checkout: `make demo`, or `.venv/bin/python tests/e2e/demo.py` (`headroom demo --engine-only`
is the engine alone).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    # As pytest does: the checkout's root on sys.path (the stdlib `operator` is already imported by then).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headroom.engine.plan import format_bytes  # noqa: E402

from tests.e2e.cluster import LocalCluster  # noqa: E402
from tests.e2e.story import (  # noqa: E402
    EXAMPLE,
    NAME,
    child_path,
    complete,
    condition,
    models_folder,
    served_plan,
    server_path,
    service_url,
    shorter_context_args,
    status,
)

PLAN_FIELDS = ("contextLength", "maxTotalTokens", "chunkedPrefillSize", "ssmSlots", "maxRunningRequests",
               "memFractionStatic", "kvCacheDtype", "bindingConstraint")


def short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Demo:
    def __init__(self, cluster: LocalCluster):
        self.cluster, self.started = cluster, time.monotonic()

    def say(self, title: str) -> None:
        print(f"\n== [{time.monotonic() - self.started:5.1f} s] {title}", flush=True)

    def kubectl(self, *args: str) -> None:
        print(f"$ kubectl {' '.join(args)}")
        result = self.cluster.kubectl(*args, check=False)
        print((result.stdout + result.stderr).rstrip(), flush=True)

    def wait(self, predicate, timeout: float = 240) -> dict:
        return self.cluster.wait_for(server_path(self.cluster), predicate, timeout=timeout)

    def smoke_report(self, body: dict) -> None:
        smoke = status(body).get("lastSmoke") or {}
        print(f"smoke test of revision {smoke.get('revision')}: {smoke.get('result')}")
        for name, check in (smoke.get("checks") or {}).items():
            print(f"  {check['status'].upper():<5} {name}: {short(check['reason'])}")

    def answer(self, prompt: str) -> None:
        url = service_url(self.cluster)
        began = time.monotonic()
        reply = complete(url, prompt, max_tokens=16)
        plan = served_plan(url)
        print(f"POST {url}/v1/completions  prompt={prompt!r}")
        print(f"  -> {reply['usage']['completion_tokens']} tokens in {time.monotonic() - began:.2f} s: "
              f"{reply['choices'][0]['text']!r}  (random weights: the text is noise)")
        print(f"  the engine behind the Service runs context {plan['context_length']}, "
              f"{plan['max_running_requests']} running requests (its /plan)")


def run_story(cluster: LocalCluster) -> None:
    demo = Demo(cluster)
    demo.say(f"cluster up: API emulator {cluster.url}, `headroom operator` pid {cluster.operator.pid if cluster.operator else '?'}, "
             "node agent; CRD and validating webhook installed")
    demo.kubectl("apply", "-f", str(EXAMPLE.relative_to(EXAMPLE.parents[1])))
    applied = time.monotonic()
    body = demo.wait(lambda o: status(o).get("plan"), timeout=30)
    demo.say(f"the plan, in status {time.monotonic() - applied:.2f} s after kubectl apply returned")
    plan = status(body)["plan"]
    for field in PLAN_FIELDS:
        print(f"  {field:<20} {plan.get(field)}")
    ledger = ", ".join(f"{k} {format_bytes(v)}" for k, v in (plan.get("ledger") or {}).items())
    print(f"  {'ledger':<20} {ledger}")
    revision = status(body)["currentRevision"]
    config_map = cluster.get(child_path(cluster, "configmaps", f"{NAME}-plan-{revision}")) or {}
    print(f"  engine flags (ConfigMap {NAME}-plan-{revision}): {' '.join(config_map['data']['engine-args'].split())}")
    demo.kubectl("get", "inferenceservers")

    cluster.wait_for(child_path(cluster, "deployments", NAME), lambda o: True, timeout=30)
    demo.say("the Deployment's pod: the node agent runs its container's command and args")
    deadline = time.monotonic() + 60
    while (cluster.namespace, NAME) not in cluster.agent.pods and time.monotonic() < deadline:
        time.sleep(0.1)
    pod = cluster.agent.pods[(cluster.namespace, NAME)]
    print("  " + " ".join(Path(pod.command.argv[0]).name if i == 0 else a for i, a in enumerate(pod.command.argv)))
    body = demo.wait(lambda o: status(o).get("phase") in ("Ready", "Failed", "Degraded"))
    demo.say("ready -> the smoke test with default thresholds -> Validated")
    demo.kubectl("get", "inferenceservers,deployments,services,pods")
    demo.smoke_report(body)
    validated = condition(body, "Validated")
    print(f"condition Validated={validated.get('status')} ({validated.get('reason')})")

    demo.say("one answer through the Service (its clusterIP, where the node agent forwards like kube-proxy)")
    demo.answer("Hello, headroom!")

    good = status(body)["lastGoodRevision"]
    bad_args = shorter_context_args(body["spec"], 512)
    demo.say(f"a bad change: extraArgs {bad_args} run the engine at a shorter context than the plan promises")
    patch = json.dumps({"spec": {"engine": {"extraArgs": bad_args}}})
    demo.kubectl("patch", "inferenceserver", NAME, "--type=merge", "-p", patch)
    body = demo.wait(lambda o: status(o).get("failedRevision"))
    demo.say("the smoke test fails the new revision")
    demo.smoke_report(body)
    print(f"condition Validated=False: {short(condition(body, 'Validated').get('message', ''))}")
    body = demo.wait(lambda o: status(o).get("phase") == "Degraded")
    demo.say(f"rolled back: the last good revision {good} runs and serves again")
    demo.kubectl("get", "inferenceservers,pods")
    events = (cluster.get(f"/api/v1/namespaces/{cluster.namespace}/events") or {}).get("items", [])
    for event in events:
        print(f"  event {event.get('type'):<8} {event.get('reason'):<12} {short(event.get('message', ''))}")
    demo.answer("Still there?")

    demo.kubectl("delete", "inferenceserver", NAME, "--wait=false")
    cluster.wait_for(f"/api/v1/namespaces/{cluster.namespace}/pods", lambda o: not o["items"], timeout=60)
    demo.say("deleted: the operator removed the Deployment, Services and plan ConfigMaps; the engine stopped")
    demo.kubectl("get", "inferenceservers,deployments,services,pods")


def main() -> int:
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="headroom-demo-") as tmp:
        root = Path(tmp)
        with LocalCluster(root, {"models": models_folder(root / "models")}) as cluster:
            try:
                run_story(cluster)
            except AssertionError as exc:
                print(f"demo failed: {exc}", file=sys.stderr)
                return 1
    print(f"\ndemo took {time.monotonic() - began:.1f} s (cluster start and stop included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
