"""A tensor-parallel rank other than 0: its own process (spawned by engine/runtime/leader.py), its own device.

It loads its share of the weights and pools, then replays rank 0's ops (engine/runtime/pass_mirror.py) from
a pipe until told to stop. Any failure ends the process: a rank that went wrong cannot rejoin the group's
collectives, and rank 0 takes the server down when it sees this process exit. It also exits when rank 0's
process is gone (the pipe closes, or the parent changes while a collective waits forever).
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
import time
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from headroom.engine.config import EngineConfig
from headroom.engine.runtime.model_runner import ModelRunner
from headroom.engine.runtime.parallel import join_group, leave_group, rank_device
from headroom.engine.runtime.pass_mirror import PassMirror

logger = logging.getLogger("headroom.engine.tp")

_PARENT_POLL_S = 0.5


def pool_report(runner: ModelRunner) -> dict[str, int]:
    """Bytes this rank allocated: weights, KV pool, SSM pool (compared with the plan's per-GPU ledger)."""
    ssm = runner.ssm_pool.nbytes() if runner.ssm_pool is not None else 0
    return {"weights": runner.weight_bytes, "kv_pool": runner.kv_pool.nbytes(), "ssm_pool": ssm}


def memory_report(runner: ModelRunner) -> dict[str, int]:
    """This rank's device memory: torch's peak allocation and reservation, bytes."""
    if runner.device.type != "cuda":
        return {}
    return {"peak_allocated": torch.cuda.max_memory_allocated(runner.device),
            "peak_reserved": torch.cuda.max_memory_reserved(runner.device)}


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="headroom-tp-parent", daemon=True).start()


def follower_main(rank: int, size: int, store_port: int, config: EngineConfig, conn: Connection, parent_pid: int) -> None:
    """Entry point of rank `rank`; config is rank 0's (device as configured, before rank_device)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    _exit_with_parent(parent_pid)
    try:
        conn.send(("hello",))
        device = rank_device(config.device, rank)
        if device == "cpu":
            # The ranks share the CPU's cores (engine/runtime/leader.py divides rank 0's alike).
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False)
        tp = join_group(rank, size, device, store)
        runner = ModelRunner(replace(config, device=device), tp)
        conn.send(("loaded", pool_report(runner)))
        _serve(runner, conn)
    except EOFError:
        logger.error("rank 0 closed the pipe; exiting")
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - every failure ends this rank, with the reason sent first
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        finally:
            os._exit(1)
    leave_group()


def _serve(runner: ModelRunner, conn: Connection) -> None:
    mirror = PassMirror()
    while True:
        for op in pickle.loads(conn.recv_bytes()):
            kind = op[0]
            if kind == "forward":
                runner.forward(mirror.decode(op[1]), all_positions=op[2])
            elif kind == "release":
                seq = mirror.release(op[1])
                if seq is not None:
                    runner.release(seq)
            elif kind == "copy":
                assert runner.ssm_pool is not None
                runner.ssm_pool.copy(op[1], op[2])
            elif kind == "capture":
                runner.capture_decode_graphs()
            elif kind == "sync":
                runner.synchronize()
                conn.send(("synced", memory_report(runner)))
            elif kind == "stop":
                return
            else:
                raise RuntimeError(f"unknown tensor-parallel op {kind!r}")
