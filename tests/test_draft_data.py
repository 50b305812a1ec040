"""Self-distillation prompts the target writes itself (tercel.train.data.synth_user_prompts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tercel.train.data import EVAL_CHAT_PROMPTS, EVAL_SUBJECTS, synth_user_prompts, user_turn_prefix


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


def test_opener_prompts_start_with_their_opener_and_skip_eval_subjects(smol_llm):
    tok = smol_llm.tokenizer
    canned = [(" the tallest mountain on Earth?", "stop"),     # kept, after its opener
              (" does the ocean get its salt?", "stop"),       # names an eval subject
              (" me three facts about owls.", "stop"),         # kept
              (" a compiler?", "stop")]                        # kept
    llm = _FakeLLM(tok, canned)
    got = synth_user_prompts(llm, 3, seed=0, wave=4, openers=("What is", "How", "Give"))
    assert got == ["What is the tallest mountain on Earth?", "Give me three facts about owls.", "What is a compiler?"]
    prefix = user_turn_prefix(tok)
    (asked, _), = llm.calls
    assert asked == [prefix + tok.encode(o) for o in ("What is", "How", "Give", "What is")]
    # the Magpie prompts are filtered by the eval subjects too
    assert synth_user_prompts(_FakeLLM(tok, [("Why is the sky so bright at noon?", "stop")] * 2), 1, wave=2) == []


def test_opener_share_splits_the_synthetic_prompts(monkeypatch):
    import tercel.train.data as data

    calls = []
    monkeypatch.setattr(data, "synth_user_prompts", lambda llm, n, seed, wave, time_budget_s, openers=():
                        calls.append((n, seed, openers)) or [f"s{seed}-{i}" for i in range(n)])
    monkeypatch.setattr(data, "generate_responses", lambda llm, prompts, *a, **kw: [])
    data.make_dataset("llm", 0, 40, 16, seed=5, shard=(1, 2), opener_share=0.25)
    assert calls == [(15, 5 + data.SHARD_SEED_STRIDE, ()),
                     (5, 5 + data.SHARD_SEED_STRIDE + data.SHARD_SEED_STRIDE // 2, data.QUESTION_OPENERS)]
    with pytest.raises(ValueError, match="opener_share"):
        data.make_dataset("llm", 0, 40, 16, opener_share=1.5)
    assert not [o for o in data.QUESTION_OPENERS if data.names_eval_subject(o)]


def test_shards_split_the_offline_prompts_and_sample_their_own_prompts(monkeypatch, tmp_path):
    import tercel.train.data as data

    asked = {}

    def fake_synth(llm, n, seed, wave, time_budget_s, openers=()):
        return [f"synth {seed + i}" for i in range(n)]

    def fake_answers(llm, prompts, max_new_tokens, temperature, seed, use_tqdm, wave, time_budget_s):
        asked[llm] = prompts
        return [data.Sample([ord(c) for c in p], [1, 2]) for p in prompts]

    monkeypatch.setattr(data, "synth_user_prompts", fake_synth)
    monkeypatch.setattr(data, "generate_responses", fake_answers)
    parts = []
    for k in range(3):
        samples = data.make_dataset(f"llm{k}", 30, 7, 16, shard=(k, 3))
        data.save_samples(samples, tmp_path / f"part{k}.pt")
        parts.append(tmp_path / f"part{k}.pt")
    offline = [set(p for p in asked[f"llm{k}"] if not p.startswith("synth")) for k in range(3)]
    assert set.union(*offline) == set(data.build_prompts(30)) and sum(map(len, offline)) == 30
    synth = [sorted(p for p in asked[f"llm{k}"] if p.startswith("synth")) for k in range(3)]
    assert [len(s) for s in synth] == [3, 3, 3]  # ceil(7 / 3) each, with seeds no other shard uses
    assert len(set().union(*map(set, synth))) == 9
    with pytest.raises(ValueError, match="shard"):
        data.make_dataset("llm", 30, 7, 16, shard=(3, 3))
    # joining the parts keeps each prompt once, in order
    merged = data.merge_samples(parts + parts[:1])
    assert len(merged) == len({tuple(s.prompt) for s in merged}) == 39
    assert merged[:len(data.load_samples(parts[0]))] == data.load_samples(parts[0])


def test_prompt_vocabulary_stays_off_the_eval_subjects():
    import random

    from tercel.train import data, prompts

    words = [*prompts.TOPICS, *prompts.HOW_TO, *prompts.CODE_TASKS, *prompts.CONCEPTS]
    hits = [(w, s) for w in words for s in EVAL_SUBJECTS if s in w.lower()]
    assert not hits, f"prompt vocabulary names a held-out eval subject: {hits}"
    everything = prompts.chat_prompts() + prompts.code_prompts(random.Random(0))
    assert len(everything) > 5000 and len(set(everything)) == len(everything)
    assert all("{" not in p for p in everything)  # every template filled
    assert not set(everything) & (set(data.EVAL_CHAT_PROMPTS) | set(data.EVAL_CODE_PROMPTS))
