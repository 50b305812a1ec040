"""EAGLE-3 draft training by self-distillation, with the training-time test (TTT).

Data: the target answers offline prompts (tercel.train.data); the draft learns the target's own
next-token distributions (soft labels over the draft vocabulary) on the response tokens.
Draft vocabulary: the draft_vocab_size most frequent response tokens (d2t / t2d in the export), or
with draft_vocab_size=0 the full vocabulary through the target's own lm_head, frozen and left out of
the export (SGLang's load_lm_head_from_target): every token can be drafted and the draft stays small.
init_from warm-starts from an exported draft: overlapping slices of every tensor are copied, and a
wider MLP's extra units start with zero down_proj columns, so the warm start computes what it did.

TTT unrolls `ttt_steps` draft steps as in decoding. Row i at step 0 pairs token x[i+1] with the
target's hidden state at i (through fc) and predicts x[i+2]. At step j the same row takes token
x[i+1+j] and the draft's OWN hidden state from step j-1 (what it will see when drafting), at RoPE
position i + j, and predicts x[i+2+j]. Its attention sees the step-0 keys of rows <= i (the paged
context at inference) and its own keys of steps 1..j at row i (the draft tokens of the chain): the
same pattern as the engine's draft loop. Losses are weighted 0.8^j.

Resumable: the dataset (data.pt) and a checkpoint (checkpoint.pt: weights, optimizer, step, elapsed
time; loaded with weights_only) live in the output directory; a rerun continues from them. The
result is written in the SpecForge / SGLang format (config.json + model.safetensors).
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

from ..models.eagle3 import EagleDraftConfig, EagleDraftModel, default_eagle3_layer_ids
from ..models.rope import apply_rope
from .data import LIGHT_KV_BYTES, Sample, load_samples, make_dataset, pack_batch, save_samples, target_features
from .export import eagle3_config_dict, eagle3_tensors, save_eagle3

log = logging.getLogger(__name__)


@dataclass
class Eagle3TrainConfig:
    out: str
    target: str | None = None  # HF dir / GGUF; None: the default model
    device: str = "auto"
    num_prompts: int = 4096
    synth_prompts: int = 4096  # user prompts the target writes itself (data.synth_user_prompts)
    synth_opener_share: float = 0.0  # share of them started with a question / task opener (data.QUESTION_OPENERS)
    max_new_tokens: int = 256
    gen_temperature: float = 0.0
    gen_max_num_seqs: int = 512
    gen_time_budget_s: float | None = None  # stop starting generation waves after this many seconds
    max_len: int = 512  # prompt + response tokens per training sequence
    draft_vocab_size: int = 4096  # 0: the full vocabulary through the target's frozen lm_head
    intermediate_size: int | None = None  # draft MLP width (default: the target's)
    aux_layer_ids: tuple[int, ...] | None = None  # default: SGLang's low / mid / high
    ttt_steps: int = 6
    # share of the loss on the target's top-1 token (the rest: its full distribution). Greedy
    # acceptance asks for the draft's argmax to equal the target's; soft labels ask for the
    # distribution, which sampling acceptance rewards.
    hard_label_weight: float = 0.0
    # recompute each TTT step's head logits in backward: about half the memory of a full-vocabulary
    # run (73 -> 35 GiB at batch 64 x 640 on the H200) for ~19% more time per step
    checkpoint_logits: bool = False
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 50
    max_steps: int = 2000
    time_budget_s: float | None = None  # stop training after this many seconds (the lr schedule follows)
    save_every: int = 200
    seed: int = 0
    export_dtype: str = "bfloat16"
    init_from: str | None = None  # an exported EAGLE-3 draft directory to warm-start from
    extra: dict = field(default_factory=dict)


def choose_draft_vocab(samples: list[Sample], size: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), as sorted target ids."""
    counts = Counter(t for s in samples for t in s.response)
    ids = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common())]))[:size]
    if len(ids) < size:  # pad with the lowest unused ids so the vocabulary has exactly `size` entries
        used = set(ids)
        ids += [t for t in range(vocab_size) if t not in used][:size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.long)


@torch.no_grad()
def warm_start(model: EagleDraftModel, path: str | Path) -> tuple[int, ...] | None:
    """Copy an exported EAGLE-3 draft's tensors into `model` (overlapping slices where shapes differ).
    A wider MLP keeps the old units and zeroes down_proj's new columns, so it starts as the old draft;
    a head of another vocabulary is not copied (d2t / t2d are the new model's). Returns the source's
    aux layer ids (None when its config names none)."""
    from ..loader import hf

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"init_from={str(path)!r}: no *.safetensors there "
                                "(an exported EAGLE-3 draft directory).")
    src = {k.removeprefix("model."): v for k, v in hf.iter_safetensors(files)}
    for key in ("midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight", "midlayer.mlp.down_proj.weight"):
        if key not in src:
            raise ValueError(f"init_from={str(path)!r}: {key} is missing; not an EAGLE-3 draft.")
    at, mlp = model.midlayer.self_attn, model.midlayer.mlp
    mlp.down_proj.weight[:, src["midlayer.mlp.down_proj.weight"].shape[1]:] = 0
    pieces = {  # fused parameter -> its checkpoint tensors, as views of the parameter
        "midlayer.self_attn.qkv_proj.weight": zip(("q_proj", "k_proj", "v_proj"),
                                                  at.qkv_proj.weight.split([at.q_size, at.kv_size, at.kv_size])),
        "midlayer.mlp.gate_up_proj.weight": zip(("gate_proj", "up_proj"), mlp.gate_up_proj.weight.chunk(2)),
    }
    for name, p in model.named_parameters():
        if name.startswith("lm_head"):
            continue
        sub = name.rsplit(".", 2)[0]  # midlayer.self_attn / midlayer.mlp
        pairs = [(src[f"{sub}.{piece}.weight"], view) for piece, view in pieces[name]] if name in pieces else \
            [(src[name], p)] if name in src else []
        for t, dst in pairs:
            if t.dim() != dst.dim():
                raise ValueError(f"init_from={str(path)!r}: {name} has shape {tuple(t.shape)}, "
                                 f"expected {tuple(dst.shape)}.")
            sl = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, t.shape))
            dst[sl] = t[sl].to(dst)
    log.info("warm start from %s", path)
    cfg_file = Path(path) / "config.json"
    ids = json.loads(cfg_file.read_text()).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") \
        if cfg_file.is_file() else None
    return tuple(int(i) for i in ids) if ids else None


@torch.no_grad()
def rescale_fc(model: EagleDraftModel, old: torch.Tensor, new: torch.Tensor, changed: list[int]) -> None:
    """fc columns of the aux slots in `changed` scaled by old / new RMS per channel (old, new: [n, fc_in]
    features of the warm start's layers and of the new ones), so a warm start moved to other aux layers
    gets inputs of the scale it learned on (residual streams grow by orders of magnitude with depth)."""
    width = model.config.target_hidden_size
    rms_old, rms_new = (x.float().reshape(-1, x.shape[-1]).pow(2).mean(0).sqrt().clamp_min(1e-6) for x in (old, new))
    for slot in changed:
        sl = slice(slot * width, (slot + 1) * width)
        model.fc.weight[:, sl] *= (rms_old[sl] / rms_new[sl]).to(model.fc.weight)
    log.info("fc rescaled for the new aux layers in slots %s", changed)


def _repeat_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


@dataclass(slots=True)
class TTTRows:
    """Which flattened [B * T] rows the training-time test reads, found on the host from the label
    mask, so that the GPU step has no nonzero() (a host sync each) in it."""
    need: torch.Tensor  # rows whose target distribution some step learns from (row r predicts x[r + 1])
    where: torch.Tensor  # [B * T]: a row's index among `need`
    label_rows: list[torch.Tensor]  # per step j: rows i that learn label x[i + 2 + j]

    @classmethod
    def of(cls, label_mask: torch.Tensor, steps: int, device: torch.device) -> "TTTRows":
        m = label_mask.cpu()
        need = F.pad(m[:, 1:], (0, 1)).flatten()
        where = torch.cumsum(need, 0) - 1
        rows = [F.pad(m[:, 2 + j:], (0, 2 + j)).flatten().nonzero().squeeze(1) for j in range(steps)]
        need_rows, where, *rows = (x.to(device, non_blocking=True) for x in [need.nonzero().squeeze(1), where, *rows])
        return cls(need_rows, where, rows)


def _step_loss(model: EagleDraftModel, h_rows: torch.Tensor, target_probs: torch.Tensor, tgt_index: torch.Tensor,
               hard_label_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One TTT step's summed cross-entropy against the target's distributions target_probs[tgt_index]
    (hard_label_weight of it on their argmax), and the number of rows whose argmax matches."""
    logits = model.compute_logits(h_rows)  # [n, Vd] float32
    tgt = target_probs[tgt_index]
    logq = logits.log_softmax(-1)
    ce = -(tgt * logq).sum(-1)
    top1 = tgt.argmax(-1, keepdim=True)
    if hard_label_weight:
        ce = (1.0 - hard_label_weight) * ce - hard_label_weight * logq.gather(-1, top1).squeeze(-1)
    return ce.sum(), (logits.argmax(-1, keepdim=True) == top1).sum().detach()


def ttt_loss(model: EagleDraftModel, embed: torch.Tensor, aux: torch.Tensor, final: torch.Tensor,
             head_rows: torch.Tensor, ids: torch.Tensor, label_mask: torch.Tensor,
             steps: int, hard_label_weight: float = 0.0,
             checkpoint_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """aux: [B, T, fc_in] target aux states; final: [B, T, H] the target's final normed hidden, whose
    logits over head_rows ([Vd, H], the draft vocabulary's rows of the target head) give the target
    distribution predicting token t + 1 at row t; label_mask: [B, T] rows whose token is a trainable
    label (pass it on the host: its rows are found there). Logits are computed only on rows that carry
    a label (with a full-vocabulary draft the dense [B, T, V] tensors would not fit). Returns the
    weighted loss and the per-step top-1 accuracy as a [steps] tensor (read it only when logging: each
    read is a device sync). hard_label_weight: the share of each row's loss on the target's argmax;
    checkpoint_logits: recompute each step's logits in backward instead of keeping them."""
    b, t = ids.shape
    layer, at = model.midlayer, model.midlayer.self_attn
    hq, hkv, d = at.num_heads, at.num_kv_heads, at.head_dim
    scale = d ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    sel = TTTRows.of(label_mask, steps, ids.device)
    # target distributions, once, on the rows some step learns from
    with torch.no_grad():
        target_probs = F.linear(final.flatten(0, 1)[sel.need], head_rows).float().softmax(-1)  # [N, Vd]
    h = model.fc(aux)
    k0 = v0 = None
    diag_k: list[torch.Tensor] = []
    diag_v: list[torch.Tensor] = []
    total = aux.new_zeros((), dtype=torch.float32)
    accs = []
    for j in range(steps):
        inp = F.pad(ids[:, 1 + j:], (0, 1 + j))
        emb = F.embedding(inp, embed).to(h.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(h)], dim=-1)
        qkv = at.qkv_proj(x)
        qk = qkv[..., :at.q_size + at.kv_size].view(b, t, hq + hkv, d)
        v = qkv[..., at.q_size + at.kv_size:].view(b, t, hkv, d).transpose(1, 2)
        cos, sin = model.rope.cos[j:j + t][:, None, :], model.rope.sin[j:j + t][:, None, :]
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, :, :hq].transpose(1, 2), qk[:, :, hq:].transpose(1, 2)  # [B, H, T, D]
        if j == 0:
            k0, v0 = _repeat_kv(k, hq // hkv), _repeat_kv(v, hq // hkv)
            o = F.scaled_dot_product_attention(q, k0, v0, is_causal=True)
        else:
            diag_k.append(_repeat_kv(k, hq // hkv))
            diag_v.append(_repeat_kv(v, hq // hkv))
            s0 = (q @ k0.transpose(-1, -2)) * scale
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = torch.stack([(q * kk).sum(-1) for kk in diag_k], dim=-1) * scale  # [B, H, T, j]
            w = torch.cat([s0, sd], dim=-1).float().softmax(-1).to(q.dtype)
            o = w[..., :t] @ v0 + (w[..., t:, None] * torch.stack(diag_v, dim=-2)).sum(-2)
        h = h + at.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        # row i learns label x[i + 2 + j] from the target's distribution at row i + 1 + j
        rows = sel.label_rows[j]
        args = (model, h.flatten(0, 1)[rows], target_probs, sel.where[rows + 1 + j], hard_label_weight)
        # checkpointed: the [n, Vd] logits and labels are recomputed in backward, not kept (6 steps of
        # them over a full vocabulary take tens of GB)
        ce, hits = checkpoint(_step_loss, *args, use_reentrant=False) if checkpoint_logits and torch.is_grad_enabled() \
            else _step_loss(*args)
        n = max(1, rows.numel())
        total = total + (0.8 ** j) * ce / n
        accs.append(hits / n)
    return total, torch.stack(accs)


class Eagle3Trainer:
    def __init__(self, cfg: Eagle3TrainConfig, llm=None) -> None:
        """llm: an already loaded target (tercel.LLM) to use instead of loading cfg.target."""
        if not 0.0 <= cfg.hard_label_weight <= 1.0:
            raise ValueError(f"hard_label_weight={cfg.hard_label_weight} is outside [0, 1]: it is the share of the "
                             "loss on the target's top-1 token (0: soft labels only, 1: top-1 only).")
        self.cfg = cfg
        self.llm = llm
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)

    def _load_target(self):
        from ..llm import LLM

        cfg = self.cfg
        # with the dataset already on disk the target only computes features: no KV pool, no graphs
        have_data = (self.out / "data.pt").is_file()
        light = dict(kv_cache_memory=LIGHT_KV_BYTES, disable_cuda_graph=True) if have_data else {}
        return LLM(cfg.target, device=cfg.device, max_model_len=max(cfg.max_len + cfg.ttt_steps + 8, 1024),
                   max_num_seqs=cfg.gen_max_num_seqs, max_num_batched_tokens=max(8192, cfg.gen_max_num_seqs * 4),
                   progress=False, **light)

    def dataset(self, llm) -> list[Sample]:
        path = self.out / "data.pt"
        if path.is_file():
            return load_samples(path)
        cfg = self.cfg
        t0 = time.perf_counter()
        samples = make_dataset(llm, cfg.num_prompts, cfg.synth_prompts, cfg.max_new_tokens, cfg.gen_temperature,
                               cfg.seed, wave=4 * cfg.gen_max_num_seqs, time_budget_s=cfg.gen_time_budget_s,
                               opener_share=cfg.synth_opener_share)
        save_samples(samples, path)
        n_tok = sum(len(s.response) for s in samples)
        log.info("generated %d responses (%d tokens) in %.0f s", len(samples), n_tok, time.perf_counter() - t0)
        return samples

    def build_draft(self, llm, draft_ids: torch.Tensor) -> EagleDraftModel:
        cfg, target = self.cfg, llm.engine.model
        tcfg = llm.engine.model_config
        ids = cfg.aux_layer_ids or default_eagle3_layer_ids(tcfg.num_layers)
        head_from_target = cfg.draft_vocab_size == 0
        self.config_dict = eagle3_config_dict(tcfg, draft_vocab_size=None if head_from_target else len(draft_ids),
                                              aux_layer_ids=tuple(ids), intermediate_size=cfg.intermediate_size)
        dcfg = EagleDraftConfig.from_dict(self.config_dict, tcfg, "train")
        g = torch.Generator().manual_seed(cfg.seed)
        model = EagleDraftModel(dcfg, cfg.max_len + cfg.ttt_steps + 8, torch.float32, has_embed=False,
                                has_head=not head_from_target)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
            if model.lm_head is not None:  # the head starts as the target's head restricted to the draft vocabulary
                model.lm_head.weight.copy_(target.lm_head_weight[draft_ids.to(target.lm_head_weight.device)].float().cpu())
            model.norm.weight.copy_(target.norm.weight.float().cpu())
            self.init_aux = warm_start(model, cfg.init_from) if cfg.init_from else None
        model.draft_to_target = draft_ids.clone()
        model = model.to(llm.engine.device)
        model.share_target(target.embed_tokens.weight, target.lm_head_weight)
        return model

    @torch.no_grad()
    def init_fc(self, model: EagleDraftModel, aux: torch.Tensor) -> None:
        """Random fc whose columns are divided by each aux channel's RMS on a first batch: small-model
        residual streams carry massive activations (SmolLM2: one channel ~10^2-10^4 in the mid and
        high layers) that would otherwise dominate every output of fc. (An earlier recipe passed the
        high layer straight through fc; its head plateaued at a mean accept length of ~1.3.)"""
        rms = aux.float().reshape(-1, aux.shape[-1]).pow(2).mean(0).sqrt()
        scale = rms.median() / rms.clamp_min(1e-6)
        g = torch.Generator().manual_seed(self.cfg.seed + 1)
        w = torch.randn(model.fc.weight.shape, generator=g) * model.fc.in_features ** -0.5
        model.fc.weight.copy_((w * scale.cpu()[None, :]).to(model.fc.weight))

    def train(self) -> Path:
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        llm = self.llm or self._load_target()
        eng = llm.engine
        dev = eng.device
        samples = [s for s in self.dataset(llm) if len(s.response) > 2]
        if not samples:
            raise ValueError("no usable training samples were generated.")
        tcfg = eng.model_config
        if not 0 <= cfg.draft_vocab_size <= tcfg.vocab_size:
            from ..config import ConfigError

            raise ConfigError(f"draft_vocab_size={cfg.draft_vocab_size} must be in 0..{tcfg.vocab_size} (0: the "
                              f"full vocabulary through the target's lm_head).")
        if cfg.draft_vocab_size == 0:
            draft_ids = torch.arange(tcfg.vocab_size)
        else:
            draft_ids = choose_draft_vocab(samples, cfg.draft_vocab_size, tcfg.vocab_size, tuple(eng.eos_token_ids))
        model = self.build_draft(llm, draft_ids)
        target = eng.model
        embed = target.embed_tokens.weight
        head_rows = target.lm_head_weight[draft_ids.to(dev)]
        in_vocab_host = torch.zeros(tcfg.vocab_size, dtype=torch.bool)
        in_vocab_host[draft_ids] = True
        layer_ids = tuple(sorted(model.config.aux_layer_ids))
        init_ids = tuple(sorted(self.init_aux or ()))  # the warm start's aux layers
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
        ckpt_path = self.out / "checkpoint.pt"
        step, elapsed = 0, 0.0
        if ckpt_path.is_file():
            ck = torch.load(str(ckpt_path), weights_only=True, map_location=dev)
            if torch.equal(ck["draft_ids"].cpu(), draft_ids):
                model.load_state_dict(ck["model"], strict=False)
                opt.load_state_dict(ck["opt"])
                step, elapsed = int(ck["step"]), float(ck["elapsed"])
                log.info("resumed from %s at step %d", ckpt_path, step)
        # one gather over all response tokens on the host, not a device sync per sample (96 k samples)
        tokens = torch.tensor([t for s in samples for t in s.response], dtype=torch.long)
        coverage = float(in_vocab_host[tokens].float().mean()) if tokens.numel() else 0.0
        amp = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
               else torch.autocast("cpu", enabled=False))
        rng = random.Random(cfg.seed + step)
        # length-sorted buckets keep padding low
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt) + len(samples[i].response))
        batches = [order[i:i + cfg.batch_size] for i in range(0, len(order), cfg.batch_size)]
        bar = tqdm(total=cfg.max_steps, initial=step, desc="train eagle3", unit="step")
        start = time.perf_counter() - elapsed
        history = []
        while step < cfg.max_steps:
            elapsed = time.perf_counter() - start
            if cfg.time_budget_s is not None and elapsed >= cfg.time_budget_s:
                break
            progress = max(step / cfg.max_steps, elapsed / cfg.time_budget_s if cfg.time_budget_s else 0.0)
            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
            for g in opt.param_groups:
                g["lr"] = lr
            batch = [samples[i] for i in rng.choice(batches)]
            ids, valid, resp = pack_batch(batch, cfg.max_len)
            label_mask = resp & valid & in_vocab_host[ids]  # on the host: ttt_loss finds its rows there
            ids = ids.to(dev, non_blocking=True)
            with torch.no_grad(), amp:
                aux, final = target_features(target, ids, layer_ids)
            if step == 0 and not cfg.init_from:
                self.init_fc(model, aux[valid.to(dev)])
            elif step == 0 and len(init_ids) == len(layer_ids) and init_ids != layer_ids:  # warm start, other layers
                with torch.no_grad(), amp:
                    old, _ = target_features(target, ids, init_ids)
                rescale_fc(model, old[valid.to(dev)], aux[valid.to(dev)],
                           [i for i, (a, b) in enumerate(zip(init_ids, layer_ids)) if a != b])
            with amp:
                loss, accs = ttt_loss(model, embed, aux.float() if dev.type != "cuda" else aux, final, head_rows,
                                      ids, label_mask, cfg.ttt_steps, cfg.hard_label_weight,
                                      cfg.checkpoint_logits)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            bar.update(1)
            if step % 10 == 0:  # reading loss / accs waits for the GPU: not every step
                acc_list = accs.tolist()
                bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{acc_list[0]:.2f}", accN=f"{acc_list[-1]:.2f}",
                                lr=f"{lr:.1e}")
            if step % 50 == 0:
                history.append({"step": step, "loss": round(loss.item(), 4), "acc": [round(a, 3) for a in acc_list],
                                "elapsed_s": round(time.perf_counter() - start, 1)})
            if step % cfg.save_every == 0:
                self._checkpoint(ckpt_path, model, opt, step, time.perf_counter() - start, draft_ids)
                self.export(model, draft_ids, tcfg.vocab_size, step, history, coverage, len(samples))
        bar.close()
        self._checkpoint(ckpt_path, model, opt, step, time.perf_counter() - start, draft_ids)
        return self.export(model, draft_ids, tcfg.vocab_size, step, history, coverage, len(samples))

    def _checkpoint(self, path: Path, model, opt, step: int, elapsed: float, draft_ids: torch.Tensor) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "draft_ids": draft_ids}, str(tmp))
        tmp.replace(path)

    def export(self, model, draft_ids, vocab_size, step, history, coverage, num_samples) -> Path:
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.cfg.export_dtype]
        meta = {"trained_by": "tercel train-draft", "steps": str(step), "draft_vocab_coverage": f"{coverage:.4f}",
                "num_samples": str(num_samples)}
        vocab_map = None if model.head_from_target else draft_ids
        save_eagle3(self.out, self.config_dict, eagle3_tensors(model, vocab_map, vocab_size, dtype), meta)
        (self.out / "train_log.json").write_text(json.dumps(
            {"config": {k: v for k, v in asdict(self.cfg).items()}, "steps": step, "coverage": coverage,
             "num_samples": num_samples, "history": history}, indent=1, default=str))
        return self.out
