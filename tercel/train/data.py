"""Self-distillation data for draft training, built offline (no downloads); shared by every draft
trainer (EAGLE-3 here, DFlash later).

1. build_prompts: chat prompts from text on this machine: Python stdlib source (functions and
   their docstrings, read with `ast`, never imported), installed packages' descriptions (their
   METADATA / README text under site-packages), and the hand-written questions and programming
   tasks of tercel.train.prompts.
   synth_user_prompts: the TARGET writes user messages itself, sampled after the chat template's
   user-turn prefix (the Magpie recipe), which gives the varied everyday chat the offline text lacks.
2. generate_responses: the TARGET writes the answers, with Tercel's own engine, in large batches.
   make_dataset runs 1 and 2 for every trainer.
3. Dataset (prompt/response token ids) saves to / loads from a .pt of int tensors (weights_only).
4. target_features: one dense causal forward of the target over padded batches, returning the
   hidden states of chosen layers and the final normed hidden state (for logits of any vocab subset).
"""
from __future__ import annotations

import ast
import logging
import math
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.llama import LlamaForCausalLM
from ..models.rope import apply_rope
from .prompts import chat_prompts, code_prompts

log = logging.getLogger(__name__)

# Held-out evaluation prompts must never be trained on (benchmarks/spec_accept.py uses these).
EVAL_CHAT_PROMPTS = [
    "Tell me about the ocean.", "What is the capital of France?", "Write a short poem about autumn leaves.",
    "Explain what a hash table is in two sentences.", "Give me three tips for learning to cook.",
    "Why is the sky blue?", "What are the planets of the solar system?", "How do vaccines work?",
    "Describe a typical day of a lighthouse keeper.", "What should I pack for a weekend hiking trip?",
]
EVAL_CODE_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python class for a stack with push, pop and peek.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python function that counts the words in a text file.",
    "Write a SQL query that finds the ten most recent orders.",
    "Write a Python function that merges two sorted lists.", "How do I read a CSV file in Python?",
    "Write a JavaScript function that debounces another function.", "Write a Python function for binary search.",
]

# Words naming the subject of each held-out evaluation prompt: no training prompt may name one (the
# hand-written lists are tested against them; prompts the target writes are filtered by them).
EVAL_SUBJECTS = ("ocean", "capital of france", "autumn", "hash table", "cook", "sky", "planet", "solar system",
                 "vaccine", "lighthouse", "hiking", "revers", "prime", "stack", "list comprehension", "count the words",
                 "counts the words", "recent orders", "merge", "csv", "debounce", "binary search")

# Openers of user messages for synth_user_prompts(openers=...): the Magpie prompts SmolLM2 writes
# unprompted are mostly long requests for personal advice, whose answers a draft predicts more easily
# than users' questions (docs/training-drafts.md); starting the turn with a question or task opener
# makes the target write the short questions and tasks users ask. Generic words only.
QUESTION_OPENERS = (
    "What is", "What are", "What was", "Why do", "Why is", "Why are", "How does", "How do", "How can I", "How do I",
    "Explain", "Explain how", "Describe", "Describe how", "Tell me about", "Tell me a", "Write a short", "Write a",
    "Write a poem", "Write a story", "Give me", "Give me three", "List", "Summarize", "Compare",
    "What's the difference", "Can you explain", "What should I", "Which", "Who was", "When did", "Suggest",
    "Help me", "Is it true that",
    "Write a Python function", "Write a Python script", "Write a JavaScript function", "Write a SQL query",
    "Write a function", "How do I write", "In Python, how", "Write a class", "Fix this code", "What does this code",
)


def names_eval_subject(text: str) -> bool:
    low = text.lower()
    return any(s in low for s in EVAL_SUBJECTS)


# KV pool of a target loaded only to compute training features (the dataset already exists)
LIGHT_KV_BYTES = 256 << 20

@dataclass(slots=True)
class Sample:
    prompt: list[int]
    response: list[int]


def _stdlib_functions(limit: int, rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(module, name, source, docstring) of documented stdlib functions/classes, read with ast."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    files += sorted(p for p in root.glob("*/*.py") if "test" not in p.parts[-2] and not p.name.startswith("_"))
    rng.shuffle(files)
    out = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                src = ast.get_source_segment(text, node)
                if doc and src and 80 < len(src) < 1500:
                    out.append((f.stem, node.name, src, doc))
        if len(out) >= limit:
            break
    return out


def _package_paragraphs(limit: int) -> list[str]:
    """Paragraphs of installed packages' descriptions (METADATA bodies are their READMEs)."""
    paras: list[str] = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for meta in sorted(Path(site).glob("*.dist-info/METADATA")):
            try:
                body = meta.read_text(encoding="utf-8", errors="ignore").split("\n\n", 1)[-1]
            except OSError:
                continue
            for p in body.split("\n\n"):
                p = p.strip()
                if 200 < len(p) < 1200 and not p.startswith(("```", "|", "<", "[!", "..")) and p.count("http") < 2:
                    paras.append(p)
            if len(paras) >= limit:
                return paras
    return paras


def build_prompts(n: int, seed: int = 0) -> list[str]:
    """About n distinct chat prompts (user messages) from offline text; the eval prompts are excluded."""
    rng = random.Random(seed)
    prompts: list[str] = []
    functions = _stdlib_functions(n, rng)
    # each function gives up to two prompts of different kinds when n asks for more than there are
    reps = 2 if len(functions) < n else 1
    for mod, name, src, doc in functions * reps:
        first = doc.strip().split("\n")[0].rstrip(".")
        kind = rng.random()
        if kind < 0.4:
            prompts.append(f"Explain what this Python code does:\n\n```python\n{src}\n```")
        elif kind < 0.7 and first:
            prompts.append(f"Write a Python function called `{name}`. Its documentation says: {first}.")
        elif kind < 0.85:
            prompts.append(f"What is `{name}` in Python's `{mod}` module used for? Give an example.")
        else:
            prompts.append(f"Write a docstring and a short usage example for this code:\n\n```python\n{src}\n```")
    for para in _package_paragraphs(n // 3):
        prompts.append(rng.choice([
            "Summarize the following text in a few sentences:\n\n{p}", "Explain this in simple terms:\n\n{p}",
            "What are the key points of this text?\n\n{p}", "Rewrite this text to be shorter and clearer:\n\n{p}",
        ]).format(p=para))
    prompts += chat_prompts() + code_prompts(rng)
    held_out = set(EVAL_CHAT_PROMPTS) | set(EVAL_CODE_PROMPTS)
    prompts = sorted({p for p in prompts if p not in held_out})
    rng.shuffle(prompts)
    return prompts[:n]


def user_turn_prefix(tok) -> list[int]:
    """Token ids the chat template puts before a user message's text (system prompt included): the
    common prefix of two one-message conversations that differ only in that text."""
    a = tok.apply_chat_template([{"role": "user", "content": "A"}], add_generation_prompt=False)
    b = tok.apply_chat_template([{"role": "user", "content": "B"}], add_generation_prompt=False)
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[:n]


def synth_user_prompts(llm, n: int, seed: int = 0, max_tokens: int = 96, temperature: float = 1.0,
                       top_p: float = 0.95, wave: int = 4096, time_budget_s: float | None = None,
                       openers: tuple[str, ...] = ()) -> list[str]:
    """Up to n distinct user messages written by the target itself: sampled after the user-turn
    prefix (request i after openers[i % len(openers)] too, which starts its text), kept only when the
    model ended the turn (finish 'stop') and the text is 10-600 chars; the eval prompts and any text
    naming an eval subject are excluded. Needs a chat template."""
    from ..sampling_params import SamplingParams

    if n <= 0:
        return []
    tok = llm.tokenizer
    if not tok.has_chat_template:
        log.warning("no chat template: no synthetic user prompts")
        return []
    prefix = user_turn_prefix(tok)
    opener_ids = {o: tok.encode(o) for o in ("", *openers)}
    held_out = set(EVAL_CHAT_PROMPTS) | set(EVAL_CODE_PROMPTS)
    seen: set[str] = set()
    out: list[str] = []
    start, tries = time.perf_counter(), math.ceil(n * 1.3)
    for w in range(0, tries, wave):
        if len(out) >= n or (time_budget_s is not None and time.perf_counter() - start > time_budget_s):
            break
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed + w + i)
                  for i in range(min(wave, tries - w))]
        starts = [openers[(w + i) % len(openers)] if openers else "" for i in range(len(params))]
        outs = llm.generate([prefix + opener_ids[o] for o in starts], params, use_tqdm=False)
        log.info("synthetic prompts: wave of %d, %d tokens, %.0f s in, %d kept so far", len(outs),
                 sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start, len(out))
        for opener, o in zip(starts, outs):
            text = (opener + o.outputs[0].text).strip()
            if o.outputs[0].finish_reason == "stop" and 10 <= len(text) <= 600 and text not in held_out \
                    and text not in seen and not names_eval_subject(text):
                seen.add(text)
                out.append(text)
    return out[:n]


# Seeds of shard k's synthetic prompts start at seed + k * SHARD_SEED_STRIDE: no two shards sample alike.
SHARD_SEED_STRIDE = 10_000_000


def make_dataset(llm, num_prompts: int, synth_prompts: int, max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0, wave: int = 4096, time_budget_s: float | None = None,
                 synth_share: float = 0.2, shard: tuple[int, int] = (0, 1), opener_share: float = 0.0) -> list[Sample]:
    """The self-distillation dataset: num_prompts offline prompts plus synth_prompts the target wrote,
    shuffled together, answered by the target. time_budget_s bounds the whole job (synth_share of it
    at most goes to writing prompts). opener_share of the synthetic prompts start with one of
    QUESTION_OPENERS (the rest are plain Magpie). shard=(k, n): this process's part of an n-process
    job (every n-th offline prompt from the k-th, synth_prompts / n prompts sampled with their own
    seeds); the parts are joined with merge_samples. Several processes keep one GPU busier than one,
    whose per-step host work would leave it idle."""
    if not 0.0 < synth_share < 1.0:
        raise ValueError(f"synth_share={synth_share} must be in (0, 1): "
                         "the share of the time budget for writing prompts.")
    if not 0.0 <= opener_share <= 1.0:
        raise ValueError(f"opener_share={opener_share} must be in [0, 1]: the share of synthetic prompts started "
                         "with a question opener.")
    k, n = shard
    if not 0 <= k < n:
        raise ValueError(f"shard=({k}, {n}): the shard index must be in 0..{n - 1} (k of n processes, counted from 0).")
    start = time.perf_counter()
    per_shard = math.ceil(synth_prompts / n)
    n_open = round(per_shard * opener_share)
    synth = []
    # (count, seed offset, openers): the opener prompts take seeds of their own inside the shard's range
    for count, offset, openers in ((per_shard - n_open, 0, ()), (n_open, SHARD_SEED_STRIDE // 2, QUESTION_OPENERS)):
        if count:
            share = count / per_shard
            synth += synth_user_prompts(llm, count, seed + k * SHARD_SEED_STRIDE + offset, wave=wave, openers=openers,
                                        time_budget_s=(None if time_budget_s is None
                                                       else time_budget_s * synth_share * share))
    offline = build_prompts(num_prompts, seed)[k::n]
    prompts = offline + synth
    random.Random(seed).shuffle(prompts)
    left = None if time_budget_s is None else max(1.0, time_budget_s - (time.perf_counter() - start))
    samples = generate_responses(llm, prompts, max_new_tokens, temperature, seed, use_tqdm=False, wave=wave,
                                 time_budget_s=left)
    log.info("dataset: %d offline + %d synthetic prompts, %d answered (%d response tokens) in %.0f s",
             len(offline), len(synth), len(samples), sum(len(s.response) for s in samples), time.perf_counter() - start)
    return samples


def generate_responses(llm, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
                       seed: int = 0, use_tqdm: bool = True, wave: int = 4096,
                       time_budget_s: float | None = None) -> list[Sample]:
    """The target answers the prompts (chat template applied) with Tercel's engine, `wave` requests
    at a time (the scheduler batches them); stops starting waves once time_budget_s has passed.
    Token ids only: detokenization is skipped for speed."""
    from ..sampling_params import SamplingParams

    tok = llm.tokenizer
    limit = llm.engine.config.max_model_len - max_new_tokens
    ids = [x for x in (tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts) if len(x) < limit]
    samples: list[Sample] = []
    start = time.perf_counter()
    for w in range(0, len(ids), wave):
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
        chunk = ids[w:w + wave]
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed + w + i,
                                 detokenize=False) for i in range(len(chunk))]
        outs = llm.generate(chunk, params, use_tqdm=use_tqdm)
        samples += [Sample(p, o.outputs[0].token_ids) for p, o in zip(chunk, outs)]
        log.info("responses: %d of %d prompts, %d response tokens, %.0f s", len(samples), len(ids),
                 sum(len(s.response) for s in samples), time.perf_counter() - start)
    return samples


def save_samples(samples: list[Sample], path: str | Path) -> None:
    torch.save({"prompts": [torch.tensor(s.prompt, dtype=torch.int32) for s in samples],
                "responses": [torch.tensor(s.response, dtype=torch.int32) for s in samples]}, str(path))


def load_samples(path: str | Path) -> list[Sample]:
    d = torch.load(str(path), weights_only=True)
    return [Sample(p.tolist(), r.tolist()) for p, r in zip(d["prompts"], d["responses"])]


def merge_samples(paths: list[str | Path]) -> list[Sample]:
    """The samples of several dataset parts (make_dataset shards), each prompt once (the first answer)."""
    seen: set[tuple[int, ...]] = set()
    out: list[Sample] = []
    for path in paths:
        for s in load_samples(path):
            key = tuple(s.prompt)
            if key not in seen:
                seen.add(key)
                out.append(s)
    return out


def pack_batch(samples: list[Sample], max_len: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T], valid [B, T] and response mask [B, T] (True on response tokens)."""
    seqs = [(s.prompt + s.response)[:max_len] for s in samples]
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    valid = torch.zeros(len(seqs), t, dtype=torch.bool)
    resp = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        ids[i, :len(seq)] = torch.tensor(seq)
        valid[i, :len(seq)] = True
        resp[i, len(s.prompt):len(seq)] = True
    return ids, valid, resp


@torch.no_grad()
def target_features(model: LlamaForCausalLM, ids: torch.Tensor,
                    layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense causal forward of the target over right-padded ids [B, T] (no KV cache, no sliding
    window). Returns (outputs of `layer_ids` concatenated [B, T, n * H], final normed hidden [B, T, H])."""
    b, t = ids.shape
    h = model.embed_tokens(ids)
    cos, sin = model.rope.cos[:t][:, None, :], model.rope.sin[:t][:, None, :]
    aux = []
    for i, layer in enumerate(model.layers):
        at = layer.self_attn
        x = layer.input_layernorm(h)
        qkv = at.qkv_proj(x)
        heads = at.num_heads + at.num_kv_heads
        qk = qkv[..., :at.q_size + at.kv_size].view(b, t, heads, at.head_dim)
        v = qkv[..., at.q_size + at.kv_size:].view(b, t, at.num_kv_heads, at.head_dim)
        if at.q_norm is not None:
            qk = torch.cat([at.q_norm(qk[:, :, :at.num_heads]), at.k_norm(qk[:, :, at.num_heads:])], dim=2)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, :at.num_heads].transpose(1, 2), qk[:, :, at.num_heads:].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
        h = h + at.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in layer_ids:
            aux.append(h)
    # ascending layer order, like the engine's capture (LlamaForCausalLM.forward) and SGLang's
    return torch.cat(aux, dim=-1), model.norm(h)
