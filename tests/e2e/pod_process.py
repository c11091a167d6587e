"""One pod of a Deployment as a local process, with the kubelet's probe and restart rules.

Probes keep their path, port and time budgets: a probe that fails keeps its old verdict until it has
failed for periodSeconds * failureThreshold seconds, as in Kubernetes; only the polling is faster
(at most every `poll_s` seconds), so that readiness is seen promptly. The startup probe gates the
others; a failed startup or liveness probe, or an exit, restarts the process with a doubling back-off
(restartPolicy Always).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.containers import LOOPBACK, LocalCommand

# Loaded in the parent: the forked child only makes the call (no dlopen between fork and exec).
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the thread that started it dies (Linux), so a killed test run
    leaves no engine behind on a shared 2-core machine. Elsewhere a no-op."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Probe:
    """One httpGet probe; `passing` is its current verdict."""

    spec: dict[str, Any] | None
    passing: bool = False
    failing_since: float | None = None

    def budget_s(self) -> float:
        spec = self.spec or {}
        return float(spec.get("periodSeconds", 10)) * float(spec.get("failureThreshold", 3))

    def url(self, ports: dict[str, int]) -> str:
        get = (self.spec or {})["httpGet"]
        return f"http://{LOOPBACK}:{ports[str(get['port'])]}{get.get('path', '/')}"

    async def check(self, client: httpx.AsyncClient, ports: dict[str, int], now: float) -> bool:
        """Poll once; returns False only when the failures have lasted the probe's whole budget."""
        if self.spec is None:
            self.passing = True
            return True
        try:
            timeout = float(self.spec.get("timeoutSeconds", 1))
            ok = 200 <= (await client.get(self.url(ports), timeout=timeout)).status_code < 400
        except httpx.HTTPError:
            ok = False
        if ok:
            self.passing, self.failing_since = True, None
        else:
            self.failing_since = self.failing_since if self.failing_since is not None else now
            if now - self.failing_since >= self.budget_s():
                self.passing = False
        return ok or self.failing_since is None or now - self.failing_since < self.budget_s()


@dataclass
class PodProcess:
    """The process of one pod: started from `command`, logging to `log_path`."""

    name: str
    labels: dict[str, str]
    template_hash: str
    command: LocalCommand
    container: dict[str, Any]
    log_path: Path
    poll_s: float = 0.25
    restarts: int = 0
    ready: bool = False
    last_exit: str = ""
    process: asyncio.subprocess.Process | None = None
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pod-{self.name}")

    async def _spawn(self) -> asyncio.subprocess.Process:
        log = self.log_path.open("ab")
        try:
            # A session of its own, so that stopping the pod stops every process it started.
            return await asyncio.create_subprocess_exec(
                *self.command.argv, env=self.command.env, stdout=log, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True, cwd=self.log_path.parent,
                preexec_fn=die_with_parent,
            )
        finally:
            log.close()

    async def _run(self) -> None:
        backoff = 1.0
        async with httpx.AsyncClient(trust_env=False) as client:
            while True:
                self.process = await self._spawn()
                reason = await self._supervise(client, self.process)
                self.ready = False
                await self._kill(self.process)
                self.restarts += 1
                self.last_exit = reason
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30.0)

    async def _supervise(self, client: httpx.AsyncClient, process: asyncio.subprocess.Process) -> str:
        """Probe until the process must be restarted; returns why."""
        startup, liveness = Probe(self.container.get("startupProbe")), Probe(self.container.get("livenessProbe"))
        readiness = Probe(self.container.get("readinessProbe"))
        started = time.monotonic()
        while process.returncode is None:
            now = time.monotonic()
            if not startup.passing:
                await startup.check(client, self.command.ports, now)
                if not startup.passing and now - started >= startup.budget_s():
                    return f"startup probe failed for {startup.budget_s():.0f} s"
            else:
                if not await liveness.check(client, self.command.ports, now):
                    return f"liveness probe failed for {liveness.budget_s():.0f} s"
                await readiness.check(client, self.command.ports, now)
                self.ready = readiness.passing
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(process.wait(), timeout=self.poll_s)
        return f"exited with code {process.returncode}"

    @staticmethod
    async def _kill(process: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
        """SIGTERM to the pod's process group, SIGKILL after the grace period (terminationGracePeriod)."""
        if process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=grace_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def stop(self) -> None:
        """Stop supervising and end the process (Recreate: the caller waits for this before the next pod)."""
        self.ready = False
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.process is not None:
            await self._kill(self.process)

    def log_tail(self, num_chars: int = 3000) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text[-num_chars:]
