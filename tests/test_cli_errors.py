"""A new user's command-line mistakes are refused before any weights load, in one line that names the
flag, the value and the fix (exit code 2), the same way in `tercel generate` and `tercel serve`. Every
test here runs the CLI in-process with the weight loader replaced by one that fails the test if called."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from tercel.cli import main

REPO = Path(__file__).resolve().parent.parent
transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def no_weights(monkeypatch, request):
    """Loading weights (or building an engine) fails the test: every mistake must be caught before
    (except in the test of a working command line)."""
    if request.node.name == "test_a_correct_command_line_generates":
        return
    import tercel.engine
    import tercel.loader.model_loader

    def forbidden(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(tercel.loader.model_loader, "build_model", forbidden)
    monkeypatch.setattr(tercel.engine, "load_model", forbidden)
    monkeypatch.setattr(tercel.engine.LLMEngine, "__init__", forbidden)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """A tiny random Llama with a (GPT-2 style) byte tokenizer and max_position_embeddings 64."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["hello world"], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(root)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(root)
    return str(root)


def one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """main(argv) exits 2 with one line `tercel CMD: error: ...` holding every needle; returns that line."""
    with pytest.raises(SystemExit) as ei:
        code = main(argv)
        raise SystemExit(code)  # errors found after parsing return 2 instead of exiting
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"tercel {argv[0]}: error: "), err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    return err


BOTH = pytest.mark.parametrize("cmd", ["generate", "serve"])


def test_bad_max_tokens(capsys):
    one_line_error(capsys, ["generate", "--max-tokens", "-1"], "--max-tokens -1: must be an integer >= 1")
    one_line_error(capsys, ["generate", "--temperature", "-0.5"], "--temperature -0.5:", ">= 0")


@BOTH
@pytest.mark.parametrize("flag,value,want", [
    ("--max-model-len", "0", "must be a positive integer"),
    ("--max-num-seqs", "-3", "must be a positive integer"),
    ("--num-scheduler-steps", "0", "must be an integer >= 1"),
    ("--gpu-memory-utilization", "1.5", "must be a number in (0, 1]"),
    ("--speculative-ddtree-budget", "99", "must be an integer in 2..64"),
    ("--dtype", "float8", "is not supported; use one of auto, float32"),
    ("--device", "tpu", "is not supported; use auto, cpu or cuda[:N]"),
    ("--threads", "0", "must be a positive integer"),
    ("--speculative-algorithm", "medusa", "is not supported; use one of AUTO, NONE"),
])
def test_bad_value_names_the_flag(capsys, cmd, flag, value, want):
    one_line_error(capsys, [cmd, flag, value], f"{flag} {value}", want)


@BOTH
def test_kv_cache_memory_takes_sizes_in_both_commands(cmd, capsys):
    from tercel.cli import build_parser

    for text, size in (("2GiB", 2 << 30), ("512MiB", 512 << 20), ("1073741824", 1 << 30), ("1.5k", 1500)):
        assert build_parser().parse_args([cmd, "--kv-cache-memory", text]).kv_cache_memory == size
    one_line_error(capsys, [cmd, "--kv-cache-memory", "2XB"], "--kv-cache-memory '2XB' is not a size", "2GiB")


@BOTH
def test_auto_speculation_in_both_commands(cmd):
    from tercel.cli import build_parser

    args = build_parser().parse_args([cmd, "--speculative-algorithm", "auto"])
    assert args.speculative_algorithm == "AUTO"
    default = build_parser().parse_args([cmd]).speculative_algorithm
    assert default == ("AUTO" if cmd == "generate" else None)  # serve: plain decoding unless asked


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@BOTH
def test_cuda_without_cuda_says_the_flag(capsys, cmd):
    err = one_line_error(capsys, [cmd, "--device", "cuda"], "--device cuda: CUDA is not available here",
                         "use --device cpu")
    assert "device='cpu'" not in err


@BOTH
def test_unknown_flag_prints_the_subcommands_usage(capsys, cmd):
    with pytest.raises(SystemExit) as ei:
        main([cmd, "--bogus"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tercel {cmd} ") and "--kv-cache-memory" in err
    assert err.strip().endswith(f"tercel {cmd}: error: unrecognized arguments: --bogus")


@BOTH
def test_max_model_len_beyond_the_model_fails_before_loading(capsys, tiny_dir, cmd):
    one_line_error(capsys, [cmd, "--model", tiny_dir, "--max-model-len", "1000", "--device", "cpu"],
                   "--max-model-len 1000: exceeds the model's max_position_embeddings=64")


@BOTH
def test_missing_model_path_fails_before_loading(capsys, tmp_path, cmd):
    one_line_error(capsys, [cmd, "--model", str(tmp_path / "nope"), "--device", "cpu"], "does not exist")


def test_overlong_prompt_fails_after_the_tokenizer_before_the_weights(capsys, tiny_dir):
    one_line_error(capsys, ["generate", "--model", tiny_dir, "--device", "cpu", "--prompt", "hello world " * 40],
                   "--prompt: the prompt has", "the longest sequence is 64", "--max-model-len")
    one_line_error(capsys, ["generate", "--model", tiny_dir, "--device", "cpu", "--max-model-len", "8",
                            "--prompt", "hello world " * 3], "the longest sequence is 8")


def test_serve_own_flags_share_the_format(capsys):
    one_line_error(capsys, ["serve", "--port", "70000"], "--port 70000: must be a port number in 1..65535")
    one_line_error(capsys, ["serve", "--max-n", "0"], "--max-n 0: must be a positive integer")
    one_line_error(capsys, ["serve", "--max-n", "16", "--max-request-fanout", "8"],  # a cross-flag check
                   "--max-request-fanout 8 is below --max-n 16")


def test_threads_flag_reaches_the_engine_config():
    from tercel.cli import build_parser
    from tercel.cli_args import engine_config_from_args

    assert engine_config_from_args(build_parser().parse_args(["generate", "--threads", "3"])).kernel.threads == 3
    assert engine_config_from_args(build_parser().parse_args(["generate"])).kernel.threads is None


SPEC_MISTAKES = [
    (["--speculative-algorithm", "EAGLE"],
     ["--speculative-algorithm EAGLE needs --speculative-draft-model-path", "a draft directory"]),
    (["--speculative-draft-model-path", "/nope"], ["--speculative-draft-model-path /nope"]),  # and below
    (["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "/nope"],
     ["--speculative-draft-model-path /nope: no such directory", "a DFlash draft directory"]),
    (["--speculative-algorithm", "EAGLE3", "--speculative-token-map", "/nope.json"],
     ["--speculative-token-map /nope.json: no such file"]),
]


@BOTH
@pytest.mark.parametrize("flags,needles", SPEC_MISTAKES, ids=["eagle-no-draft", "missing-draft", "dflash-missing",
                                                               "missing-token-map"])
def test_speculative_mistakes_fail_before_loading(capsys, cmd, flags, needles):
    err = one_line_error(capsys, [cmd, *flags, "--device", "cpu"], *needles)
    if flags == ["--speculative-draft-model-path", "/nope"]:  # generate: AUTO's EAGLE3 draft; serve: no algorithm
        assert ("no such directory" in err if cmd == "generate" else
                "speculative decoding is off; pass --speculative-algorithm EAGLE3" in err), err


@BOTH
@pytest.mark.parametrize("flags,needles", SPEC_MISTAKES[:2], ids=["eagle-no-draft", "missing-draft"])
def test_speculative_mistakes_fail_in_seconds_without_torch(cmd, flags, needles):
    """As a user runs it, in a fresh process: the error comes before torch is even imported, in <= 3 s."""
    probe = ("import sys; from tercel.cli import main; code = main(sys.argv[1:]); "
             "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe, cmd, *flags], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    elapsed = time.perf_counter() - start
    assert out.returncode == 2 and out.stdout.strip() == "no torch", (out.stdout, out.stderr)
    assert all(n in out.stderr for n in needles), out.stderr
    assert elapsed <= 3.0, f"took {elapsed:.1f} s"


def test_python_dash_m_tercel_is_the_cli():
    out = subprocess.run([sys.executable, "-m", "tercel", "generate", "--max-tokens", "0"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "tercel generate: error: --max-tokens 0: must be an integer >= 1"


def test_a_correct_command_line_generates(capsys):
    """The same flags, right: the model loads (the tokenizer once) and generates."""
    from server_harness import tiny_model_dir

    threads = torch.get_num_threads()
    try:
        assert main(["generate", "--model", str(tiny_model_dir()), "--device", "cpu", "--chat", "hi", "--max-tokens",
                     "4", "--ignore-eos", "--kv-cache-memory", "16MiB", "--threads", "1",
                     "--speculative-algorithm", "ngram"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "-- 4 tokens" in err and "finish: length" in err and "NGRAM" in err
