"""Self-distillation prompts the target writes itself (tercel.train.data.synth_user_prompts)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tercel.train.data import EVAL_CHAT_PROMPTS, synth_user_prompts, user_turn_prefix


def test_user_turn_prefix_is_everything_before_the_users_text(smol_llm):
    tok = smol_llm.tokenizer
    prefix = user_turn_prefix(tok)
    text = tok.decode(prefix, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system\n" in text
    full = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=False)
    assert full[:len(prefix)] == prefix and tok.decode(full[len(prefix):]).startswith("Hello there")


@dataclass
class _Completion:
    text: str
    finish_reason: str
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Out:
    outputs: list[_Completion]


@dataclass
class _FakeLLM:
    """Answers each request with the next canned (text, finish_reason); records what it was asked."""
    tokenizer: object
    canned: list[tuple[str, str]]
    calls: list[tuple[list, list]] = field(default_factory=list)

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append((prompts, params))
        got, self.canned = self.canned[:len(prompts)], self.canned[len(prompts):]
        return [_Out([_Completion(t, f, self.tokenizer.encode(t))]) for t, f in got]


def test_synth_prompts_keep_only_finished_distinct_non_eval_texts(smol_llm):
    canned = [("How do I bake sourdough bread?", "stop"),       # kept
              ("Cut off mid-sentence because the", "length"),   # not finished
              ("  How do I bake sourdough bread?  ", "stop"),   # duplicate once stripped
              ("Hi", "stop"),                                   # too short
              (EVAL_CHAT_PROMPTS[0], "stop"),                   # held-out eval prompt
              ("x" * 601, "stop"),                              # too long
              ("Name three uses of a paperclip.", "stop")]      # kept
    llm = _FakeLLM(smol_llm.tokenizer, canned)
    got = synth_user_prompts(llm, 5, seed=7, wave=4)
    assert got == ["How do I bake sourdough bread?", "Name three uses of a paperclip."]
    prefix = user_turn_prefix(smol_llm.tokenizer)
    (p1, s1), (p2, s2) = llm.calls  # ceil(5 * 1.3) = 7 requests in waves of 4
    assert p1 == [prefix] * 4 and p2 == [prefix] * 3
    seeds = [p.seed for p in s1 + s2]
    assert seeds == list(range(7, 14)) and all(p.temperature == 1.0 for p in s1 + s2)
    assert synth_user_prompts(llm, 0) == []
