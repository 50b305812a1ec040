"""Tensor parallelism on torch.distributed (NCCL on GPU, gloo on CPU): docs/parallel.md.

parallel_state: the group of ranks (collectives, passed explicitly, no module globals) · shard: how a
model splits across ranks and the checks that run before loading · layers: the vocab-parallel embedding
and head · comm: the forward-batch broadcast (rank 0 -> followers) · loader: each rank's shard of the
weights · launch: starting the ranks (spawned by Tercel, or torchrun) · follower: the loop of ranks > 0.
"""
