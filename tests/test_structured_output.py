"""Structured output (tercel.structured, xgrammar): a request with a JSON schema / regex / choice / grammar
only ever emits what its grammar allows. 200 sampled (T = 1) SmolLM2 completions against 5 JSON schemas
(nested objects, arrays, enums, bounded numbers, required fields) all validate with jsonschema, with
speculation off and with EAGLE-3 and NGRAM on; greedy constrained speculative output equals greedy
constrained plain output token for token (fp32), chains and trees; the draft-tree masks equal the masks of
the same paths walked one token at a time, and the matcher ends where it started."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from spec_utils import spec_llm

from tercel import SamplingParams
from tercel.speculative import DEFAULT_EAGLE3_DRAFT
from tercel.structured import StructuredOutputError, StructuredOutputsParams

SCHEMAS = [
    {"type": "object", "properties": {  # nested objects
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                  "id": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["name", "id"]}}, "required": ["user"]},
    {"type": "object", "properties": {  # arrays
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {  # enums
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {  # numbers with bounds
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["age", "score"]},
    {"type": "object", "properties": {  # required and optional fields, a boolean
        "ok": {"type": "boolean"}, "city": {"type": "string", "maxLength": 12}, "note": {"type": "string",
                                                                                        "maxLength": 6}},
     "required": ["ok", "city"]},
]
QUESTIONS = ["Give a user record as JSON.", "List some tags for a cooking blog as JSON.",
             "Pick a t-shirt color and size as JSON.", "Give an age and a score as JSON.",
             "Is Paris in France? Answer as JSON with a city."]
PER_SCHEMA = 40  # x 5 schemas = 200 completions per configuration


def _prompts(llm) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def _constrained(schema: dict, **kw) -> SamplingParams:
    # compact JSON: at T = 1 free whitespace could fill max_tokens before the object closes
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True), **kw)


SPEC_CONFIGS = {
    "plain": {},
    "eagle3": dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1),
    "ngram": dict(speculative_algorithm="NGRAM"),
}


def _engine(smol_llm, name: str, **kw):
    cfg = dict(SPEC_CONFIGS[name], **kw)
    if cfg.get("speculative_algorithm") == "EAGLE3":
        cfg["speculative_draft_model_path"] = str(DEFAULT_EAGLE3_DRAFT)
    return spec_llm(smol_llm, **cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPEC_CONFIGS))
def test_200_sampled_completions_validate(smol_llm, name):
    llm = _engine(smol_llm, name, max_num_seqs=200)
    prompts, params = [], []
    short = [smol_llm.tokenizer.encode(f"{q}\nJSON: ") for q in QUESTIONS]  # no chat template: CI time
    for k, (schema, prompt) in enumerate(zip(SCHEMAS, short)):
        for i in range(PER_SCHEMA):
            prompts.append(prompt)
            params.append(_constrained(schema, temperature=1.0, max_tokens=48, seed=1000 * k + i))
    outs = llm.generate(prompts, params)
    assert len(outs) == 200
    raw_controls = []
    for k, o in enumerate(outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (k, c.text)  # the grammar closed the object and allowed only EOS
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError:
            # known gap (docs/serving.md): xgrammar's JSON string rule admits raw control characters (a tab),
            # which strict JSON parsers reject; everything else about the output must still hold
            value = json.loads(c.text, strict=False)
            raw_controls.append(c.text)
        jsonschema.validate(value, SCHEMAS[k // PER_SCHEMA])
    assert len(raw_controls) <= 4, raw_controls
    assert llm.engine.stats().kv_blocks_used == 0
    if name != "plain":
        assert llm.engine.spec_stats().accepted_tokens > 0  # drafts were verified under the masks, and kept


@pytest.fixture(scope="module")
def greedy_case(smol_llm):
    """Prompts, constraints (5 schemas, a regex, a choice) and their plain greedy constrained outputs."""
    prompts = _prompts(smol_llm)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": s}) for s in SCHEMAS]
    params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs={"regex": r"(ab|cd){2,5}x"}))
    params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs={"choice": ["yes", "no"]}))
    prompts += prompts[:2]
    plain = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    for s, ids in zip(SCHEMAS, plain):
        jsonschema.validate(json.loads(smol_llm.tokenizer.decode(ids)), s)
    return prompts, params, plain


@pytest.mark.slow
@pytest.mark.parametrize("name,kw", [
    ("eagle3", {}), ("eagle3", dict(speculative_eagle_topk=4, speculative_num_draft_tokens=8)), ("ngram", {}),
], ids=["eagle3-chain", "eagle3-tree8", "ngram"])
def test_greedy_constrained_spec_equals_plain(smol_llm, greedy_case, name, kw):
    prompts, params, plain = greedy_case
    spec = _engine(smol_llm, name, max_num_seqs=8, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == plain
    assert spec.engine.spec_stats().verify_steps > 0


def test_choice_regex_and_grammar_on_smol(smol_llm):
    prompt = _prompts(smol_llm)[4]
    cases = [({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
             ({"regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-" and t[:3].isdigit()),
             ({"grammar": 'root ::= "(" [a-c]+ ")"'}, lambda t: t[0] == "(" and t[-1] == ")"),
             ({"grammar": 'start: "<" WORD ">"\n%import common.WORD'}, lambda t: t.startswith("<") and t.endswith(">")),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs=so)
              for i, (so, _) in enumerate(cases)]
    outs = smol_llm.generate([prompt] * len(cases), params)
    for (so, ok), o in zip(cases, outs):
        assert o.outputs[0].finish_reason == "stop" and ok(o.outputs[0].text), (so, o.outputs[0].text)


def test_bad_constraints_name_the_problem(smol_llm):
    backend = smol_llm.engine.grammar_backend()
    with pytest.raises(StructuredOutputError, match="objec"):
        backend.compile(StructuredOutputsParams(json={"type": "objec"}))
    with pytest.raises(StructuredOutputError, match="regex"):
        backend.compile(StructuredOutputsParams(regex="a("))
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(StructuredOutputError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(StructuredOutputError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_chat_template_override_file_and_inline(smol_llm, tmp_path):
    from tercel.config import ConfigError

    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    tok = smol_llm.tokenizer
    for value in (str(path), template):
        llm = spec_llm(smol_llm, chat_template=value)
        assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == tok.encode("[user]hi\n")
    assert tok.chat_template != template  # the shared model's own tokenizer keeps its template
    with pytest.raises(ConfigError, match="neither a file nor a Jinja template"):
        spec_llm(smol_llm, chat_template="no-such-file.jinja")


# ---- no model: the tree masks on a toy vocabulary --------------------------------------------------------
TOY_VOCAB = ["a", "b", "c", "ab", "ba", "x", "</s>"]


@pytest.fixture(scope="module")
def toy_backend():
    import xgrammar as xgr

    info = xgr.TokenizerInfo(TOY_VOCAB, stop_token_ids=[6])
    return xgr.GrammarCompiler(info, max_threads=1)


def _state(compiler, regex: str):
    import xgrammar as xgr

    from tercel.structured.backend import GrammarState

    return GrammarState(xgr.GrammarMatcher(compiler.compile_regex(regex)))


def test_tree_masks_equal_step_by_step_masks(toy_backend):
    from tercel.speculative.tree import DraftTree
    from tercel.structured.mask import apply_bitmask, fill_tree, new_bitmask

    # root 5 (already emitted), then a tree: node 1 'a', node 2 'b' (siblings), 3 'b' under 1, 4 'x' under 3
    # (rejected by the grammar), 5 'ab' under 2
    tree = DraftTree([5, 0, 1, 1, 5, 3], [-1, 0, 0, 1, 3, 2])
    state = _state(toy_backend, "(a|b)+c")
    got = new_bitmask(len(tree), len(TOY_VOCAB))
    fill_tree(state, tree.tokens, tree.children, got, 0)
    for node in range(len(tree)):
        path = tree.path_to(node)[1:]
        fresh = _state(toy_backend, "(a|b)+c")
        ok = all(fresh.accept(tree.tokens[j]) for j in path)
        want = new_bitmask(1, len(TOY_VOCAB))
        if ok:
            fresh.fill(want, 0)
        assert torch.equal(got[node], want[0]), node
    assert torch.equal(got[4], new_bitmask(1, len(TOY_VOCAB))[0])  # unreachable: left all-allowed
    back = new_bitmask(1, len(TOY_VOCAB))
    state.fill(back, 0)
    assert torch.equal(back[0], got[0]) and not state.accept(2)  # rolled back to the root: 'c' needs (a|b)+ first
    logits = torch.zeros(len(tree), len(TOY_VOCAB))
    masked = apply_bitmask(logits, got)
    assert masked[0].isinf().tolist() == [False, False, True, False, False, True, True]  # a, b, ab, ba
