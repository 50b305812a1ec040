"""Turning logits into tokens: penalties, temperature / top-k / top-p / min-p, per-request RNG.

`processed_logits` and `filter_logits` define the exact distribution a request samples from;
speculative verification reuses them so acceptance is judged against that same distribution.
"""
from __future__ import annotations

import torch

from .request import Request
from .sampling_params import SamplingParams


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


def draw_noise(shape: torch.Size, generator: torch.Generator, device: torch.device | None = None) -> torch.Tensor:
    """The Exp(1) noise of one draw, from the request's own (host) generator. With a CUDA device it is
    drawn into pinned memory and sent without a host sync (same values: the draw happens on the host)."""
    if device is None or device.type != "cuda":
        return torch.empty(shape, dtype=torch.float32, device="cpu").exponential_(generator=generator)
    host = torch.empty(shape, dtype=torch.float32, pin_memory=True).exponential_(generator=generator)
    return host.to(device, non_blocking=True)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw by the exponential race (argmax p / E, E ~ Exp(1)): equivalent to multinomial,
    batch-invariant because the noise comes from the request's own generator."""
    noise = draw_noise(probs.shape, generator)
    return int((probs.float().cpu() / noise).argmax())


def sample_on_device(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The draw sample_from_probs makes (same noise, same race), left on logits' device as a 0-d tensor,
    so multi-step decode can feed it to the next forward without a host sync. logits: [V]; no penalties."""
    probs = target_probs(logits, req)
    return (probs.float() / draw_noise(probs.shape, req.generator, probs.device)).argmax()


class Sampler:
    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [len(reqs), V] float32. Returns token ids and, where asked, logprobs."""
        tokens: list[int] = []
        logprobs: list[dict[int, float] | None] = []
        greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy and not r.params.has_penalties
                       and not r.params.min_tokens]
        # all-greedy batches (the common case) skip the row gather: one argmax, one device->host copy
        rows = logits if len(greedy_rows) == len(reqs) else logits[greedy_rows]
        greedy_ids = rows.argmax(-1).tolist() if greedy_rows else []
        greedy_map = dict(zip(greedy_rows, greedy_ids))
        for i, req in enumerate(reqs):
            row = logits[i]
            if i in greedy_map:
                tok = greedy_map[i]
            else:
                x = processed_logits(row, req)
                if req.params.greedy:
                    tok = int(x.argmax())
                else:
                    tok = sample_from_probs(filter_logits(x, req.params).softmax(-1), req.generator)
            tokens.append(tok)
            logprobs.append(self._logprobs(row, tok, req.params.logprobs) if req.params.logprobs is not None else None)
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
