"""Turning logits into tokens: penalties, temperature / top-k / top-p / min-p, per-request RNG.

`processed_logits` and `filter_logits` define the exact distribution a request samples from;
speculative verification reuses them so acceptance is judged against that same distribution.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .graphs.staging import to_device
from .kernels import use_triton
from .request import Request
from .sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """argmax over the last dim of [B, V] logits, on their device (no sync): on a GPU the Triton kernel,
    which splits each row over many programs (torch's one-block reduction is ~28 us per 128k row).
    ids [V]: return ids[argmax] instead (a draft's vocabulary mapped to the target's, in the same launch)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and use_triton(logits):
        from .kernels.argmax import argmax_rows

        return argmax_rows(logits, ids)
    top = logits.argmax(-1)
    return top if ids is None else ids[top]


def apply_penalties(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """Repetition penalty (HF semantics, over prompt + output) and OpenAI frequency/presence
    penalties (over output tokens). logits: [V], returns a new tensor."""
    p = req.params
    out = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.prompt_token_ids) | set(req.output_token_ids)), dtype=torch.long,
                            device=logits.device)
        vals = out[seen]
        out[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and req.output_token_ids:
        ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(ids, minlength=out.shape[-1]).to(out.dtype)[: out.shape[-1]]
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masking (-inf outside the allowed set).
    logits: [..., V] float32, temperature > 0."""
    x = logits / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def processed_logits(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The logits a request's next token is drawn from (greedy: argmax of these)."""
    x = apply_penalties(logits, req) if req.params.has_penalties else logits
    if req.params.min_tokens and len(req.output_token_ids) < req.params.min_tokens and req.stop_ids_for_min_tokens:
        x = x.clone() if x is logits else x
        x[list(req.stop_ids_for_min_tokens)] = float("-inf")
    return x


def target_probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The exact probability vector a request samples from (T > 0)."""
    return filter_logits(processed_logits(logits, req), req.params).softmax(-1)


# splitmix64 constants as signed int64 (torch has no uint64 arithmetic; int64 products wrap)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finalizer."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def stream_keys(seeds: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The key of draw `index` of each seed's stream, a hash of (seed, index): int64, broadcast shapes. On a GPU
    one Triton launch (kernels/race.py) instead of ~25 elementwise ones."""
    if (use_triton(seeds) and index.device == seeds.device and seeds.dtype == index.dtype == torch.int64
            and max(seeds.dim(), index.dim()) <= 2):
        from .kernels.race import stream_keys_2d

        return stream_keys_2d(seeds, index)
    return _mix64(_mix64(seeds) + index * _GOLDEN)


def draw_keys(reqs: list[Request]) -> torch.Tensor:
    """One stream key per entry for its next token draw (draw `r.draws`); advances the count, so a request
    listed k times takes its next k draws. [len(reqs)] int64 on the host. A request's draw k is the noise of
    its output token k, so speculative steps (tercel.speculative.verify) draw that token with the same noise."""
    counts = []
    for r in reqs:
        counts.append(r.draws)
        r.draws += 1
    return stream_keys(torch.tensor([r.seed for r in reqs], dtype=torch.int64), torch.tensor(counts))


def ahead_keys(reqs: list[Request], ahead: torch.Tensor) -> torch.Tensor:
    """Keys of draws still ahead, without taking them: entry [i, j] is draw r.draws + ahead[i, j] of request
    i's stream (the noise of the output token that many places on). ahead [len(reqs), n] int64 on any
    device; the keys come on its device."""
    seeds, draws = to_device(torch.tensor([[r.seed for r in reqs], [r.draws for r in reqs]], dtype=torch.int64),
                             ahead.device)
    return stream_keys(seeds[:, None], draws[:, None] + ahead)


def draw_noise(keys: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [*keys.shape, vocab]: token v of a key's row from output v + 1 of splitmix64 started at
    the key. Counter-based, so a draw depends only on (seed, draw index): not on the batch, the step kind or
    the device, and a whole batch is a few elementwise kernels."""
    keys = keys.to(device, non_blocking=True)
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
    if device.type == "cpu":
        return _draw_noise_cpu(keys, idx * _GOLDEN)
    bits = _mix64(keys[..., None] + idx * _GOLDEN)
    u = (_shr(bits, 11).double() + 0.5) * 2.0 ** -53  # 53-bit uniform in (0, 1)
    return (-torch.log(u)).float()


def _draw_noise_cpu(keys: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """draw_noise on the CPU, bit for bit: the same operations in place, a few rows at a time, so the int64
    temporaries stay in cache (7x faster than whole-batch tensors at a 49k vocabulary)."""
    vocab = steps.numel()
    out = torch.empty(*keys.shape, vocab)
    flat_keys, flat_out = keys.reshape(-1), out.view(-1, vocab)
    rows = max(1, (1 << 16) // vocab)
    for s in range(0, flat_keys.numel(), rows):
        x = flat_keys[s:s + rows, None] + steps
        for shift, mult in ((30, _MIX1), (27, _MIX2), (31, None)):  # _mix64
            t = x >> shift
            t &= (1 << (64 - shift)) - 1
            x ^= t
            if mult is not None:
                x *= mult
        x >>= 11
        x &= (1 << 53) - 1
        u = x.double()
        u += 0.5
        u *= 2.0 ** -53
        flat_out[s:s + rows] = u.log_().neg_()
    return out


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race, argmax p / E with E ~ Exp(1): a draw from p (the same law as multinomial).
    Token ids [...] on probs' device."""
    return greedy_tokens(probs.float() / noise)


def race_keys(probs: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor | None = None,
              id_vocab: int | None = None) -> torch.Tensor:
    """race(probs, draw_noise(keys)) for probs [N, V] and keys [N]: on a GPU one fused kernel makes the noise
    (kernels/race.py). ids [N, V]: column j of a row is token ids[n, j] (its noise, and the id returned);
    id_vocab: the vocabulary those ids come from when it is larger than V (a draft's mapped vocabulary)."""
    if use_triton(probs):
        from .kernels.race import race_rows

        return race_rows(probs.contiguous(), keys.to(probs.device), ids)
    noise = draw_noise(keys, id_vocab or probs.shape[-1], probs.device)
    if ids is None:
        return race(probs, noise)
    return ids.gather(1, race(probs, noise.gather(1, ids))[:, None])[:, 0]


def race_logits(logits: torch.Tensor, temperature: torch.Tensor, sampled: torch.Tensor, keys: torch.Tensor,
                ids: torch.Tensor | None = None, id_vocab: int | None = None) -> torch.Tensor:
    """A proposal per row of logits [N, V], no filters: sampled rows (sampled [N] != 0) the race of softmax(x / T)
    against their key's noise, as argmax x / T - log E (no softmax); the others the argmax. ids [V]: column v is
    token ids[v] of a vocabulary of id_vocab tokens (its noise, and the id returned). A speculative draft's pick:
    the target's draws keep the output exact whatever the drafts are, so the drafts skip top-k / top-p / min-p
    (a token they filter out is a rejected draft); on a GPU two launches instead of the sort, the filter and
    the race (kernels/race.py)."""
    if use_triton(logits) and logits.dim() == 2:
        from .kernels.race import race_logits_rows

        full = None if ids is None else ids.expand(logits.shape[0], -1)
        return race_logits_rows(logits, keys.to(logits.device), temperature, sampled.to(torch.long), full)
    return _race_logits_torch(logits, temperature, sampled, keys, ids, id_vocab)


def race_logits_seeded(logits: torch.Tensor, temperature: torch.Tensor, sampled: torch.Tensor, seeds: torch.Tensor,
                       draws: torch.Tensor, ahead: int, ids: torch.Tensor | None = None,
                       id_vocab: int | None = None) -> torch.Tensor:
    """race_logits with each row's key stream_keys(seeds, draws + ahead) (seeds, draws [N] int64 on the device):
    on a GPU the hash runs inside the race's launch (a chained step's draft picks: two launches each, not four)."""
    if use_triton(logits) and logits.dim() == 2:
        from .kernels.race import race_logits_rows

        full = None if ids is None else ids.expand(logits.shape[0], -1)
        return race_logits_rows(logits, seeds, temperature, sampled.to(torch.long), full, draws, ahead)
    return _race_logits_torch(logits, temperature, sampled, stream_keys(seeds, draws + ahead), ids, id_vocab)


def _race_logits_torch(logits: torch.Tensor, temperature: torch.Tensor, sampled: torch.Tensor, keys: torch.Tensor,
                       ids: torch.Tensor | None, id_vocab: int | None) -> torch.Tensor:
    x = logits.float()
    noise = draw_noise(keys, id_vocab or x.shape[-1], x.device)
    if ids is not None:
        noise = noise.index_select(1, ids)
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    scores = torch.where(sampled.bool()[:, None], x / t - noise.log(), x)
    won = greedy_tokens(scores)
    return won if ids is None else ids[won]


@dataclass(slots=True)
class SamplingTensors:
    """Per-row temperature / top-k / top-p / min-p of a batch of sampled (T > 0) rows, on the device, so one
    set of launches filters rows with different settings (no grouping by setting, no host sync)."""
    temperature: torch.Tensor  # [N] float32
    top_k: torch.Tensor  # [N] int64: the kept count (the vocabulary size when off)
    top_p: torch.Tensor  # [N] float32 (1: off)
    min_p: torch.Tensor  # [N] float32 (0: off)
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device,
           repeat: int = 1) -> "SamplingTensors":
        """One row per params entry, each repeated `repeat` times (a verify's nodes); uploaded without
        waiting for the GPU."""
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        host = torch.tensor([[float(p.temperature) for p in params], [float(k) for k in ks],
                             [float(p.top_p) for p in params], [float(p.min_p) for p in params]],
                            dtype=torch.float32)
        dev = to_device(host, device)
        if repeat > 1:
            dev = dev.repeat_interleave(repeat, dim=1)
        return cls(dev[0], dev[1].long(), dev[2], dev[3], any(k < vocab for k in ks),
                   any(p.top_p < 1.0 for p in params), any(p.min_p > 0.0 for p in params))


def sample_rows(logits: torch.Tensor, st: SamplingTensors, keys: torch.Tensor, vocab_ids: torch.Tensor | None = None,
                id_vocab: int | None = None, exact: torch.dtype | None = None) -> torch.Tensor:
    """A draw per row of logits [N, V] from its filtered distribution (filter_logits' rules, each row with its
    own settings), by the race with each row's stream key (keys [N]). Token ids [N] on the device, no sync.
    Top-k / top-p work in the sorted domain, and the race runs there too (the candidates' ids map back).
    vocab_ids [V]: column v is token vocab_ids[v] of a vocabulary of id_vocab tokens (a draft's mapped
    vocabulary: it races against the noise the target's draw of the same output token uses).
    exact: a 16-bit dtype every value of float32 logits is exact in (the target's logits_exact_dtype).
    On a GPU the filters are one launch after the sort (kernels/sample_filter.py)."""
    if use_triton(logits) and logits.dim() == 2:
        return _sample_rows_fused(logits, st, keys, vocab_ids, id_vocab, exact)
    x = logits.float() / st.temperature[:, None]
    if not (st.any_top_k or st.any_top_p):
        probs = x.softmax(-1)
        if st.any_min_p:
            probs = probs.masked_fill(probs < st.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
        ids = None if vocab_ids is None else vocab_ids.expand(x.shape[0], -1).contiguous()
        return race_keys(probs, keys, ids, id_vocab)
    sx, order = torch.sort(x, dim=-1, descending=True)
    if st.any_top_k:
        kth = sx.gather(1, (st.top_k - 1)[:, None])
        sx = sx.masked_fill(sx < kth, float("-inf"))
    probs = sx.softmax(-1)
    if st.any_top_p:  # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = ((probs.cumsum(-1) - probs) >= st.top_p[:, None]) & (st.top_p < 1.0)[:, None]
        probs = sx.masked_fill(drop, float("-inf")).softmax(-1)
    if st.any_min_p:
        probs = probs.masked_fill(probs < st.min_p[:, None] * probs[:, :1], 0.0)
    return race_keys(probs, keys, order if vocab_ids is None else vocab_ids[order], id_vocab)


def _sample_rows_fused(logits: torch.Tensor, st: SamplingTensors, keys: torch.Tensor,
                       vocab_ids: torch.Tensor | None, id_vocab: int | None,
                       exact: torch.dtype | None = None) -> torch.Tensor:
    """sample_rows on a GPU. With top-k or top-p: the sort, then one launch filters and races over the kept
    prefix (kernels/sample_filter.sample_sorted). The sort takes 16-bit logits as they are, and float32 logits whose
    values are exact in a 16-bit dtype (`exact`: a bf16 target's head writes float32 holding bf16 values) in that
    dtype: half the radix passes of float32 and the same order (the conversion is exact and the sort stable, as
    CUDA's radix sort of a row this wide is anyway), so the same tokens. Without: one filter launch and the race."""
    from .kernels.sample_filter import filtered_probs, sample_sorted

    if st.any_top_k or st.any_top_p:  # x / T keeps the order (T > 0): the kernel divides after the sort
        if logits.dtype in (torch.bfloat16, torch.float16):
            x = logits
        elif logits.dtype == torch.float32 and exact in (torch.bfloat16, torch.float16):
            x = logits.to(exact)
        else:
            x = logits.float()
        x, order = torch.sort(x.contiguous(), dim=-1, descending=True, stable=True)
        ids = order if vocab_ids is None else vocab_ids[order]
        return sample_sorted(x, ids, keys.to(x.device), st.temperature, st.top_k, st.top_p, st.min_p, st.any_top_k,
                             st.any_top_p, st.any_min_p)
    x = logits.float().contiguous()
    probs = filtered_probs(x, st.temperature, st.top_k, st.top_p, st.min_p, False, False, False, st.any_min_p)
    ids = None if vocab_ids is None else vocab_ids.expand(x.shape[0], -1).contiguous()
    return race_keys(probs, keys, ids, id_vocab)


def sample_batch(logits: torch.Tensor, reqs: list[Request], keys: torch.Tensor | None = None,
                 exact: torch.dtype | None = None) -> torch.Tensor:
    """Sampled (T > 0) rows: each request's token from its target_probs. logits [len(reqs), V]; keys: each row's
    stream key on the device (None: the requests' next draws, taken now); exact: the target's logits_exact_dtype
    (sample_rows). Token ids [len(reqs)] stay on logits' device."""
    if keys is None:
        keys = to_device(draw_keys(reqs), logits.device)
    ctx = [i for i, r in enumerate(reqs) if r.params.has_penalties or r.params.min_tokens]
    if not ctx:
        return sample_rows(logits, SamplingTensors.of([r.params for r in reqs], logits.shape[-1], logits.device),
                           keys, exact=exact)
    out = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
    skip = set(ctx)
    free = [i for i in range(len(reqs)) if i not in skip]
    if free:
        idx = to_device(torch.tensor(free), logits.device)
        st = SamplingTensors.of([reqs[i].params for i in free], logits.shape[-1], logits.device)
        out[idx] = sample_rows(logits[idx], st, keys[idx], exact=exact)
    for i in ctx:  # penalties / min_tokens depend on the request's own tokens: one row at a time
        out[i:i + 1] = race_keys(target_probs(logits[i], reqs[i])[None], keys[i:i + 1])
    return out


def token_logprobs(row: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
    """Logprobs of the model's raw distribution (before penalties/filters), like vLLM's default: the chosen
    token's and the top_n."""
    lp = row.float().log_softmax(-1)
    out = {token: float(lp[token])}
    if top_n:
        vals, ids = lp.topk(top_n)
        for v, t in zip(vals.tolist(), ids.tolist()):
            out.setdefault(t, v)
    return out


class Sampler:
    def __init__(self, exact: torch.dtype | None = None) -> None:
        self.exact = exact  # the target's logits_exact_dtype (sample_rows)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [len(reqs), V] float32. Returns token ids and, where asked, logprobs (of the raw logits).
        Rows of requests with a grammar choose among the tokens it allows next."""
        raw = logits
        if any(r.grammar is not None for r in reqs):
            from .structured.mask import mask_rows

            logits = mask_rows(logits, [r.grammar for r in reqs])
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy and not r.params.has_penalties
                       and not r.params.min_tokens]
        # all-greedy batches (the common case) skip the row gather: one argmax, one device->host copy
        rows = logits if len(greedy_rows) == len(reqs) else logits[greedy_rows]
        greedy_ids = greedy_tokens(rows).tolist() if greedy_rows else []
        chosen = dict(zip(greedy_rows, greedy_ids))
        sampled_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled_rows:  # one batched draw, one device->host copy
            rows = logits if len(sampled_rows) == len(reqs) else logits[sampled_rows]
            chosen.update(zip(sampled_rows, sample_batch(rows, [reqs[i] for i in sampled_rows],
                                                         exact=self.exact).tolist()))
        for i, req in enumerate(reqs):
            row = logits[i]
            # greedy with penalties / min_tokens: argmax of the processed logits
            tok = chosen[i] if i in chosen else int(processed_logits(row, req).argmax())
            tokens.append(tok)
            logprobs.append(token_logprobs(raw[i], tok, req.params.logprobs) if req.params.logprobs is not None
                            else None)
        return tokens, logprobs
