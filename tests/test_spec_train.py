"""The EAGLE-3 trainer: its training-time test computes exactly what the engine's draft computes
(step 0 = draft_extend's state, step 1 = the draft loop's next step), and `train-draft` writes a
SpecForge-format draft that the engine loads, resuming from its checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from spec_utils import spec_llm
from tercel import LLM, SamplingParams
from tercel.train.data import Sample, target_features
from tercel.train.eagle3 import Eagle3TrainConfig, Eagle3Trainer, choose_draft_vocab, ttt_loss
from tercel.train.export import random_eagle3

transformers.logging.set_verbosity_error()


def _ttt_logits(model, target, ids, steps):
    """Per-step draft logits of the training-time test over one sequence."""
    aux, _ = target_features(target, torch.tensor([ids]), tuple(sorted(model.config.aux_layer_ids)))
    caught, orig = [], model.compute_logits
    model.compute_logits = lambda h: caught.append(orig(h)) or caught[-1]
    try:
        vd = model.config.draft_vocab_size
        ttt_loss(model, target.embed_tokens.weight, aux, torch.zeros(1, len(ids), vd), torch.tensor([ids]),
                 torch.ones(1, len(ids), dtype=torch.bool), steps)
    finally:
        model.compute_logits = orig
    return caught


def test_training_time_test_matches_the_engines_draft(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "t")
    base = LLM(str(tmp_path / "t"), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
               max_model_len=64)
    draft = random_eagle3(tmp_path / "d", base.engine.model_config, draft_vocab_size=48, aux_layer_ids=(0, 2, 4),
                          std=0.3)
    llm = spec_llm(base, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                   speculative_num_steps=3)
    eng = llm.engine
    prompt = [5, 17, 3, 88, 41, 9, 60]
    eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    eng.step()  # prefill + draft extend over the prompt
    req = next(iter(eng.requests.values()))
    model, target = eng.spec.drafter.model, eng.model
    seq = prompt + req.output_token_ids
    step0 = _ttt_logits(model, target, seq, 1)[0][0, len(prompt) - 1]
    torch.testing.assert_close(req.spec_state.logits, step0, rtol=1e-4, atol=1e-4)
    caught, orig = [], model.compute_logits
    model.compute_logits = lambda h: caught.append(orig(h)) or caught[-1]
    tree = eng.spec.drafter.propose([req])[0]
    model.compute_logits = orig
    step1 = _ttt_logits(model, target, seq + [tree.tokens[1]], 2)[1][0, len(prompt) - 1]
    torch.testing.assert_close(caught[0][0, 0], step1, rtol=1e-4, atol=1e-4)


def test_draft_vocabulary_is_the_most_frequent_response_tokens():
    samples = [Sample([1, 2], [5, 5, 5, 7, 7, 9]), Sample([3], [7, 5, 11])]
    assert choose_draft_vocab(samples, 3, 20).tolist() == [5, 7, 9]
    assert choose_draft_vocab(samples, 3, 20, always=(2,)).tolist() == [2, 5, 7]


@pytest.mark.slow
def test_train_draft_writes_a_loadable_draft_and_resumes(tmp_path, smol_path, smol_llm):
    """(the CLI runs the same trainer: tercel train-draft --algorithm eagle3 --out DIR ...)"""
    out = tmp_path / "draft"
    cfg = dict(out=str(out), target=smol_path, device="cpu", num_prompts=4, synth_prompts=2, max_new_tokens=4, max_len=48,
               draft_vocab_size=256, intermediate_size=64, batch_size=2, save_every=1, ttt_steps=2)
    Eagle3Trainer(Eagle3TrainConfig(max_steps=2, **cfg), llm=smol_llm).train()
    assert json.loads((out / "train_log.json").read_text())["steps"] == 2
    Eagle3Trainer(Eagle3TrainConfig(max_steps=3, **cfg), llm=smol_llm).train()  # resumes: one more step
    assert json.loads((out / "train_log.json").read_text())["steps"] == 3
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == 256
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(out))
    out_ = llm.generate([[1, 9690, 198]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out_.outputs[0].token_ids) == 4
