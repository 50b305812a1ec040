"""Static input buffers of a captured step, their padding policies, and replay marshalling.

A captured graph reads fixed addresses, so every replay copies the live batch into static
buffers sized for the largest bucket and pads rows [live, bucket) per the buffer's policy:

  ZERO      indices, positions, cache locations, block tables -> 0, i.e. the reserved dummy KV
            block/slot, so a padded token can only read or write the dummy block.
  SENTINEL  sequence lengths -> a valid length (tokens_per_request), so kernels see a
            well-formed, non-empty request whose keys all live in the dummy block.
  HEAD_ONLY input ids: only the live head is copied; any stale (valid) id in the tail is harmless
            because a padded row's KV goes to the dummy slot and its logits are dropped.

Padding costs no extra launches: a pad is one more (dst, src) pair whose source is a constant
tensor of the pad value, copied in the same grouped foreach as the live data.

Marshalling (docs/gpu.md, "Replay staging on the host"): small pairs are grouped by (dst dtype, src dtype) and issued
as one torch._foreach_copy_ per group; big contiguous tensors (hidden states, threshold
configurable) get their own copy_ so they take the DMA path; pairs whose destination is not
dense (a narrower block table written into a wider buffer) also get their own copy_, since one
strided tensor would push a whole foreach group onto its slow per-tensor path. Everything here
works on CPU tensors, which is how it is tested.
"""
from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

DEFAULT_BIG_COPY_BYTES = 1 << 20  # tensors this large skip the foreach group (DMA beats the compute kernel)
HAS_FOREACH_COPY = hasattr(torch, "_foreach_copy_")


class Pad(enum.Enum):
    ZERO = "zero"
    SENTINEL = "sentinel"
    HEAD_ONLY = "head_only"


class Per(enum.Enum):
    TOKEN = "token"  # rows = requests * tokens_per_request
    REQUEST = "request"  # rows = requests


@dataclass(frozen=True, slots=True)
class BufferSpec:
    """One static input of a step kind. shape: trailing dims after the row dim; a trailing dim may be
    narrower in a live batch (e.g. block-table width), the rest of the row is then left as is."""

    name: str
    per: Per
    dtype: torch.dtype
    pad: Pad
    shape: tuple[int, ...] = ()
    sentinel: int | float = 0

    def __post_init__(self) -> None:
        if self.pad is Pad.SENTINEL and self.sentinel == 0:
            raise ValueError(f"buffer {self.name!r}: a SENTINEL pad needs a non-zero sentinel (else use ZERO).")

    @property
    def pad_value(self) -> int | float:
        return self.sentinel if self.pad is Pad.SENTINEL else 0


def is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous()


@dataclass(slots=True)
class CopyPlan:
    """The copies of one replay: grouped (dtype pair -> dsts, srcs), and single copy_ pairs."""

    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = \
        field(default_factory=dict)
    singles: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def num_launches(self) -> int:
        return len(self.groups) + len(self.singles)


def plan_copies(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                big_copy_bytes: int = DEFAULT_BIG_COPY_BYTES) -> CopyPlan:
    if len(dsts) != len(srcs):
        raise ValueError(f"plan_copies: {len(dsts)} destinations for {len(srcs)} sources.")
    plan = CopyPlan()
    for dst, src in zip(dsts, srcs):
        if dst.shape != src.shape:
            raise ValueError(f"copy shape mismatch: dst {tuple(dst.shape)} <- src {tuple(src.shape)}.")
        if dst.numel() == 0:
            continue
        big = dst.numel() * dst.element_size() >= big_copy_bytes
        if big or not is_dense(dst) or not is_dense(src) or dst.device != src.device:
            plan.singles.append((dst, src))
            continue
        group = plan.groups.setdefault((dst.dtype, src.dtype), ([], []))
        group[0].append(dst)
        group[1].append(src)
    return plan


def run_copies(plan: CopyPlan, use_foreach: bool = True) -> None:
    for dsts, srcs in plan.groups.values():
        if use_foreach and HAS_FOREACH_COPY:
            torch._foreach_copy_(dsts, srcs)
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s)
    for d, s in plan.singles:
        d.copy_(s, non_blocking=True)


def grouped_copy_(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor],
                  big_copy_bytes: int = DEFAULT_BIG_COPY_BYTES, use_foreach: bool = True) -> CopyPlan:
    """dst[i].copy_(src[i]) for all i, in as few launches as the dtypes and sizes allow."""
    plan = plan_copies(dsts, srcs, big_copy_bytes)
    run_copies(plan, use_foreach)
    return plan


class _CachedPlan:
    """A CopyPlan whose destinations (and pad sources) are fixed; the live sources are filled in per call
    by their position in the live-input list. Built once per (live, bucket, input shapes)."""

    def __init__(self, plan: CopyPlan, live: list[torch.Tensor]) -> None:
        ids = {id(t): i for i, t in enumerate(live)}
        self.groups = [(dsts, [ids.get(id(s), s) for s in srcs]) for dsts, srcs in plan.groups.values()]
        self.singles = [(d, ids.get(id(s), s)) for d, s in plan.singles]

    def run(self, live: list[torch.Tensor], use_foreach: bool) -> None:
        pick = lambda s: live[s] if type(s) is int else s  # noqa: E731
        for dsts, slots in self.groups:
            srcs = [pick(s) for s in slots]
            if use_foreach and HAS_FOREACH_COPY:
                torch._foreach_copy_(dsts, srcs)
            else:
                for d, src in zip(dsts, srcs):
                    d.copy_(src)
        for d, s in self.singles:
            d.copy_(pick(s), non_blocking=True)


class StaticBuffers:
    """The static inputs of one step kind, sized for max_requests. One set is shared by every bucket
    (graphs of smaller buckets read the head of each buffer), so stale rows from a larger batch are
    always present and padding must overwrite every row a bucket reads."""

    def __init__(self, specs: Sequence[BufferSpec], max_requests: int, tokens_per_request: int,
                 device: torch.device | str) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate buffer names in {names}.")
        self.specs = {s.name: s for s in specs}
        self.max_requests = max_requests
        self.tokens_per_request = tokens_per_request
        self.device = torch.device(device)
        self.tensors: dict[str, torch.Tensor] = {}
        self._plans: collections.OrderedDict[tuple, _CachedPlan] = collections.OrderedDict()
        self._pad_src: dict[str, torch.Tensor] = {}
        shared: dict[tuple, torch.Tensor] = {}
        for s in specs:
            rows = self.rows(s, max_requests)
            self.tensors[s.name] = torch.full((rows, *s.shape), s.pad_value, dtype=s.dtype, device=self.device)
            if s.pad is not Pad.HEAD_ONLY:  # one constant source per (shape, dtype, value), shared
                key = (rows, s.shape, s.dtype, s.pad_value)
                if key not in shared:
                    shared[key] = torch.full((rows, *s.shape), s.pad_value, dtype=s.dtype, device=self.device)
                self._pad_src[s.name] = shared[key]

    def rows(self, spec: BufferSpec, num_requests: int) -> int:
        return num_requests * (self.tokens_per_request if spec.per is Per.TOKEN else 1)

    def view(self, name: str, num_requests: int) -> torch.Tensor:
        """The rows a graph captured for num_requests reads."""
        return self.tensors[name][: self.rows(self.specs[name], num_requests)]

    def copy_pairs(self, live: dict[str, torch.Tensor], num_live: int,
                   bucket: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(dst, src) pairs that put the live batch (num_live requests) into the buffers and pad
        rows up to the bucket. Every named buffer must be given."""
        if not 0 < num_live <= bucket <= self.max_requests:
            raise ValueError(f"need 0 < live ({num_live}) <= bucket ({bucket}) <= max ({self.max_requests}).")
        missing = set(self.specs) - set(live)
        extra = set(live) - set(self.specs)
        if missing or extra:
            raise ValueError(f"live inputs do not match the buffers: missing {sorted(missing)}, "
                             f"unknown {sorted(extra)}.")
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for name, spec in self.specs.items():
            buf, src = self.tensors[name], live[name]
            n, b = self.rows(spec, num_live), self.rows(spec, bucket)
            if src.shape[0] != n or src.dim() != buf.dim():
                raise ValueError(f"buffer {name!r}: live tensor has shape {tuple(src.shape)}, expected "
                                 f"{n} rows of {tuple(buf.shape[1:])}.")
            if any(ls > bs for ls, bs in zip(src.shape[1:], buf.shape[1:])):
                raise ValueError(f"buffer {name!r}: live tensor {tuple(src.shape)} is wider than the buffer "
                                 f"{tuple(buf.shape)}; raise the captured size or run eagerly.")
            dst = buf[:n]
            for d, size in enumerate(src.shape[1:], start=1):
                dst = dst.narrow(d, 0, size)
            dsts.append(dst)
            srcs.append(src)
            if b > n and spec.pad is not Pad.HEAD_ONLY:
                dsts.append(buf[n:b])
                srcs.append(self._pad_src[name][: b - n])
        return dsts, srcs

    def stage(self, live: dict[str, torch.Tensor], num_live: int, bucket: int,
              big_copy_bytes: int = DEFAULT_BIG_COPY_BYTES, use_foreach: bool = True) -> None:
        """copy_pairs + plan_copies + run_copies, with the plan cached per (live, bucket, input shapes,
        dtypes, layouts): a replay then costs a dict lookup and the copy launches, not the planning."""
        tensors = list(live.values())
        key = (num_live, bucket, tuple(live), tuple((t.shape, t.dtype, t.stride(), t.device) for t in tensors),
               big_copy_bytes)
        plan = self._plans.get(key)
        if plan is None:
            plan = _CachedPlan(plan_copies(*self.copy_pairs(live, num_live, bucket), big_copy_bytes), tensors)
            self._plans[key] = plan
            if len(self._plans) > 512:  # block-table widths vary with context length: keep the recent ones
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        plan.run(tensors, use_foreach)
