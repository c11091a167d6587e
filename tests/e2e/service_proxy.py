"""kube-proxy's job for one Service port: listen on clusterIP:port, forward each connection to a ready pod.

The backend is chosen per connection from the pods the Service's selector picks right now, so moving
the selector moves new connections and leaves open ones alone, as with kube-proxy. No ready pod: the
connection is closed at once (a client sees a reset, as with a Service without endpoints).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from tests.e2e.containers import LOOPBACK

# (selector, targetPort) -> local ports of the ready pods that match.
Endpoints = Callable[[dict[str, str], str], list[int]]


class ServiceProxy:
    def __init__(self, address: str, port: int, endpoints: Endpoints):
        self.address, self.port = address, port
        self.selector: dict[str, str] = {}
        self.target_port = str(port)
        self._endpoints = endpoints
        self._server: asyncio.base_events.Server | None = None
        self._turn = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.address, self.port)

    def route(self, selector: dict[str, str], target_port: str) -> None:
        self.selector, self.target_port = dict(selector), target_port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        backends = self._endpoints(self.selector, self.target_port)
        if not backends:
            writer.close()
            return
        self._turn += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, backends[self._turn % len(backends)])
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(ConnectionError, OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), timeout=2)
