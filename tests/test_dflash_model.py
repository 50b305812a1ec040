"""The DFlash draft model equals the z-lab reference (PyPI `dflash`) on random weights, and bad
DFlash checkpoints fail at load with a clear error."""
from __future__ import annotations

import json

import pytest
import torch

from tercel.config import ConfigError, ModelConfig
from tercel.kv import PagedKVCache
from tercel.loader.drafts import load_dflash
from tercel.models.dflash import DFlashConfig, default_target_layer_ids

TARGET = ModelConfig.from_hf_dict({"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64,
                                   "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "max_position_embeddings": 256})


def _draft_dict(**dflash) -> dict:
    d = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "num_target_layers": 6,
         "dflash_config": {"block_size": 4, "mask_token_id": 99, "target_layer_ids": [1, 3, 4]}}
    d["dflash_config"].update(dflash)
    return d


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    ref_model = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    d = _draft_dict()
    cfg = Qwen3Config(**{k: v for k, v in d.items() if k != "architectures"})
    torch.manual_seed(0)
    ref = ref_model.DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    out = tmp_path_factory.mktemp("dflash")
    ref.save_pretrained(out, safe_serialization=True)
    return out, ref


def test_forward_matches_reference(reference_dir):
    path, ref = reference_dir
    ours = load_dflash(path, TARGET, torch.float32, torch.device("cpu"), 256)
    ctx_len, block = 7, 4
    g = torch.Generator().manual_seed(1)
    ctx_hidden = torch.randn(1, ctx_len, 3 * 64, generator=g)
    noise = torch.randn(1, block, 64, generator=g)
    pos = torch.arange(ctx_len + block)[None]
    with torch.no_grad():
        expected = ref(position_ids=pos, noise_embedding=noise, target_hidden=ctx_hidden)
    cache = PagedKVCache(ours.kv_spec(4, torch.float32), 8, torch.device("cpu"))
    blocks = torch.tensor(cache.allocator.allocate(3))
    slots = blocks[torch.arange(ctx_len) // 4] * 4 + torch.arange(ctx_len) % 4
    with torch.no_grad():
        ours.inject_context(ctx_hidden[0], torch.arange(ctx_len), slots, cache)
        got = ours(noise, pos[:, ctx_len:], slots[None], torch.ones(1, ctx_len, dtype=torch.bool), cache)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("dflash_config"), "dflash_config"),
    (lambda d: d["dflash_config"].update(mask_token_id=100), "mask_token_id=100"),
    (lambda d: d["dflash_config"].update(target_layer_ids=[1, 6]), "[6]"),
    (lambda d: d.update(hidden_size=128), "hidden_size=128"),
    (lambda d: d.update(num_target_layers=30), "num_target_layers=30"),
])
def test_bad_config_is_a_clear_error(change, message):
    d = _draft_dict()
    change(d)
    with pytest.raises(ConfigError) as e:
        DFlashConfig.from_dict(d, TARGET, "draft/config.json")
    assert message in str(e.value) and "draft/config.json" in str(e.value)


def test_default_target_layers_spread_like_the_reference():
    ref = pytest.importorskip("dflash.model")
    for layers, drafts in ((30, 5), (30, 1), (36, 3), (6, 2)):
        assert default_target_layer_ids(layers, drafts) == tuple(ref.build_target_layer_ids(layers, drafts))
    d = _draft_dict()
    d["dflash_config"].pop("target_layer_ids")
    assert DFlashConfig.from_dict(d, TARGET, "c").target_layer_ids == default_target_layer_ids(6, 2)


def test_missing_tensor_is_a_clear_error(reference_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = reference_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    sd = load_file(str(path / "model.safetensors"))
    sd.pop("fc.weight")
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="fc.weight"):
        load_dflash(tmp_path, TARGET, torch.float32, torch.device("cpu"), 256)
    json.loads((tmp_path / "config.json").read_text())
