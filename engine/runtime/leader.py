"""Rank 0 of a tensor-parallel engine: a ModelRunner over its own share that also drives the other ranks.

build_runner(config) is how the loop and the library get a runner: a plain ModelRunner on one device, or a
LeaderRunner that spawns ranks 1..N-1 (engine/runtime/worker.py, one process a device), joins them through
torch.distributed, and sends each runner call that changes device state (forward, release, SSM copy,
decode-graph capture) to them before doing it itself, in order (engine/runtime/pass_mirror.py). The
scheduler and the cache bookkeeping run on rank 0 only and never know.

Failure is all or nothing: a rank that exits, or a pass that fails on rank 0 once the other ranks are in
it, calls on_fatal (default: end this process with status 1), since the ranks' collectives can no longer
meet; a half-alive engine would hang or answer garbage.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
from headroom.engine.config import EngineConfig
from headroom.engine.runtime.decode_graphs import CaptureReport
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.runtime.parallel import join_group, leave_group, rank_device
from headroom.engine.runtime.pass_mirror import Op, PassEncoder
from headroom.engine.runtime.worker import follower_main, memory_report, pool_report
from headroom.engine.sequence import Sequence

logger = logging.getLogger("headroom.engine.tp")

# Loading a share of a large checkpoint can take minutes; a rank silent for longer is taken as stuck.
STARTUP_TIMEOUT_S = 900.0


def build_runner(config: EngineConfig, on_fatal: Callable[[str], None] | None = None) -> ModelRunner:
    """The runner for config: one device, or config.tensor_parallel_size processes led from here."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    return LeaderRunner(config, on_fatal)


def exit_process(reason: str) -> None:
    logger.critical("tensor-parallel engine lost: %s; exiting", reason)
    logging.shutdown()
    os._exit(1)


@dataclass
class _Rank:
    rank: int
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection


class LeaderRunner(ModelRunner):
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None] | None = None):
        size = config.tensor_parallel_size
        self.on_fatal = on_fatal or exit_process
        self._closing = threading.Event()
        self._pending: list[Op] = []
        self._encoder = PassEncoder()
        self._threads = torch.get_num_threads()
        if not config.device.startswith("cuda"):
            # The ranks share the CPU's cores; idle OpenMP threads spinning in one rank starve the other.
            torch.set_num_threads(max(1, self._threads // size))
        context = multiprocessing.get_context("spawn")
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        self._ranks: list[_Rank] = []
        for rank in range(1, size):
            ours, theirs = context.Pipe()
            process = context.Process(target=follower_main, name=f"headroom-tp-rank{rank}", daemon=True,
                                      args=(rank, size, store.port, config, theirs, os.getpid()))
            process.start()
            theirs.close()
            self._ranks.append(_Rank(rank, process, ours))
        try:
            for entry in self._ranks:
                self._expect(entry, "hello")
            device = rank_device(config.device, 0)
            super().__init__(replace(config, device=device), join_group(0, size, device, store))
            # Bytes each rank allocated, rank 0 first (the test compares them with the plan's ledger).
            self.rank_pools = [pool_report(self)] + [self._expect(entry, "loaded")[1] for entry in self._ranks]
        except BaseException:
            self._kill()
            raise
        self._store = store
        for entry, pools in zip(self._ranks, self.rank_pools[1:], strict=True):
            logger.info("tensor-parallel rank %d of %d: pid %d on %s, bytes %s", entry.rank, size,
                        entry.process.pid, rank_device(config.device, entry.rank), pools)
        if self.ssm_pool is not None:
            # CacheManager copies checkpoints through ssm_pool.copy: every rank must copy its share too.
            self._local_copy = self.ssm_pool.copy
            self.ssm_pool.copy = self.copy_ssm  # type: ignore[method-assign]
        threading.Thread(target=self._watch, name="headroom-tp-watch", daemon=True).start()

    def forward(self, items: list[BatchItem], all_positions: bool = False) -> torch.Tensor:
        self._send(("forward", [self._encoder.encode(item) for item in items], all_positions))
        try:
            return super().forward(items, all_positions)
        except BaseException as exc:
            # The other ranks are in this pass's collectives and cannot leave them.
            self.on_fatal(f"rank 0's pass failed: {type(exc).__name__}: {exc}")
            raise

    def release(self, seq: Sequence) -> None:
        self._pending.append(("release", seq.request_id))
        self._encoder.forget(seq.request_id)
        super().release(seq)

    def copy_ssm(self, src: int, dst: int) -> None:
        """SSMPool.copy on every rank (CacheManager's copy-on-write of checkpoints)."""
        assert self.ssm_pool is not None
        self._pending.append(("copy", src, dst))
        self._local_copy(src, dst)

    def capture_decode_graphs(self) -> CaptureReport:
        self._send(("capture",))
        return super().capture_decode_graphs()

    def synchronize(self) -> None:
        """Every rank has run every op sent so far; their device memory reports land in rank_memory."""
        self._send(("sync",))
        super().synchronize()
        self.rank_memory = [memory_report(self)] + [self._expect(entry, "synced")[1] for entry in self._ranks]

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._send(("stop",))
        for entry in self._ranks:
            entry.process.join(30)
        self._kill()
        leave_group()
        torch.set_num_threads(self._threads)

    def _send(self, op: Op) -> None:
        message = pickle.dumps([*self._pending, op])
        self._pending.clear()
        for entry in self._ranks:
            try:
                entry.conn.send_bytes(message)
            except OSError as exc:
                self.on_fatal(f"rank {entry.rank} is unreachable: {exc}")
                raise

    def _expect(self, entry: _Rank, kind: str) -> tuple[Any, ...]:
        """The next message of a rank, which must be `kind`; a rank that dies or reports an error raises."""
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
        """Take the engine down as soon as any other rank's process ends (unless we are closing)."""
        sentinels = {entry.process.sentinel: entry for entry in self._ranks}
        done = wait(list(sentinels))
        if not self._closing.is_set():
            entry = sentinels[done[0]]  # type: ignore[index]
            entry.process.join(1)
            self.on_fatal(f"tensor-parallel rank {entry.rank} exited with code {entry.process.exitcode}")

    def _kill(self) -> None:
        self._closing.set()
        for entry in self._ranks:
            if entry.process.is_alive():
                entry.process.kill()
            entry.process.join(5)
            entry.conn.close()
