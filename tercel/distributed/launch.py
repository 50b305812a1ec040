"""Starting the ranks of a tensor-parallel engine.

Spawned (the default): the user's process is rank 0 and starts ranks 1..N-1 itself, one process each
(torch.multiprocessing's spawn context), on this host: rank r uses GPU r (CPU: gloo). Under torchrun
(RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set), every rank runs the user's script:
rank 0 goes on as the engine, the others turn into followers when they build the engine and exit when
rank 0 shuts down, so several hosts need no other code. Every wait here is bounded.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..config import ConfigError, EngineConfig
from ..dev_overrides import env
from .comm import Op, send_op
from .parallel_state import TPGroup

log = logging.getLogger(__name__)

INIT_TIMEOUT = datetime.timedelta(seconds=int(env("TERCEL_TP_INIT_TIMEOUT")))
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

            try:
                serve(group, config)
            finally:
                group.release()
            raise SystemExit(0)
        return group
    port = _free_port()
    ctx = mp.get_context("spawn")
    # rank 0 hosts the store and watches its spawned ranks join it: one that dies first (an import error
    # in the script it re-imports, say) stops the start at once, with its error, instead of a store timeout
    store = dist.TCPStore("127.0.0.1", port, size, True, timeout=INIT_TIMEOUT, wait_for_workers=False)
    procs, logs = [], []
    try:
        for rank in range(1, size):
            p = ctx.Process(target=_spawned_follower, args=(rank, size, port, config, device.type),
                            name=f"tercel-tp-rank{rank}", daemon=True)
            err = tempfile.TemporaryFile()  # the rank's stderr until it has started (then the parent's again)
            with _stderr_to(err):
                p.start()
            procs.append(p)
            logs.append(err)
        _wait_for_ranks(store, procs, logs)
        group = TPGroup.create(store, 0, size, rank_device(device, 0))
    except BaseException:
        _stop(procs)
        raise
    finally:
        for f in logs:
            f.close()
    group.followers = procs
    return group


class RankStartError(RuntimeError):
    """A tensor-parallel rank that Tercel spawned died before it joined rank 0."""


def _joined_key(rank: int) -> str:
    return f"tercel-joined/{rank}"


@contextlib.contextmanager
def _stderr_to(f: IO[bytes]):
    """File descriptor 2 points at f while a child process is started (the child inherits it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _restore_parent_stderr() -> None:
    """In a spawned rank that has started: write to the parent's stderr again (Linux: through /proc),
    else keep writing to the start-up file."""
    try:
        fd = os.open(f"/proc/{os.getppid()}/fd/2", os.O_WRONLY | os.O_APPEND)
    except OSError:
        return
    os.dup2(fd, 2)
    os.close(fd)


def _wait_for_ranks(store: dist.TCPStore, procs: list, logs: list[IO[bytes]]) -> None:
    """Until every spawned rank has joined the store; a rank that exits first raises RankStartError."""
    keys = [_joined_key(rank) for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + INIT_TIMEOUT.total_seconds()
    while not store.check(keys):
        for rank, (p, err) in enumerate(zip(procs, logs), start=1):
            if p.exitcode is not None and not store.check([_joined_key(rank)]):
                raise RankStartError(_start_failure(rank, p.exitcode, err))
        if time.monotonic() > deadline:
            raise RankStartError(f"tensor-parallel ranks did not join rank 0 within {INIT_TIMEOUT.total_seconds():.0f} "
                                 f"s (TERCEL_TP_INIT_TIMEOUT); is the machine overloaded?")
        time.sleep(0.05)


def _last_exception(lines: list[str]) -> str | None:
    """`Type: message` of the last exception in a traceback's lines; a message that starts on the next
    lines (RuntimeError's multi-line texts) is joined up to its first blank line."""
    i = next((i for i in range(len(lines) - 1, -1, -1) if lines[i] and not lines[i].startswith((" ", "\t"))), None)
    if i is None:
        return None
    head, _, first = lines[i].partition(":")
    words = [first.strip()] if first.strip() else []
    if not words:
        rest = [ln.strip() for ln in lines[i + 1:]]
        rest = rest[next((j for j, ln in enumerate(rest) if ln), len(rest)):]  # skip the blank lines first
        for ln in rest:
            if not ln:
                break
            words.append(ln)
    return f"{head}: {' '.join(words)}" if words else head


def _start_failure(rank: int, exitcode: int, err: IO[bytes]) -> str:
    """The message for a spawned rank that died before joining: its exception, its traceback's tail and,
    when it died re-running the user's script, the `if __name__ == "__main__":` fix."""
    err.seek(0)
    text = err.read().decode(errors="replace").strip()
    lines = text.splitlines()
    exc = _last_exception(lines)
    msg = (f"tensor-parallel rank {rank} (a process Tercel spawned) exited with code {exitcode} before it joined "
           f"rank 0: {(exc or 'it printed no error').rstrip('.')}.")
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    reimported = "_fixup_main_from_path" in text or "bootstrapping phase" in text or "__mp_main__" in text
    if reimported:
        where = f" ({script})" if script else ""
        msg += (f" A spawned rank starts by re-importing the main script{where}, so code at its top level runs "
                f"again in every rank: put the code that creates the LLM under `if __name__ == \"__main__\":` "
                f"(Python's rule for multiprocessing's spawn start), or start the ranks with torchrun.")
    if lines:
        msg += "\nThe rank's output:\n" + "\n".join("    " + ln for ln in lines[-20:])
    return msg


def _spawned_follower(rank: int, size: int, port: int, config: EngineConfig, device_type: str) -> None:
    from .follower import exit_with_parent, serve

    _restore_parent_stderr()  # started: the rank's own output goes where rank 0's goes
    exit_with_parent()
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)
    dev = rank_device(torch.device(device_type), rank)
    share_cpu_threads(config, dev, size)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=INIT_TIMEOUT)
    store.set(_joined_key(rank), "1")
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
    group.release()


def _stop(procs: list) -> None:
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            log.warning("tensor-parallel rank process %s did not exit; terminating it", p.name)
            p.terminate()
            p.join(5)
