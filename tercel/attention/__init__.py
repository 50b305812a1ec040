from .torch_ref import TorchAttentionBackend

__all__ = ["TorchAttentionBackend"]
