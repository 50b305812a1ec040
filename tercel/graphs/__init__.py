"""CUDA-graph runner (runner.py), static buffers with padding policies and grouped replay copies
(buffers.py), breakable graphs (breakable.py), and the model step kinds (steps.py). Importable
without CUDA: nothing here touches the GPU until a runner captures."""
from .buffers import BufferSpec, Pad, Per, StaticBuffers, grouped_copy_, plan_copies, run_copies
from .runner import CudaGraphRunner, GraphConfig, StepKind, default_batch_sizes

__all__ = ["BufferSpec", "Pad", "Per", "StaticBuffers", "grouped_copy_", "plan_copies", "run_copies",
           "CudaGraphRunner", "GraphConfig", "StepKind", "default_batch_sizes"]
