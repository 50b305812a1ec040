"""A draft that does not fit the target fails at load with a clear error (hidden size, vocabulary,
aux layer ids, fc width, tensor shapes, algorithm), and bad speculative arguments are refused."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from tercel import LLM
from tercel.config import ConfigError
from tercel.train.export import random_eagle3

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("target")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    base = LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64)
    return str(path), base.engine.model_config


def _load(target_path, draft, algo="EAGLE3", **kw):
    return LLM(target_path, dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64,
               speculative_algorithm=algo, speculative_draft_model_path=str(draft), **kw)


def _draft(tmp_path, cfg_target, edit_config=None, edit_tensors=None, **kw):
    d = random_eagle3(tmp_path / "draft", cfg_target, aux_layer_ids=kw.pop("aux", (0, 2, 4)), **kw)
    if edit_config:
        c = json.loads((d / "config.json").read_text())
        edit_config(c)
        (d / "config.json").write_text(json.dumps(c))
    if edit_tensors:
        t = load_file(str(d / "model.safetensors"))
        edit_tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return d


def test_a_matching_draft_loads(tmp_path, target):
    path, cfg = target
    llm = _load(path, _draft(tmp_path, cfg, draft_vocab_size=32))
    assert llm.engine.spec.drafter.aux_layer_ids == (0, 2, 4)


def test_a_draft_without_a_head_uses_the_targets(tmp_path, target):
    path, cfg = target
    d = _draft(tmp_path, cfg, head_from_target=True)
    assert "draft_vocab_size" not in json.loads((d / "config.json").read_text())
    assert not {"lm_head.weight", "d2t", "t2d"} & set(load_file(str(d / "model.safetensors")))
    model = _load(path, d).engine.spec.drafter.model
    assert model.head_from_target and model.lm_head is None and not model.maps_vocab


def test_a_draft_without_a_head_needs_the_full_vocabulary(tmp_path, target):
    path, cfg = target
    _expect(r"no lm_head\.weight, so the target's lm_head would be used, but draft_vocab_size=32 < vocab_size=64",
            path, _draft(tmp_path, cfg, draft_vocab_size=32, edit_tensors=lambda t: t.pop("lm_head.weight")))


def _expect(match, path, draft, **kw):
    with pytest.raises(ConfigError, match=match):
        _load(path, draft, **kw)


def test_hidden_size_mismatch(tmp_path, target):
    path, cfg = target
    _expect(r"target hidden size 48 .*target's hidden_size is 32", path,
            _draft(tmp_path, cfg, edit_config=lambda c: c.update(target_hidden_size=48)))


def test_vocab_mismatch(tmp_path, target):
    path, cfg = target
    _expect(r"vocab_size=100 but the target's vocabulary has 64", path,
            _draft(tmp_path, cfg, edit_config=lambda c: c.update(vocab_size=100)))


def test_aux_layer_ids_out_of_range(tmp_path, target):
    path, cfg = target
    _expect(r"eagle_aux_hidden_state_layer_ids \[7\] are out of range for a 6-layer target", path,
            _draft(tmp_path, cfg, edit_config=lambda c: c["eagle_config"].update(
                eagle_aux_hidden_state_layer_ids=[0, 2, 7])))


def test_aux_layer_ids_repeated(tmp_path, target):
    path, cfg = target
    _expect(r"repeat a layer", path, _draft(tmp_path, cfg, edit_config=lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 2, 4])))


def test_fc_width_does_not_match_the_aux_layers(tmp_path, target):
    path, cfg = target
    _expect(r"fc\.weight.*shape \(32, 96\), expected \(32, 64\).*2 aux layers", path,
            _draft(tmp_path, cfg, edit_config=lambda c: c["eagle_config"].update(
                eagle_aux_hidden_state_layer_ids=[0, 4])))


def test_draft_vocab_map_shape(tmp_path, target):
    path, cfg = target
    _expect(r"'d2t' has shape \(31,\), expected \(32,\)", path,
            _draft(tmp_path, cfg, draft_vocab_size=32, edit_tensors=lambda t: t.update(d2t=t["d2t"][:31])))


def test_missing_tensor(tmp_path, target):
    path, cfg = target
    _expect(r"missing tensors \['midlayer\.hidden_norm\.weight'\]", path,
            _draft(tmp_path, cfg, edit_tensors=lambda t: t.pop("midlayer.hidden_norm.weight")))


def test_algorithm_and_draft_kind_must_agree(tmp_path, target):
    path, cfg = target
    _expect(r"speculative_algorithm=EAGLE but .* is an EAGLE3 draft", path, _draft(tmp_path, cfg), algo="EAGLE")
    bad = _draft(tmp_path, cfg, edit_config=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    _expect(r"is not an EAGLE draft", path, bad)


def test_bad_speculative_arguments(tmp_path, target):
    path, cfg = target
    d = _draft(tmp_path, cfg)
    _expect(r"speculative_eagle_topk=0 must be a positive integer", path, d, speculative_eagle_topk=0)
    _expect(r"speculative_num_draft_tokens=99 is out of range for topk=2, num_steps=2", path, d,
            speculative_eagle_topk=2, speculative_num_steps=2, speculative_num_draft_tokens=99)
    _expect(r"speculative_algorithm='MEDUSA' is not supported", path, d, algo="MEDUSA")
    with pytest.raises(ConfigError, match=r"needs speculative_draft_model_path"):
        LLM(path, dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=64,
            speculative_algorithm="EAGLE3")
    with pytest.raises(ConfigError, match=r"is not a directory"):
        _load(path, tmp_path / "does-not-exist")
