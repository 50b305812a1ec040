"""Starting the ranks of a tensor-parallel engine.

Spawned (the default): the user's process is rank 0 and starts ranks 1..N-1 itself, one process each
(torch.multiprocessing's spawn context), on this host: rank r uses GPU r (CPU: gloo). Under torchrun
(RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set), every rank runs the user's script:
rank 0 goes on as the engine, the others turn into followers when they build the engine and exit when
rank 0 shuts down, so several hosts need no other code. Every wait here is bounded.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import ConfigError, EngineConfig
from .comm import Op, send_op
from .parallel_state import TPGroup

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("TERCEL_TP_INIT_TIMEOUT", "300")))
JOIN_TIMEOUT_S = 30.0
# NVLink multicast (NVLS / symmetric-memory multicast) stays off: it is not available on every
# machine these ranks run on, and NCCL's ring / tree all-reduce needs nothing from it
RANK_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    size: int
    local_rank: int
    local_size: int  # ranks on this host


def torchrun_rank() -> RankInfo | None:
    """This process's place when torchrun (or another launcher) set the usual variables, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return RankInfo(rank, size, int(os.environ.get("LOCAL_RANK", rank)), int(os.environ.get("LOCAL_WORLD_SIZE", size)))


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    if device.type != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def share_cpu_threads(config: EngineConfig, device: torch.device, size: int) -> None:
    """On CPU the ranks share this host's cores: each takes its share (unless threads= is set), else
    every rank's thread pool spins on every core and a step runs several times slower."""
    from ..cpu_threads import physical_cores

    if device.type == "cpu":
        threads = config.kernel.threads or max(1, physical_cores() // size)
        torch.set_num_threads(threads)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: EngineConfig, device: torch.device) -> TPGroup:
    """Rank 0's group (the ranks started and connected), or, on a torchrun rank > 0, the follower's
    whole life: it serves rank 0's forwards, then exits the process."""
    size = config.parallel.tp_size
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    share_cpu_threads(config, device, size)
    info = torchrun_rank()
    if info is not None and info.size > 1:
        if info.size != size:
            raise ConfigError(f"tp_size={size} but torchrun started WORLD_SIZE={info.size} ranks; pass "
                              f"--nproc-per-node / --nnodes so that they multiply to tp_size.")
        dev = rank_device(device, info.local_rank)
        store, _, _ = next(dist.rendezvous("env://", info.rank, info.size, timeout=INIT_TIMEOUT))
        group = TPGroup.create(store, info.rank, info.size, dev)
        if info.rank != 0:
            from .follower import serve

            serve(group, config)
            raise SystemExit(0)
        return group
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=_spawned_follower, args=(rank, size, port, config, device.type),
                        name=f"tercel-tp-rank{rank}", daemon=True)
        p.start()
        procs.append(p)
    try:
        store = dist.TCPStore("127.0.0.1", port, size, True, timeout=INIT_TIMEOUT, wait_for_workers=True)
        group = TPGroup.create(store, 0, size, rank_device(device, 0))
    except BaseException:
        _stop(procs)
        raise
    group.followers = procs
    return group


def _spawned_follower(rank: int, size: int, port: int, config: EngineConfig, device_type: str) -> None:
    from .follower import exit_with_parent, serve

    exit_with_parent()
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    dev = rank_device(torch.device(device_type), rank)
    share_cpu_threads(config, dev, size)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=INIT_TIMEOUT)
    serve(TPGroup.create(store, rank, size, dev), config)


def shutdown(group: TPGroup) -> None:
    """Rank 0: tell the followers to exit, and wait for the ones it spawned (bounded; then killed)."""
    if group.closed:
        return
    group.closed = True
    try:
        if group.serving:
            send_op(group, Op.SHUTDOWN)
        elif not group.started:  # rank 0 failed while starting: the followers wait in agree_start
            group.agree_start(-1)
    except Exception as e:  # a follower already gone: nothing to tell
        log.warning("tensor parallel shutdown: %s", e)
    _stop(group.followers)


def _stop(procs: list) -> None:
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            log.warning("tensor-parallel rank process %s did not exit; terminating it", p.name)
            p.terminate()
            p.join(5)
