"""The engine's settings are one tree (tercel.config.EngineConfig): LLMEngine takes the tree or the same
settings as flat keyword arguments, validates them in one place, and both command lines build their
flags from the tree's field metadata, so a setting is written once."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, make_dataclass

import pytest
import torch
import transformers

import tercel.cli_args
from tercel import LLM, LLMEngine, SamplingParams
from tercel.config import ConfigError, EngineConfig, UnknownSettingError, settings
from tercel.options import option, parse_int, positive_int

transformers.logging.set_verbosity_error()


@dataclass(slots=True)
class ExtraConfig:
    """extras"""

    fancy_knob: int = option(7, "a knob only this test has", parse=parse_int, check=positive_int())


def _help(cmd: str) -> str:
    from tercel.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[cmd].format_help()


def test_a_new_field_appears_in_both_command_lines(monkeypatch, capsys):
    """A section added to the tree: its field is a flag of generate and serve, parsed, checked and
    carried into the config, with nothing written in either CLI."""
    tree = make_dataclass("EngineConfigPlus", [("extra", ExtraConfig, field(default_factory=ExtraConfig))],
                          bases=(EngineConfig,), slots=True)
    monkeypatch.setattr(tercel.cli_args, "EngineConfig", tree)
    from tercel.cli import build_parser
    from tercel.cli_args import engine_config_from_args

    for cmd in ("generate", "serve"):
        text = " ".join(_help(cmd).split())
        assert "--fancy-knob N a knob only this test has" in text and "extras:" in text
        assert engine_config_from_args(build_parser().parse_args([cmd, "--fancy-knob", "3"])).extra.fancy_knob == 3
        assert engine_config_from_args(build_parser().parse_args([cmd])).extra.fancy_knob == 7
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--fancy-knob", "0"])
        assert f"tercel {cmd}: error: --fancy-knob 0: must be a positive integer" in capsys.readouterr().err


def test_every_cli_setting_is_a_flag_of_both_commands():
    gen, serve = _help("generate"), _help("serve")
    for s in settings():
        if s.option.cli:
            flag = "--" + ("no-" if s.option.negate else "") + s.kwarg.replace("_", "-")
            assert flag in gen and flag in serve, flag
    assert "--threads" in gen and "--model" in gen


def test_flat_kwargs_build_the_tree():
    cfg = EngineConfig.from_kwargs(dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=4,
                                   speculative_algorithm="NGRAM", cuda_graph_bs=[1, 2], threads=2)
    assert (cfg.model.dtype, cfg.cache.kv_cache_memory, cfg.scheduler.max_num_seqs) == ("float32", 1 << 20, 4)
    assert (cfg.speculative.algorithm, cfg.graph.cuda_graph_bs, cfg.kernel.threads) == ("NGRAM", [1, 2], 2)
    assert cfg.max_num_seqs == 4 and cfg.kv_cache_memory == 1 << 20  # the old flat names still read
    assert EngineConfig.from_kwargs(**cfg.to_kwargs()) == cfg


def test_unknown_setting_lists_close_names():
    with pytest.raises(UnknownSettingError, match=r"unknown engine setting 'max_num_seq'; did you mean max_num_seqs\?"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match=r"speculative_num_steps"):  # a TypeError too, like Python's own
        LLM(speculative_num_step=3)


@pytest.mark.parametrize("kw,want", [
    (dict(block_size=0), "block_size=0 must be a positive integer"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization=0.0 must be a number in (0, 1]"),
    (dict(cuda_graph_backend="half"), "cuda_graph_backend='half' is not supported; use one of full, breakable"),
    (dict(cuda_graph_bs=[0]), "cuda_graph_bs=[0] must be a non-empty list of positive integers"),
    (dict(threads=-1), "threads=-1 must be a positive integer"),
    (dict(disable_cuda_graph="yes"), "disable_cuda_graph='yes' must be True or False"),
])
def test_validation_names_the_value_and_the_rule(kw, want):
    with pytest.raises(ConfigError) as ei:
        LLMEngine(**kw)  # refused before any model is looked for
    assert want in str(ei.value)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return str(d)


def test_a_tree_and_flat_kwargs_make_the_same_engine(tiny):
    kw = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, progress=False, num_kv_blocks=16,
              max_num_seqs=4)
    flat = LLM(tiny, **kw)
    tree = EngineConfig.from_kwargs(model=tiny, **kw)
    by_tree = LLM(tree)
    assert by_tree.engine.config == flat.engine.config and flat.engine.config.max_model_len == 128
    assert tree.model.max_model_len is None  # the engine resolves a copy; the caller's tree is unchanged
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert (by_tree.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
            == flat.generate([[1, 2, 3]], params)[0].outputs[0].token_ids)
    with pytest.raises(ConfigError, match="either an EngineConfig or a model and keyword settings"):
        LLMEngine(tree, max_num_seqs=2)
