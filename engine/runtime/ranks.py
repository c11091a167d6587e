"""The processes of tensor-parallel ranks 1..N-1, as rank 0 sees them: start, message, watch, stop.

Each rank is a spawned process (engine/runtime/worker.py) with a pipe to rank 0. A rank that exits while
the engine runs calls on_fatal at once: the group's collectives can no longer meet, so the engine must not
go on half alive. During start-up, the start-up path reports a failing rank itself (with the rank's own
message); the watcher steps in only if start-up stays stuck, waiting for that rank to join the group.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from headroom.engine.config import EngineConfig
from headroom.engine.runtime.worker import follower_main

logger = logging.getLogger("headroom.engine.tp")

# Loading a share of a large checkpoint can take minutes; a rank silent for longer is taken as stuck.
STARTUP_TIMEOUT_S = 900.0
_STARTUP_GRACE_S = 10.0


@dataclass
class Rank:
    rank: int
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection


class RankProcesses:
    def __init__(self, config: EngineConfig, store_port: int, on_fatal: Callable[[str], None]):
        """Spawn ranks 1..tensor_parallel_size-1; they join the group through the TCPStore at store_port."""
        self.on_fatal = on_fatal
        self.started = threading.Event()
        self._closing = threading.Event()
        context = multiprocessing.get_context("spawn")
        size = config.tensor_parallel_size
        self.ranks: list[Rank] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=follower_main, name=f"headroom-tp-rank{rank}", daemon=True,
                                      args=(rank, size, store_port, config, theirs, os.getpid()))
            process.start()
            theirs.close()
            self.ranks.append(Rank(rank, process, ours))
        threading.Thread(target=self._watch, name="headroom-tp-watch", daemon=True).start()

    def send(self, message: bytes) -> None:
        """The same message to every rank, in rank order."""
        for entry in self.ranks:
            try:
                entry.conn.send_bytes(message)
            except OSError as exc:
                self.on_fatal(f"tensor-parallel rank {entry.rank} is unreachable: {exc}")
                raise

    def expect(self, kind: str) -> list[tuple[Any, ...]]:
        """Every rank's next message, each of which must be `kind`."""
        return [self._expect(entry, kind) for entry in self.ranks]

    def _expect(self, entry: Rank, kind: str) -> tuple[Any, ...]:
        ready = wait([entry.conn, entry.process.sentinel], STARTUP_TIMEOUT_S)
        if entry.conn in ready:
            try:
                message = entry.conn.recv()
            except EOFError:
                message = ("error", "closed its pipe")
            if message[0] == kind:
                return message
            raise RuntimeError(f"tensor-parallel rank {entry.rank}: {message[1] if len(message) > 1 else message}")
        if ready:
            entry.process.join(5)
            raise RuntimeError(f"tensor-parallel rank {entry.rank} exited with code {entry.process.exitcode}")
        raise RuntimeError(f"tensor-parallel rank {entry.rank} sent no {kind!r} within {STARTUP_TIMEOUT_S:.0f} s")

    def _watch(self) -> None:
        sentinels = {entry.process.sentinel: entry for entry in self.ranks}
        done = wait(list(sentinels))
        if not self.started.is_set():
            self._closing.wait(_STARTUP_GRACE_S)
        if not self._closing.is_set():
            entry = sentinels[done[0]]  # type: ignore[index]
            entry.process.join(1)
            self.on_fatal(f"tensor-parallel rank {entry.rank} exited with code {entry.process.exitcode}")

    @property
    def closing(self) -> bool:
        return self._closing.is_set()

    def stop(self, message: bytes | None = None, join_s: float = 30.0) -> None:
        """Send the last message (the stop op), wait up to join_s for the ranks to end, kill what is left."""
        self._closing.set()
        for entry in self.ranks:
            if message is not None:
                try:
                    entry.conn.send_bytes(message)
                except OSError:
                    logger.warning("tensor-parallel rank %d was gone before it was stopped", entry.rank)
        for entry in self.ranks:
            entry.process.join(join_s)
            if entry.process.is_alive():
                entry.process.kill()
                entry.process.join(5)
            entry.conn.close()
