"""Tokenizer with chat template, from an HF directory or from GGUF metadata (via transformers)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..config import ConfigError

log = logging.getLogger(__name__)


class Tokenizer:
    """A thin wrapper so the engine depends on five methods, not on a tokenizer library."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self._tok = hf_tokenizer
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.vocab_size = len(hf_tokenizer)

    @property
    def backend(self) -> Any:
        """The transformers tokenizer (structured output compiles grammars against its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            raise ConfigError("this model's tokenizer has no chat template; use generate() with a plain prompt.")
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message.")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]={m!r} must be a dict with 'role' and 'content'.")
        out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


def load_tokenizer(path: Path, gguf_file: bool) -> Tokenizer:
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        if gguf_file:
            tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types here; name the path and what is needed
        raise ConfigError(
            f"cannot load a tokenizer from {path} ({type(e).__name__}: {e}); an HF directory needs "
            f"tokenizer.json / tokenizer_config.json, a GGUF file needs tokenizer.ggml.* metadata."
        ) from e
    return Tokenizer(tok)
