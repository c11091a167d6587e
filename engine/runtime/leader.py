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
import os
import pickle
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from headroom.engine.config import EngineConfig
from headroom.engine.runtime.decode_graphs import CaptureReport
from headroom.engine.runtime.forward_batch import BatchItem
from headroom.engine.runtime.loader import load_config
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.runtime.parallel import join_group, leave_group, rank_device, shard_config
from headroom.engine.runtime.pass_mirror import Op, PassEncoder
from headroom.engine.runtime.ranks import RankProcesses
from headroom.engine.runtime.worker import memory_report, pool_report
from headroom.engine.sequence import Sequence

logger = logging.getLogger("headroom.engine.tp")


def build_runner(config: EngineConfig, on_fatal: Callable[[str], None] | None = None) -> ModelRunner:
    """The runner for config: one device, or config.tensor_parallel_size processes led from here."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    return LeaderRunner(config, on_fatal)


def exit_process(reason: str) -> None:
    logger.critical("tensor-parallel engine lost: %s; exiting", reason)
    logging.shutdown()
    os._exit(1)


class LeaderRunner(ModelRunner):
    def __init__(self, config: EngineConfig, on_fatal: Callable[[str], None] | None = None):
        size = config.tensor_parallel_size
        # Refuse a split the model's heads do not allow before any process starts.
        shard_config(load_config(Path(config.model_path)), size)
        if config.device.startswith("cuda"):
            last = rank_device(config.device, size - 1)
            if int(last.split(":")[1]) >= torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {size} on {config.device} needs {last}, but "
                                 f"{torch.cuda.device_count()} CUDA devices are visible")
        self.on_fatal = on_fatal or exit_process
        self._pending: list[Op] = []
        self._encoder = PassEncoder()
        self._threads = torch.get_num_threads()
        if not config.device.startswith("cuda"):
            # The ranks share the CPU's cores; idle OpenMP threads spinning in one rank starve the other.
            torch.set_num_threads(max(1, self._threads // size))
        self._store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        self.ranks = RankProcesses(config, self._store.port, self.on_fatal)
        try:
            self.ranks.expect("hello")
            device = rank_device(config.device, 0)
            super().__init__(replace(config, device=device), join_group(0, size, device, self._store))
            # Bytes each rank allocated, rank 0 first (compared with the plan's per-GPU ledger).
            self.rank_pools = [pool_report(self)] + [message[1] for message in self.ranks.expect("loaded")]
        except BaseException:
            self.ranks.stop(join_s=0)
            leave_group()
            torch.set_num_threads(self._threads)
            raise
        # Each rank's device memory (torch's peaks), rank 0 first, as of the last synchronize().
        self.rank_memory: list[dict[str, int]] = []
        for entry, pools in zip(self.ranks.ranks, self.rank_pools[1:], strict=True):
            logger.info("tensor-parallel rank %d of %d: pid %d on %s, bytes %s", entry.rank, size,
                        entry.process.pid, rank_device(config.device, entry.rank), pools)
        if self.ssm_pool is not None:
            # CacheManager copies checkpoints through ssm_pool.copy: every rank must copy its share too.
            self._local_copy = self.ssm_pool.copy
            self.ssm_pool.copy = self.copy_ssm  # type: ignore[method-assign]
        self.ranks.started.set()

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
        self.rank_memory = [memory_report(self)] + [message[1] for message in self.ranks.expect("synced")]

    def close(self) -> None:
        if self.ranks.closing:
            return
        self.ranks.stop(pickle.dumps([*self._pending, ("stop",)]))
        leave_group()
        torch.set_num_threads(self._threads)

    def _send(self, op: Op) -> None:
        message = pickle.dumps([*self._pending, op])
        self._pending.clear()
        self.ranks.send(message)
