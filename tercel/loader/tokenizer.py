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
        self._template: str | None = None  # the --chat-template override

    @property
    def backend(self) -> Any:
        """The transformers tokenizer (structured output compiles grammars against its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_with_special(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As encode, with the tokenizer's BOS / EOS added where it adds them (/tokenize's add_special_tokens)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(ids)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template in use (the --chat-template override, else the tokenizer's)."""
        return self._template or getattr(self._tok, "chat_template", None) or None

    def set_chat_template(self, template: str) -> None:
        """Replace the chat template: a file path or the template text itself (vLLM's --chat-template)."""
        path = Path(template)
        try:
            is_file = "\n" not in template and len(template) < 4096 and path.is_file()
        except OSError:
            is_file = False
        if is_file:
            template = path.read_text()
        elif "{{" not in template and "{%" not in template:
            raise ConfigError(f"chat_template={template!r} is neither a file nor a Jinja template ('{{{{' / '{{%').")
        self._template = template

    @property
    def supports_tools(self) -> bool:
        """Does the chat template render a `tools` list itself?"""
        return "tools" in (self.chat_template or "")

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """tools: OpenAI function specs, for templates that render them (supports_tools)."""
        if not self.has_chat_template:
            raise ConfigError("this model's tokenizer has no chat template; use generate() with a plain prompt.")
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message.")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}]={m!r} must be a dict with 'role' and 'content'.")
        kw: dict[str, Any] = {"tools": tools} if tools else {}
        if self._template is not None:
            kw["chat_template"] = self._template
        out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kw)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


def load_tokenizer(path: Path, gguf_file: bool, cache_entry: Path | None = None) -> Tokenizer:
    """cache_entry: a GGUF's load cache entry (tercel.loader.cache). Converting a GGUF's vocabulary into
    a tokenizer takes seconds; the converted one is saved there once and read back on later starts."""
    import transformers

    transformers.logging.set_verbosity_error()
    cached = cache_entry / "tokenizer" if gguf_file and cache_entry is not None else None
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        try:
            # the saved fast tokenizer as it is (AutoTokenizer's class look-up costs seconds of imports)
            return Tokenizer(transformers.PreTrainedTokenizerFast.from_pretrained(str(cached)))
        except Exception as e:  # a damaged entry: convert again (and rewrite it)
            log.warning("ignoring the cached tokenizer %s (%s: %s)", cached, type(e).__name__, e)
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
    if cached is not None:
        from .cache import write_atomically

        write_atomically(cached, lambda target: tok.save_pretrained(str(target)))
    return Tokenizer(tok)
