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
from tercel.loader.drafts import load_eagle_draft
from tercel.models.eagle3 import EagleDraftConfig, EagleDraftModel
from tercel.train.data import Sample, target_features
from tercel.train.eagle3 import Eagle3TrainConfig, Eagle3Trainer, choose_draft_vocab, ttt_loss, warm_start
from tercel.train.export import eagle3_config_dict, random_eagle3

transformers.logging.set_verbosity_error()


def _tiny_target(tmp_path) -> LLM:
    """A random 6-layer Llama (vocab 96) saved under tmp_path / "t", loaded in fp32 on CPU."""
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "t")
    return LLM(str(tmp_path / "t"), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False,
               max_model_len=64)


def _ttt_logits(model, target, ids, steps):
    """Per-step draft logits of the training-time test over one sequence (every row a label, so
    step j's logits are rows 0 .. len(ids) - 3 - j in order; `steps` filler tokens give the last rows
    labels, and causal attention keeps them out of the rows before)."""
    ids = ids + [0] * (steps + 1)
    aux, final = target_features(target, torch.tensor([ids]), tuple(sorted(model.config.aux_layer_ids)))
    caught, orig = [], model.compute_logits
    model.compute_logits = lambda h: caught.append(orig(h)) or caught[-1]
    try:
        head = target.lm_head_weight[model.draft_to_target]
        ttt_loss(model, target.embed_tokens.weight, aux, final, head, torch.tensor([ids]),
                 torch.ones(1, len(ids), dtype=torch.bool), steps)
    finally:
        model.compute_logits = orig
    return caught


@pytest.mark.parametrize("head_from_target", [False, True], ids=["own-head", "target-head"])
def test_training_time_test_matches_the_engines_draft(tmp_path, head_from_target):
    torch.manual_seed(0)
    base = _tiny_target(tmp_path)
    draft = random_eagle3(tmp_path / "d", base.engine.model_config, draft_vocab_size=48, aux_layer_ids=(0, 2, 4),
                          std=0.3, head_from_target=head_from_target)
    llm = spec_llm(base, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(draft),
                   speculative_num_steps=3)
    eng = llm.engine
    prompt = [5, 17, 3, 88, 41, 9, 60]
    eng.add_request(prompt, SamplingParams(max_tokens=20, temperature=0))
    eng.step()  # prefill + draft extend over the prompt
    req = next(iter(eng.requests.values()))
    model, target = eng.spec.drafter.model, eng.model
    seq = prompt + req.output_token_ids
    step0 = _ttt_logits(model, target, seq, 1)[0][len(prompt) - 1]
    torch.testing.assert_close(req.spec_state.logits, step0, rtol=1e-4, atol=1e-4)
    caught, orig = [], model.compute_logits
    model.compute_logits = lambda h: caught.append(orig(h)) or caught[-1]
    chains = eng.spec.drafter.propose([req])  # greedy chains: drafted on the device, [B, steps + 1]
    model.compute_logits = orig
    step1 = _ttt_logits(model, target, seq + [int(chains.tokens[0, 1])], 2)[1][len(prompt) - 1]
    torch.testing.assert_close(caught[0][0], step1, rtol=1e-4, atol=1e-4)


def test_warm_start_with_a_wider_mlp_computes_what_the_old_draft_did(tmp_path):
    torch.manual_seed(0)
    tcfg = _tiny_target(tmp_path).engine.model_config
    old_dir = random_eagle3(tmp_path / "old", tcfg, aux_layer_ids=(0, 2, 4), std=0.3, intermediate_size=48)
    old = load_eagle_draft(old_dir, tcfg, torch.float32, torch.device("cpu"), 64)
    new_cfg = EagleDraftConfig.from_dict(eagle3_config_dict(tcfg, draft_vocab_size=None, aux_layer_ids=(0, 2, 4),
                                                            intermediate_size=80), tcfg, "new")
    new = EagleDraftModel(new_cfg, 64, torch.float32, has_embed=False, has_head=False)
    with torch.no_grad():
        for p in new.parameters():
            p.normal_()
    warm_start(new, old_dir)
    embed = torch.randn(96, 32)
    for m in (old, new):
        m.share_target(embed, embed)
    n = 5
    ids, hidden, pos = torch.randint(0, 96, (n,)), torch.randn(n, 96), torch.arange(n)

    def attend(layer, q, k, v):  # causal attention over these rows
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(0, 1).reshape(n, -1)

    torch.testing.assert_close(new(ids, hidden, pos, attend, from_target=True),
                               old(ids, hidden, pos, attend, from_target=True))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        warm_start(new, tmp_path)


def test_warm_start_moved_to_another_aux_layer_sees_inputs_of_its_old_scale(tmp_path):
    """fc columns of a changed aux slot are scaled by old / new RMS per channel: fc(new features) equals
    fc(old features) when the new layer is the old one scaled per channel; other slots are untouched."""
    from tercel.train.eagle3 import rescale_fc

    torch.manual_seed(0)
    tcfg = _tiny_target(tmp_path).engine.model_config
    src = random_eagle3(tmp_path / "old", tcfg, aux_layer_ids=(0, 2, 4), std=0.3)
    cfg = EagleDraftConfig.from_dict(eagle3_config_dict(tcfg, draft_vocab_size=None, aux_layer_ids=(0, 2, 3)),
                                     tcfg, "n")
    model = EagleDraftModel(cfg, 64, torch.float32, has_embed=False, has_head=False)
    assert warm_start(model, src) == (0, 2, 4)
    h = tcfg.hidden_size
    old = torch.randn(50, 3 * h)
    gain = torch.cat([torch.ones(2 * h), torch.rand(h) * 100 + 0.1])  # the new third layer: a per-channel rescale
    new = old * gain
    before = model.fc.weight.clone()
    rescale_fc(model, old, new, [2])
    torch.testing.assert_close(model.fc(new), F.linear(old, before), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.fc.weight[:, :2 * h], before[:, :2 * h], rtol=0, atol=0)


def test_hard_label_weight_moves_the_loss_onto_the_targets_top1(tmp_path):
    """loss(w) = (1 - w) * soft cross-entropy + w * cross-entropy on the target's argmax, per step."""
    torch.manual_seed(0)
    eng = _tiny_target(tmp_path).engine
    target, tcfg = eng.model, eng.model_config
    model = load_eagle_draft(random_eagle3(tmp_path / "d", tcfg, aux_layer_ids=(0, 2, 4), std=0.3), tcfg,
                             torch.float32, torch.device("cpu"), 64)
    model.share_target(target.embed_tokens.weight, target.lm_head_weight)
    ids = torch.randint(0, 96, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    aux, final = target_features(target, ids, (0, 2, 4))
    head = target.lm_head_weight
    args = (model, target.embed_tokens.weight, aux, final, head, ids, mask, 1)
    soft, mixed = (ttt_loss(*args, hard_label_weight=w)[0] for w in (0.0, 0.25))
    caught, orig = [], model.compute_logits
    model.compute_logits = lambda h: caught.append(orig(h)) or caught[-1]
    try:
        hard = ttt_loss(*args, hard_label_weight=1.0)[0]
    finally:
        model.compute_logits = orig
    torch.testing.assert_close(mixed, 0.75 * soft + 0.25 * hard)
    # step 0: row i (0 .. T - 3 of each sequence) learns from the target's distribution at row i + 1
    top1 = (final[:, 1:-1] @ head.T).argmax(-1).flatten()
    torch.testing.assert_close(hard, F.cross_entropy(caught[0], top1))
    assert not torch.allclose(soft, hard)
    # checkpointed logits give the same loss and gradients as kept ones
    grads = []
    model.requires_grad_(True)
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        loss, accs = ttt_loss(*args[:-1], 3, hard_label_weight=0.25, checkpoint_logits=ckpt)
        loss.backward()
        grads.append((loss.detach(), accs, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (l0, a0, g0), (l1, a1, g1) = grads
    torch.testing.assert_close(l0, l1)
    torch.testing.assert_close(a0, a1)
    assert len(g0) == len(g1) > 0
    for x, y in zip(g0, g1):
        torch.testing.assert_close(x, y)
    with pytest.raises(ValueError, match="hard_label_weight=1.5 is outside"):
        Eagle3Trainer(Eagle3TrainConfig(out=str(tmp_path / "x"), hard_label_weight=1.5))


def test_draft_vocabulary_is_the_most_frequent_response_tokens():
    samples = [Sample([1, 2], [5, 5, 5, 7, 7, 9]), Sample([3], [7, 5, 11])]
    assert choose_draft_vocab(samples, 3, 20).tolist() == [5, 7, 9]
    assert choose_draft_vocab(samples, 3, 20, always=(2,)).tolist() == [2, 5, 7]


@pytest.mark.slow
def test_train_draft_writes_a_loadable_draft_and_resumes(tmp_path, smol_path, smol_llm):
    """(the CLI runs the same trainer: tercel train-draft --algorithm eagle3 --out DIR ...)"""
    out = tmp_path / "draft"
    cfg = dict(out=str(out), target=smol_path, device="cpu", num_prompts=4, synth_prompts=2, max_new_tokens=4,
               max_len=48, draft_vocab_size=256, intermediate_size=64, batch_size=2, save_every=1, ttt_steps=2)
    Eagle3Trainer(Eagle3TrainConfig(max_steps=2, **cfg), llm=smol_llm).train()
    assert json.loads((out / "train_log.json").read_text())["steps"] == 2
    Eagle3Trainer(Eagle3TrainConfig(max_steps=3, **cfg), llm=smol_llm).train()  # resumes: one more step
    assert json.loads((out / "train_log.json").read_text())["steps"] == 3
    c = json.loads((out / "config.json").read_text())
    assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == 256
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(out))
    out_ = llm.generate([[1, 9690, 198]], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out_.outputs[0].token_ids) == 4
    # the full vocabulary on the target's head, warm-started from the draft above with a wider MLP
    wide = tmp_path / "wide"
    (wide).mkdir()
    (wide / "data.pt").write_bytes((out / "data.pt").read_bytes())
    Eagle3Trainer(Eagle3TrainConfig(**dict(cfg, out=str(wide), draft_vocab_size=0, intermediate_size=96),
                                    max_steps=1, init_from=str(out)), llm=smol_llm).train()
    c = json.loads((wide / "config.json").read_text())
    assert "draft_vocab_size" not in c and c["intermediate_size"] == 96
    llm = spec_llm(smol_llm, speculative_algorithm="EAGLE3", speculative_draft_model_path=str(wide))
    assert llm.engine.spec.drafter.model.head_from_target
    assert len(llm.generate([[1, 9690, 198]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids) == 4


def test_train_draft_flags_reach_the_trainer_config(monkeypatch, tmp_path):
    import tercel.train.eagle3 as eagle3
    from tercel.cli import main

    seen = []

    class Stub:
        def __init__(self, cfg):
            seen.append(cfg)

        def train(self):
            return tmp_path

    monkeypatch.setattr(eagle3, "Eagle3Trainer", Stub)
    assert main(["train-draft", "--out", str(tmp_path), "--hard-label-weight", "0.5", "--checkpoint-logits",
                 "--ttt-steps", "7", "--aux-layer-ids", "1,14,29", "--synth-opener-share", "0.6"]) == 0
    assert (seen[0].hard_label_weight, seen[0].checkpoint_logits, seen[0].ttt_steps) == (0.5, True, 7)
    assert (seen[0].aux_layer_ids, seen[0].synth_opener_share) == ((1, 14, 29), 0.6)
    main(["train-draft", "--out", str(tmp_path)])
    assert (seen[1].hard_label_weight, seen[1].checkpoint_logits, seen[1].aux_layer_ids) == (0.0, False, None)
    with pytest.raises(SystemExit):
        main(["train-draft", "--out", str(tmp_path), "--aux-layer-ids", "1;14"])
