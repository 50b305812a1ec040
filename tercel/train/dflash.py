"""Train a DFlash block draft for a target by self-distillation.

Data: the target's own responses (tercel.train.data: Sample, built offline) and the target's hidden
states at the chosen layers (data.target_features), computed per batch. Each step samples random
anchor positions in every response: a block is [token at anchor, mask x (S - 1)] that sees the
context before the anchor, and learns the next S - 1 tokens, with the loss weighted toward early
block positions (w_j = exp(-(j - 1) / gamma)), since an early miss ends the accepted prefix.
Embedding and lm_head are the target's, frozen.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..config import ModelConfig
from ..models.dflash import DFlashConfig, DFlashDraftModel, default_target_layer_ids
from ..models.llama import LlamaForCausalLM
from .data import Sample, pack_batch, target_features

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DFlashTrainConfig:
    block_size: int = 16
    num_layers: int = 2
    intermediate_size: int = 768
    target_layer_ids: tuple[int, ...] | None = None  # default: spread like the reference, 3 layers
    mask_token_id: int | None = None  # None: run_training picks one the chat template never produces
    anchors_per_sequence: int = 16
    sequences_per_step: int = 16
    steps: int = 1000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.0
    loss_decay_gamma: float = 7.0
    seed: int = 0
    checkpoint_every: int = 200
    extra: dict = field(default_factory=dict)


def draft_config_dict(target: ModelConfig, cfg: DFlashTrainConfig) -> dict:
    if cfg.mask_token_id is None:
        raise ValueError("DFlashTrainConfig.mask_token_id is not set: pick a token the chat template never produces.")
    ids = tuple(sorted(cfg.target_layer_ids or default_target_layer_ids(target.num_layers, 3)))
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
        "head_dim": target.head_dim, "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
        "max_position_embeddings": target.max_position_embeddings, "num_target_layers": target.num_layers,
        "attention_bias": False, "tie_word_embeddings": False,
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(ids)},
    }


def _block_loss(draft: DFlashDraftModel, target: LlamaForCausalLM, seqs: torch.Tensor, lengths: torch.Tensor,
                hidden: torch.Tensor, anchors: torch.Tensor, cfg: DFlashTrainConfig,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs: [N, T] padded ids; lengths: [N]; hidden: [N, T, n_aux * H]; anchors: [N, m].
    Returns the weighted loss and the per-position accuracy [S - 1]."""
    s = cfg.block_size
    idx = anchors[..., None] + torch.arange(s, device=seqs.device)  # [N, m, S]
    inside = idx < lengths[:, None, None]
    tokens = seqs.gather(1, idx.clamp(max=seqs.shape[1] - 1).flatten(1)).view(idx.shape)
    block = torch.full_like(tokens, cfg.mask_token_id)
    block[..., 0] = tokens[..., 0]
    labels = torch.where(inside, tokens, torch.full_like(tokens, -100))[..., 1:]
    embeds = target.embed_tokens(block).detach()
    h = draft.forward_dense(hidden, anchors, embeds)[:, :, 1:]  # [N, m, S-1, H]
    logits = target.compute_logits(h)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                         reduction="none").view(labels.shape)
    valid = (labels != -100).float()
    w = weights * valid
    hits = (logits.argmax(-1) == labels).float() * valid
    return (ce * w).sum() / w.sum().clamp_min(1.0), hits.sum((0, 1)) / valid.sum((0, 1)).clamp_min(1.0)


@torch.no_grad()
def _cache_features(target: LlamaForCausalLM, samples: list[Sample], layer_ids: tuple[int, ...],
                    device: torch.device, progress: bool, chunk: int = 8) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for i in tqdm(range(0, len(samples), chunk), desc="target features", disable=not progress):
        part = samples[i:i + chunk]
        packed, _, _ = pack_batch(part, max(len(s.prompt) + len(s.response) for s in part))
        feats, _ = target_features(target, packed.to(device), layer_ids)
        out += [feats[j, :len(s.prompt) + len(s.response)].to(torch.bfloat16) for j, s in enumerate(part)]
    return out


def train_dflash(target: LlamaForCausalLM, data: list[Sample], out_dir: str | Path,
                 cfg: DFlashTrainConfig, device: torch.device, progress: bool = True,
                 autocast_dtype: torch.dtype | None = None, stop_after: int | None = None,
                 time_budget_s: float | None = None, cache_features: bool = False,
                 init_from: str | Path | None = None) -> Path:
    """Train (resuming from out_dir/trainer_state.pt when present) and write the z-lab format.
    stop_after / time_budget_s: end this call after that many steps / seconds, checkpointed for a resume.
    init_from: an exported DFlash draft of the same shape to start from instead of random weights."""
    started = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tcfg = target.config
    cfg_dict = draft_config_dict(tcfg, cfg)
    dcfg = DFlashConfig.from_dict(cfg_dict, tcfg, str(out / "config.json"))
    max_len = max(len(d.prompt) + len(d.response) for d in data) + cfg.block_size
    g = torch.Generator().manual_seed(cfg.seed)
    draft = DFlashDraftModel(dcfg, max_len, torch.float32).to(device)
    with torch.no_grad():  # small init; the output norm starts as the target's, so logits start at its scale
        for name, p in draft.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        draft.norm.weight.copy_(target.norm.weight.float())
        if init_from is not None:
            warm_start(draft, cfg_dict, init_from)
    target.requires_grad_(False)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    state_path = out / "trainer_state.pt"
    start = 0
    if state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=True)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        g.set_state(state["rng"])
        log.info("resumed DFlash training at step %d", start)
    weights = torch.exp(-torch.arange(cfg.block_size - 1, device=device, dtype=torch.float32) / cfg.loss_decay_gamma)
    usable = [d for d in data if len(d.response) >= 2]
    if not usable:
        raise ValueError("no training sequence has a response of at least 2 tokens.")
    end = cfg.steps if stop_after is None else min(cfg.steps, start + stop_after)
    ids = dcfg.target_layer_ids
    cached = _cache_features(target, usable, tuple(sorted(ids)), device, progress) if cache_features else None
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc="train dflash", disable=not progress)
    history: list[dict] = []  # every 50 steps: loss and per-position accuracy, for train_log.json
    for step in bar:
        # cosine decay over the steps, or over the time budget when that ends the run first
        done = step / cfg.steps
        if time_budget_s is not None:
            done = max(done, (time.monotonic() - started) / time_budget_s)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(done, 1.0)))
        for group in opt.param_groups:
            group["lr"] = lr
        picks = torch.randint(0, len(usable), (cfg.sequences_per_step,), generator=g).tolist()
        seqs = [usable[i] for i in picks]
        packed, _, _ = pack_batch(seqs, max_len)
        packed = packed.to(device)
        if cached is not None:  # precomputed once (CPU training: the target forward dominates)
            t = packed.shape[1]
            hiddens = torch.stack([F.pad(cached[i][:t], (0, 0, 0, t - min(t, cached[i].shape[0]))) for i in picks])
        else:
            hiddens, _ = target_features(target, packed, tuple(sorted(ids)))
        lengths = torch.tensor([len(q.prompt) + len(q.response) for q in seqs])
        lo = torch.tensor([len(q.prompt) for q in seqs])
        u = torch.rand(len(seqs), cfg.anchors_per_sequence, generator=g)
        anchors = (lo[:, None] + (u * (lengths - 1 - lo)[:, None]).long()).to(device)  # in [prompt, len - 2]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss, acc = _block_loss(draft, target, packed, lengths.to(device), hiddens.float(), anchors, cfg, weights)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if (step + 1) % 10 == 0:  # reading loss / acc waits for the GPU: not every step
            loss_total, acc_mean = float(loss.detach()), acc.tolist()
            bar.set_postfix(loss=f"{loss_total:.3f}", acc1=f"{acc_mean[0]:.2f}", lr=f"{lr:.1e}")
        if (step + 1) % 50 == 0:
            history.append({"step": step + 1, "loss": round(loss_total, 4), "acc": [round(a, 3) for a in acc_mean],
                            "elapsed_s": round(time.monotonic() - started, 1)})
        out_of_time = time_budget_s is not None and time.monotonic() - started > time_budget_s
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end or out_of_time:
            torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                        "rng": g.get_state()}, state_path)
        if out_of_time:
            log.warning("time budget of %.0f s reached at step %d of %d", time_budget_s, step + 1, cfg.steps)
            break
    save_dflash(draft, cfg_dict, out, {"train_config": json.dumps(asdict(cfg), default=str)})
    (out / "train_log.json").write_text(json.dumps({"config": asdict(cfg), "num_samples": len(usable),
                                                    "history": history}, indent=1, default=str))
    return out


def warm_start(draft: DFlashDraftModel, cfg_dict: dict, path: str | Path) -> None:
    """Load an exported DFlash draft into `draft` (every tensor, same shapes). The block size may
    differ (no weight depends on it); the target layers must be the same, in the same order, since
    fc's input columns follow them."""
    from ..loader import hf

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"init_from={str(path)!r}: no config.json there (an exported DFlash draft directory).")
    theirs = hf.hf_config(path).get("dflash_config", {}).get("target_layer_ids")
    ours = cfg_dict["dflash_config"]["target_layer_ids"]
    if theirs is None or list(theirs) != list(ours):
        raise ValueError(f"init_from={str(path)!r}: its target_layer_ids {theirs} differ from this run's {ours}; "
                         f"train with the same target layers or start from random weights.")
    draft.load_weights(hf.iter_safetensors(hf.safetensors_files(path)), str(path))
    log.info("warm start from %s", path)


def save_dflash(draft: DFlashDraftModel, cfg_dict: dict, out: Path, metadata: dict[str, str],
                dtype: torch.dtype = torch.bfloat16) -> None:
    """z-lab format: config.json + model.safetensors, gate/up split back into the checkpoint's names."""
    from safetensors.torch import save_file

    tensors = {}
    for name, p in draft.named_parameters():
        t = p.detach().to("cpu", dtype)
        if ".gate_up_proj." in name:
            gate, up = t.chunk(2)
            tensors[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            tensors[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            tensors[name] = t.contiguous()
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", **metadata})


def choose_mask_token(tokenizer, vocab_size: int) -> int:
    """A token the chat template never produces: a code-dataset special token if the tokenizer has
    one (SmolLM2: <empty_output>), else the last id of the vocabulary."""
    for name in ("<empty_output>", "<jupyter_script>", "<|mask|>"):
        ids = tokenizer.encode(name) if tokenizer is not None else []
        if len(ids) == 1 and 0 <= ids[0] < vocab_size:
            return ids[0]
    return vocab_size - 1


def run_training(target: str | None, out: str | Path, device: str = "auto", num_prompts: int = 4096,
                 max_new_tokens: int = 256, gen_temperature: float = 0.0, gen_batch: int = 512,
                 max_len: int = 512, cfg: DFlashTrainConfig | None = None, time_budget_s: float | None = None,
                 seed: int = 0, gen_time_budget_s: float | None = None, synth_prompts: int = 0,
                 init_from: str | Path | None = None, synth_opener_share: float = 0.0) -> Path:
    """The whole job behind `tercel train-draft --algorithm dflash`: data (generated once, kept in
    out/data.pt), then training (resumable from out/trainer_state.pt)."""
    from ..llm import LLM
    from .data import LIGHT_KV_BYTES, load_samples, make_dataset, save_samples

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_path = out / "data.pt"
    # with the dataset already on disk the target only computes features: no KV pool, no graphs
    light = dict(kv_cache_memory=LIGHT_KV_BYTES, disable_cuda_graph=True) if data_path.is_file() else {}
    llm = LLM(target, device=device, max_model_len=max_len + max_new_tokens, max_num_seqs=gen_batch, seed=seed,
              **light)
    model, dev = llm.engine.model, llm.engine.device
    if data_path.is_file():
        samples = load_samples(data_path)
    else:
        samples = make_dataset(llm, num_prompts, synth_prompts, max_new_tokens, gen_temperature, seed,
                               wave=4 * gen_batch, time_budget_s=gen_time_budget_s, opener_share=synth_opener_share)
        save_samples(samples, data_path)
    samples = [Sample(s.prompt, s.response[:max(0, max_len - len(s.prompt))])
               for s in samples if len(s.prompt) < max_len]
    cfg = cfg or DFlashTrainConfig()
    if cfg.mask_token_id is None:
        cfg.mask_token_id = choose_mask_token(llm.tokenizer, model.config.vocab_size)
    autocast = torch.bfloat16 if dev.type == "cuda" else None
    return train_dflash(model, samples, out, cfg, dev, autocast_dtype=autocast, time_budget_s=time_budget_s,
                        cache_features=dev.type == "cpu", init_from=init_from)
