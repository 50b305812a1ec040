"""HF transformers as the peer, in the same process, at concurrency 1: eager greedy `generate`, prompt-lookup
decoding, and (CUDA only) a static cache with torch.compile - the configurations people actually run."""
from __future__ import annotations

import statistics
import time
import traceback

import torch

PEER_CONFIGS = ("eager", "prompt_lookup", "static_compile")


def load_hf_model(cfg, loaded, device: torch.device, dtype: torch.dtype):
    """The same target in transformers: the same file, or for a shape the same config with HF's own random
    init (speed does not depend on the values, except for prompt lookup's acceptance)."""
    import transformers

    from ..loader.model_loader import resolve_model_path
    from .shapes import target_shape

    transformers.logging.set_verbosity_error()
    shape = target_shape(cfg.model)
    if shape is not None:
        hf_cfg = transformers.AutoConfig.for_model(**shape.hf_config)
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    path = resolve_model_path(cfg.model)
    if path.is_file():  # GGUF: transformers dequantizes it, as Tercel does on a GPU
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _time(fn, device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return out


def run_hf_peers(cfg, loaded, prompt_ids: list[int], device: torch.device) -> list[dict]:
    """One row per (peer configuration, output length): tok/s (median of timed runs after warm-up)."""
    from transformers import CompileConfig, GenerationConfig

    dtype = next(loaded.model.parameters()).dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    try:
        model = load_hf_model(cfg, loaded, device, dtype)
    except Exception as e:  # noqa: BLE001 - the sweep's own results still get written
        return [{"config": "load", "error": f"{type(e).__name__}: {e}"}]
    ids = torch.tensor([prompt_ids], device=device)
    pad = (loaded.eos_token_ids or (0,))[0]
    repeats, warmup = (3, 1) if device.type == "cuda" else (1, 0)
    rows = []
    for n in cfg.output_lens:
        base = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad)
        configs = {"eager": (GenerationConfig(**base), "generate, DynamicCache, eager"),
                   "prompt_lookup": (GenerationConfig(**base, prompt_lookup_num_tokens=cfg.hf_prompt_lookup),
                                     f"generate with prompt_lookup_num_tokens={cfg.hf_prompt_lookup}")}
        if device.type == "cuda":  # reduce-overhead is CUDA graphs
            configs["static_compile"] = (
                GenerationConfig(**base, cache_implementation="static",
                                 compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead")),
                "static cache + CompileConfig(fullgraph=True, mode='reduce-overhead')")
        for name, (gen_cfg, described) in configs.items():
            row: dict = {"config": name, "described": described, "output_len": n, "concurrency": 1}
            try:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    for _ in range(3 if name == "static_compile" else warmup):  # compile + graph recording
                        model.generate(ids, generation_config=gen_cfg)
                    row["warmup_s"] = round(time.perf_counter() - t0, 2)
                    times = _time(lambda g=gen_cfg: model.generate(ids, generation_config=g), device, repeats)
                row["tok_s"] = round(n / statistics.median(times), 2)
                row["times_s"] = [round(t, 4) for t in times]
            except Exception as e:  # noqa: BLE001 - one peer failing (e.g. compile) keeps the others
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
    import transformers

    for row in rows:
        row["transformers"] = transformers.__version__
    model = None  # the peer's weights go before anything else loads
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows
