"""DFlash training: the trainer learns (its draft beats a random one on the data it saw), writes a
checkpoint the loader reads, and resuming gives exactly the uninterrupted result."""
from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tercel import LLM, SamplingParams
from tercel.train.data import Sample
from tercel.train.dflash import DFlashTrainConfig, train_dflash

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.3)
    path = tmp_path_factory.mktemp("target")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    llm = LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=256)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 63, (n,), generator=g).tolist()
               for n in torch.randint(3, 12, (24,), generator=g).tolist()]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    return path, llm, [Sample(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def _cfg(steps: int) -> DFlashTrainConfig:
    return DFlashTrainConfig(block_size=4, num_layers=1, intermediate_size=64, mask_token_id=63,
                             target_layer_ids=(2, 0), steps=steps, sequences_per_step=4, lr=3e-3, warmup=5,
                             checkpoint_every=10)


def test_trained_draft_beats_random_on_its_data_and_stays_lossless(tiny, tmp_path):
    path, llm, data = tiny
    out = train_dflash(llm.engine.model, data, tmp_path / "d", _cfg(150), torch.device("cpu"), progress=False)
    prompts = [s.prompt for s in data[:8]]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0,
                                                                                   ignore_eos=True))]
    spec = LLM(str(path), dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, max_model_len=256,
               speculative_algorithm="DFLASH", speculative_draft_model_path=str(out),
               speculative_adaptive=False)  # acceptance of full blocks, not the policy's choice of width
    outs = spec.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert spec.engine.spec_stats().mean_accept_length > 1.1  # a random draft stays at ~1.0


def test_resume_equals_uninterrupted(tiny, tmp_path):
    _, llm, data = tiny
    model = llm.engine.model
    straight = train_dflash(model, data, tmp_path / "a", _cfg(20), torch.device("cpu"), progress=False)
    train_dflash(model, data, tmp_path / "b", _cfg(20), torch.device("cpu"), progress=False, stop_after=10)
    assert torch.load(tmp_path / "b" / "trainer_state.pt", weights_only=True)["step"] == 10
    resumed = train_dflash(model, data, tmp_path / "b", _cfg(20), torch.device("cpu"), progress=False)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_warm_start_loads_an_exported_draft(tiny, tmp_path):
    _, llm, data = tiny
    model = llm.engine.model
    first = train_dflash(model, data, tmp_path / "a", _cfg(20), torch.device("cpu"), progress=False)
    # no steps after the warm start: the export is the loaded draft, tensor for tensor
    again = train_dflash(model, data, tmp_path / "b", _cfg(0), torch.device("cpu"), progress=False, init_from=first)
    a, b = load_file(str(first / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a larger block reuses the weights (none depends on the block size) and trains on
    wider = _cfg(5)
    wider.block_size = 8
    train_dflash(model, data, tmp_path / "c", wider, torch.device("cpu"), progress=False, init_from=first)
    other = _cfg(1)
    other.target_layer_ids = (1, 3)
    with pytest.raises(ValueError, match="target_layer_ids"):
        train_dflash(model, data, tmp_path / "d", other, torch.device("cpu"), progress=False, init_from=first)
    with pytest.raises(FileNotFoundError, match="config.json"):
        train_dflash(model, data, tmp_path / "e", _cfg(1), torch.device("cpu"), progress=False,
                     init_from=tmp_path / "nowhere")
