"""Turning logits into tokens: penalties, temperature / top-k / top-p / min-p, per-request RNG.

`processed_logits` and `filter_logits` define the exact distribution a request samples from;
speculative verification reuses them so acceptance is judged against that same distribution.
"""
from __future__ import annotations

import torch

from .kernels import use_triton
from .request import Request
from .sampling_params import SamplingParams


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [B, V] logits, on their device (no sync): on a GPU the Triton kernel,
    which splits each row over many programs (torch's one-block reduction is ~28 us per 128k row)."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and use_triton(logits):
        from .kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(-1)


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
    """The key of draw `index` of each seed's stream, a hash of (seed, index): int64, broadcast shapes."""
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
    seeds = torch.tensor([r.seed for r in reqs], dtype=torch.int64).to(ahead.device)
    draws = torch.tensor([r.draws for r in reqs], dtype=torch.int64).to(ahead.device)
    return stream_keys(seeds[:, None], draws[:, None] + ahead)


def draw_noise(keys: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """Exp(1) noise [*keys.shape, vocab]: token v of a key's row from output v + 1 of splitmix64 started at
    the key. Counter-based, so a draw depends only on (seed, draw index): not on the batch, the step kind or
    the device, and a whole batch is a few elementwise kernels."""
    keys = keys.to(device, non_blocking=True)
    idx = torch.arange(1, vocab + 1, dtype=torch.int64, device=device)
    bits = _mix64(keys[..., None] + idx * _GOLDEN)
    u = (_shr(bits, 11).double() + 0.5) * 2.0 ** -53  # 53-bit uniform in (0, 1)
    return (-torch.log(u)).float()


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The exponential race, argmax p / E with E ~ Exp(1): a draw from p (the same law as multinomial).
    Token ids [...] on probs' device."""
    return greedy_tokens(probs.float() / noise)


def sample_probs(probs: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """One draw per row of probs [len(reqs), V] by the exponential race (argmax p / E, E ~ Exp(1)): the
    same law as multinomial. Token ids [len(reqs)] stay on probs' device (no host sync)."""
    return race(probs, draw_noise(draw_keys(reqs), probs.shape[-1], probs.device))


def sample_batch(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Sampled (T > 0) rows: each request's token from its target_probs, batched over requests that share
    their filter settings. logits [len(reqs), V]; token ids [len(reqs)] stay on logits' device."""
    out = torch.empty(len(reqs), dtype=torch.long, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(reqs):
        p = r.params
        plain = not p.has_penalties and not p.min_tokens
        groups.setdefault((p.temperature, p.top_k, p.top_p, p.min_p) if plain else ("row", i), []).append(i)
    for key, rows in groups.items():
        sub = [reqs[i] for i in rows]
        if key[0] == "row":  # penalties / min_tokens depend on the request's own tokens
            probs = target_probs(logits[rows[0]], sub[0])[None]
        else:
            probs = filter_logits(logits[rows], sub[0].params).softmax(-1)
        out[rows] = sample_probs(probs, sub)
    return out


class Sampler:
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
            chosen.update(zip(sampled_rows, sample_batch(rows, [reqs[i] for i in sampled_rows]).tolist()))
        for i, req in enumerate(reqs):
            row = logits[i]
            # greedy with penalties / min_tokens: argmax of the processed logits
            tok = chosen[i] if i in chosen else int(processed_logits(row, req).argmax())
            tokens.append(tok)
            logprobs.append(self._logprobs(raw[i], tok, req.params.logprobs) if req.params.logprobs is not None
                            else None)
        return tokens, logprobs

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, top_n: int) -> dict[int, float]:
        """Logprobs of the model's raw distribution (before penalties/filters), like vLLM's default."""
        lp = row.float().log_softmax(-1)
        out = {token: float(lp[token])}
        if top_n:
            vals, ids = lp.topk(top_n)
            for v, t in zip(vals.tolist(), ids.tolist()):
                out.setdefault(t, v)
        return out
