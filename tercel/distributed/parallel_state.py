"""The tensor-parallel group of one engine: its rank, size, device and the c10d process group.

The process group is built straight from a store (ProcessGroupGloo / ProcessGroupNCCL), not through
torch.distributed's default group: nothing global, so an engine's group is the object passed around,
and several engines (or tests) in one process never collide.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# How long a collective may wait. Long: an idle server's followers wait in a broadcast for the next
# request (rank 0's exit is noticed by the follower's parent watchdog, not by this timeout).
OP_TIMEOUT = datetime.timedelta(days=7)


@dataclass(slots=True)
class TPGroup:
    rank: int
    size: int
    device: torch.device
    pg: object  # the c10d ProcessGroup
    store: object  # the rendezvous store: kept alive as long as the group
    followers: list = field(default_factory=list)  # processes this rank spawned (rank 0, spawn mode)
    started: bool = False  # the ranks met in agree_start (with or without success)
    serving: bool = False  # every rank loaded its shard and sized its KV pool (rank 0 may send forwards)
    closed: bool = False

    @classmethod
    def create(cls, store: dist.Store, rank: int, size: int, device: torch.device) -> "TPGroup":
        store = dist.PrefixStore("tercel-tp/", store)
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
            # the NCCL group's collectives take its default timeout; the follower watchdog covers hangs
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, OP_TIMEOUT)
        return cls(rank, size, device, pg, store)

    def release(self) -> None:
        """Shut the process group down now, while the interpreter is whole: a gloo group left to the
        interpreter's exit can abort the process there ("terminate called without an active exception")."""
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None:
            pg.shutdown()

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (t must be contiguous); returns t."""
        self.pg.allreduce([t]).wait()
        return t

    def agree_start(self, num_blocks: int) -> int:
        """Every rank's KV block count -> the smallest, once all ranks loaded; a rank that failed to load
        sends -1, and then every rank gets -1 and stops (no rank is left waiting in a collective)."""
        n = self.min_int(num_blocks)
        self.started, self.serving = True, n > 0
        return n

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self.pg.broadcast([t], opts).wait()
        return t

    def gather_cat(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t (same shape), concatenated along dim on rank 0; the other ranks get t back."""
        t = t.contiguous()
        out = [[torch.empty_like(t) for _ in range(self.size)]] if self.is_driver else []
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.pg.gather(out, [t], opts).wait()
        return torch.cat(out[0], dim=dim) if self.is_driver else t
