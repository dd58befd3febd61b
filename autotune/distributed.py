"""The few collectives autotune needs under ``torch.distributed`` (DDP, torchrun).

Everything here is a no-op in a single process. Collectives go through the CPU with gloo and through
the device with NCCL.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["all_reduce_gradients", "gather", "is_distributed", "max_over_ranks", "sum_over_ranks", "unwrap", "world"]


def is_distributed() -> bool:
    """Whether a process group with more than one rank is initialised."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """(rank, world_size) of an initialised process group, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _where(device: torch.device | None) -> torch.device:
    if torch.distributed.get_backend() == "nccl":
        return device if device is not None and device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: list[float], device: torch.device | None = None) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (float64)."""
    if not is_distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_where(device))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t.tolist()


def max_over_ranks(value: int, device: torch.device | None = None) -> int:
    """The largest ``value`` over all ranks (e.g. a status code: 0 fine, 1 out of memory, 2 failed)."""
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_where(device))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def gather(obj: Any, device: torch.device | None = None) -> list[Any]:
    """``obj`` from every rank, in rank order (``[obj]`` in a single process).

    With NCCL the objects travel through ``device`` (the rank's training device): without it,
    ``all_gather_object`` uses the current CUDA device, which is GPU 0 on every rank that never
    called ``torch.cuda.set_device``.
    """
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * torch.distributed.get_world_size()
    if torch.distributed.get_backend() == "nccl" and device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.distributed.all_gather_object(out, obj)
    else:
        torch.distributed.all_gather_object(out, obj)
    return out


def all_reduce_gradients(ddp: nn.Module) -> None:
    """Average the accumulated ``.grad`` of a DDP model over its ranks, in one collective.

    This is what DDP's own synchronised backward does (sum, then divide by the world size), done
    once per window after every rank has finished its micro-batches. Parameters without a gradient
    on some rank take part with zeros, as DDP's buckets would.
    """
    params = [p for p in ddp.parameters() if p.requires_grad]
    if not params:
        return
    group = getattr(ddp, "process_group", None)
    size = torch.distributed.get_world_size(group)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat, group=group)
    flat.div_(size)
    for p, synced in zip(params, torch._utils._unflatten_dense_tensors(flat, grads)):
        if p.grad is None:
            p.grad = synced.clone()
        else:
            p.grad.copy_(synced)


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(inner module, DDP wrapper or None)``; FSDP is refused.

    Raises:
        NotImplementedError: the model is sharded with FSDP (``fully_shard`` or
            ``FullyShardedDataParallel``), which autotune does not support yet.
    """
    from torch.nn.parallel import DistributedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

        fsdp: tuple[type, ...] = (FSDPModule, FullyShardedDataParallel)
    except ImportError:  # pragma: no cover - older torch
        fsdp = ()
    if fsdp and any(isinstance(m, fsdp) for m in model.modules()):
        raise NotImplementedError(
            "FSDP-sharded models are not supported yet: autotune's probe and accumulation assume every "
            "rank holds the whole model (DDP). Plan with the unsharded model on one GPU, or use DDP"
        )
    if isinstance(model, DistributedDataParallel):
        return model.module, model
    return model, None


def check_distinct_samples(batch: Any) -> None:
    """Warn when every rank got the same first batch (a loader without a DistributedSampler)."""
    if not is_distributed():
        return
    from . import batches as B
    from .errors import AutotuneWarning

    fingerprint = tuple((tuple(t.shape), float(t.detach().double().sum().item())) for t in B.tensors(batch)[:4])
    prints = gather(fingerprint)
    if all(p == prints[0] for p in prints):
        warnings.warn(
            "Every rank got the same first batch: each rank should see its own shard of the data; use "
            "torch.utils.data.DistributedSampler (DataLoader(dataset, sampler=DistributedSampler(dataset)))",
            AutotuneWarning,
            stacklevel=3,
        )
