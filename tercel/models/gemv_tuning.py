"""Apply the batch-1 GEMV and small-M GEMM tuning of tercel.kernels.gemv_tune to a model's layers.

The kernels layer measures weights (tune_shape, tune_role) and knows no model; this module walks a
Llama-family model, groups its Linear layers by shape and fused role, has each group measured and sets
the chosen configs on the layers. The engine calls tune_model once at start on the GPU.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict

import torch

from ..dev_overrides import env
from ..kernels import small_m_buckets, small_m_mode
from ..kernels.gemv import GemvConfig
from ..kernels.gemv_tune import GemvChoice, small_m_candidates, tune_role, tune_shape
from .linear import Linear
from .llama import MLP, Attention, LlamaForCausalLM

log = logging.getLogger(__name__)


def _role_slots(model: torch.nn.Module, gpu_only: bool = True) -> dict[str, list]:
    """Per fused role: (module, attribute, weight, the weight's plain choice) of every layer (gpu_only: of the
    CUDA weights, the ones a tuner can measure)."""
    # (module, attribute, weight, the weight's plain choice)
    slots: dict[str, list] = {"qkv": [], "o": [], "gate_up": [], "down": [], "lm_head": []}
    for m in model.modules():
        # the fused kernels add no bias: biased layers keep their unfused ops
        if (isinstance(m, Attention) and m.qkv_proj.bias is None and m.o_proj.bias is None
                and (m.qkv_proj.weight.is_cuda or not gpu_only)):
            slots["qkv"].append((m, "qkv_fused", m.qkv_proj.weight, m.qkv_proj.gemv))
            slots["o"].append((m, "o_fused", m.o_proj.weight, m.o_proj.gemv))
        elif isinstance(m, MLP) and (m.gate_up_proj.weight.is_cuda or not gpu_only) and m.gate_up_proj.bias is None:
            slots["gate_up"].append((m, "gate_up_fused", m.gate_up_proj.weight, m.gate_up_proj.gemv))
            slots["down"].append((m, "down_fused", m.down_proj.weight, m.down_proj.gemv))
        elif isinstance(m, LlamaForCausalLM) and (m.lm_head_weight.is_cuda or not gpu_only):
            slots["lm_head"].append((m, "lm_head_fused", m.lm_head_weight, m.lm_head_config))
    return slots


def _tune_fused(model: torch.nn.Module, roles: tuple[str, ...] | None = None) -> list[GemvChoice]:
    """Measure and set the fused decode roles of a Llama-family model (nothing for other models); roles: only
    these."""
    slots = _role_slots(model)
    measured = []
    for role, items in slots.items():
        if roles is not None and role not in roles:
            continue
        by_shape: dict[tuple[tuple[int, int], GemvConfig | None], list] = defaultdict(list)
        for item in items:
            by_shape[(tuple(item[2].shape), item[3])].append(item)
        for (_, plain), group in by_shape.items():
            measured.append((group, tune_role(role, [w for _, _, w, _ in group], plain)))
    for group, choice in measured:  # all measured first, as in tune_model
        for mod, attr, _, _ in group:
            setattr(mod, attr, choice.config)
    return [c for _, c in measured]


def _tune_small_m(model: torch.nn.Module) -> list[GemvChoice]:
    """Measure and set the small-M roles of a Llama-family model, per row bucket ({attribute}_rows)."""
    measured = []
    for role, items in _role_slots(model).items():
        by_shape: dict[tuple[int, int], list] = defaultdict(list)
        for item in items:
            by_shape[tuple(item[2].shape)].append(item)
        for group in by_shape.values():
            weights = [w for _, _, w, _ in group]
            for rows in small_m_buckets():
                choice = tune_role(role, weights, None, small_m_candidates(rows, weights[0].shape[1]), rows=rows)
                measured.append((group, choice))
    for group, choice in measured:  # all measured first: a failure part-way sets nothing
        for mod, attr, _, _ in group:
            table = getattr(mod, attr + "_rows")
            if choice.config is None:
                table.pop(choice.rows, None)
            else:
                table[choice.rows] = choice.config
    return [c for _, c in measured]


def rowgrid_rows(model: torch.nn.Module) -> None:
    """TERCEL_SMALL_M=rowgrid: every row bucket of each role runs that role's batch-1 fused choice once per row
    (no tuning pass). Roles the batch-1 tuner left unfused stay so, and so does the head: its weight, re-read per
    row, costs more than cuBLAS's one pass over all the rows."""
    for role, items in _role_slots(model, gpu_only=False).items():
        for mod, attr, _, _ in items if role != "lm_head" else ():
            single, table = getattr(mod, attr), getattr(mod, attr + "_rows")
            for rows in small_m_buckets():
                if single is None:
                    table.pop(rows, None)
                else:
                    table[rows] = dataclasses.replace(single, rowgrid=True)


HALF = (torch.bfloat16, torch.float16)


def _measure_linears(model: torch.nn.Module, skip: object = None,
                     half_only: bool = False) -> list[tuple[list[Linear], GemvChoice]]:
    """Every bias-free CUDA Linear of `model` (but `skip`; with half_only bf16 / fp16 ones only) grouped by shape
    and dtype, each group measured once. Measured before anything is set: a failure part-way leaves every layer
    on cuBLAS."""
    groups: dict[tuple, list[Linear]] = defaultdict(list)
    for m in model.modules():
        if (isinstance(m, Linear) and m.bias is None and m.weight.is_cuda and m is not skip
                and (m.weight.dtype in HALF or not half_only)):
            groups[(tuple(m.weight.shape), m.weight.dtype)].append(m)
    return [(mods, tune_shape([m.weight for m in mods])) for mods in groups.values()]


def _set_linears(measured: list[tuple[list[Linear], GemvChoice]]) -> None:
    for mods, choice in measured:
        for m in mods:
            m.gemv = choice.config


@torch.inference_mode()
def tune_draft(model: torch.nn.Module) -> list[GemvChoice]:
    """A draft model's one-row linears (an EAGLE chain's draft steps at batch 1): each bias-free bf16 / fp16
    Linear shape gets the Triton GEMV where it measures faster than cuBLAS; with TERCEL_DRAFT_FUSED_MLP=1 its MLP
    also the fused GEMVs (norm, SwiGLU and the residual add folded) where they measure faster. Its head, when it
    is the target's, was tuned with the target."""
    measured = _measure_linears(model, half_only=True)  # a wider (fp32) draft keeps cuBLAS
    _set_linears(measured)
    choices = [c for _, c in measured]
    if env("TERCEL_DRAFT_FUSED_MLP") == "1" and any(c.config is not None for c in choices):  # as the target's
        try:  # (the attention's input is two norms side by side: no fused role)
            choices += _tune_fused(model, roles=("gate_up", "down"))
        except Exception as e:  # never fatal: the draft's MLP stays unfused
            log.warning("fused draft MLP tuning failed (%s); the draft MLP stays unfused", e)
        if small_m_mode() == "rowgrid":  # its several-row forwards (draft_extend) as the target's verify
            rowgrid_rows(model)
    return _log_choices(choices, "draft ")


@torch.inference_mode()
def tune_model(model: torch.nn.Module) -> list[GemvChoice]:
    """Measure every bias-free Linear shape of `model` (and its tied lm_head) and set each layer's
    `gemv` config. Returns the measurements (also logged)."""
    head = getattr(model, "lm_head", 0)  # a Linear, None when tied to the embedding, 0: no such model
    measured = _measure_linears(model, skip=head)
    # the head on its own, as it runs: its logits are fp32 (LlamaForCausalLM.compute_logits)
    has_head = head != 0 and (head is None or head.bias is None) and model.lm_head_weight.is_cuda
    head_choice = tune_shape([model.lm_head_weight], out_dtype=torch.float32) if has_head else None
    _set_linears(measured)
    if head_choice is not None:
        if head is None:
            model.lm_head_gemv = head_choice.config
        else:
            head.gemv = head_choice.config
    choices = [c for _, c in measured] + ([head_choice] if head_choice is not None else [])
    try:  # the fused roles after the plain choices, which they compare against
        choices += _tune_fused(model)
    except Exception as e:  # never fatal: the unfused decode stays
        log.warning("fused batch-1 GEMV tuning failed (%s); decode stays unfused", e)
    mode = small_m_mode()
    if mode == "rowgrid":
        rowgrid_rows(model)
    if mode != "1":  # opt-in: on the H200 the tuned configs made whole verify steps slower
        return _log_choices(choices)
    start = time.perf_counter()
    try:
        choices += _tune_small_m(model)
    except Exception as e:  # never fatal: forwards of several rows stay unfused
        log.warning("small-M GEMM tuning failed (%s); verify and small batches stay unfused", e)
    log.info("small-M GEMM tuning took %.1f s", time.perf_counter() - start)
    return _log_choices(choices)


def _log_choices(choices: list[GemvChoice], what: str = "") -> list[GemvChoice]:
    for c in choices:
        log.info("%slinear %s %s x%d layers, %d row(s): unfused %.1f us, GEMV %s us -> %s", what, c.role, c.shape,
                 c.layers, c.rows, c.cublas_us, c.gemv_us, c.config or "unfused")
    return choices
