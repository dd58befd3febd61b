"""A causal language model's loss without its logits: fused linear cross-entropy, as Liger's kernel computes it.

At vocabularies of 128k-152k tokens the logits of a step (tokens x vocabulary, and their fp32 upcast for
the loss) are most of its activations. Liger Kernel's fused linear cross-entropy (``use_liger_kernel=True`` in
the Transformers Trainer) never holds them: in the forward pass it computes the loss and the gradients of the
hidden states and of the head's weight chunk by chunk, and keeps only those gradients for the backward.
:class:`FusedLinearCrossEntropy` does the same with torch operations, allocating what the kernel allocates
(Liger Kernel 0.8, ``ops/fused_linear_cross_entropy.py``):

- the gradient of the hidden states (tokens x hidden, their dtype), of the head's weight (its shape and dtype)
  and the per-token loss (fp32), allocated before the chunks and kept for the backward;
- per chunk of ``c = min(next_power_of_2(ceil(tokens / ceil(vocab / hidden))), tokens)`` tokens: the chunk's
  logits (c x vocabulary, the hidden states' dtype), turned into their gradient in place, then the chunk's
  part of both gradients (accumulated in place into the head's, as Liger does on CUDA);
- the backward multiplies the kept gradients by the incoming one, in place.

Its numbers are cross-entropy's (the tests compare loss and gradients with ``F.cross_entropy`` on the logits
in float64), so :func:`fused_causal_lm_loss` also trains a model on the CPU; what it is for is the estimate of
a step that runs Liger's kernel on a GPU, with liger-kernel installed or not.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["FusedLinearCrossEntropy", "fused_causal_lm_loss"]

SETTING = "fused linear cross-entropy (Liger's kernel: the loss and its gradients in chunks of tokens, no logits kept)"


def chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk, as Liger's kernel chooses them: about ``hidden`` logits' worth of the vocabulary."""
    factor = math.ceil(vocab / hidden)
    return min(1 << max(0, math.ceil(tokens / factor) - 1).bit_length(), tokens)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets`` (``ignore_index`` skipped), without the
    logits (see the module docstring). ``hidden``: tokens x hidden; ``weight``: vocabulary x hidden."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        _check_shapes(hidden, weight, targets)
        tokens, size = hidden.shape
        vocab = weight.shape[0]
        chunk = chunk_tokens(tokens, vocab, size)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        losses = torch.zeros(tokens, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        kept = targets != ignore_index
        count = max(int(kept.sum()), 1)
        starts = list(range(0, tokens, chunk))
        if _is_fake(hidden):  # every chunk allocates and frees what the first does: the first and the (shorter) last suffice
            starts = sorted({starts[0], starts[-1]})
        for start in starts:
            end = min(start + chunk, tokens)
            logits = hidden[start:end] @ weight.t()  # chunk x vocabulary: the only logits ever held
            target = targets[start:end]
            mask = kept[start:end]
            # The loss and the logits' gradient, in place: softmax - one-hot, over the kept tokens' count.
            top = logits.to(torch.promote_types(logits.dtype, torch.float32)).logsumexp(dim=-1)
            safe = target.clamp(min=0)
            losses[start:end] = (top - logits.gather(1, safe[:, None]).squeeze(1).to(top.dtype)) * mask
            logits.sub_(top[:, None].to(logits.dtype)).exp_()
            logits.scatter_add_(1, safe[:, None], -torch.ones_like(logits[:, :1]))
            logits.mul_((mask.to(logits.dtype) / count)[:, None])
            grad_hidden[start:end] = logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(logits.t(), hidden[start:end])
            del logits
        ctx.save_for_backward(grad_hidden, grad_weight)
        return losses.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place, as Liger multiplies when the incoming gradient is not 1 (it reads the value; the memory is the same)
        grad_hidden.mul_(grad.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad.to(grad_weight.dtype))
        return grad_hidden, grad_weight, None, None


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def fused_causal_lm_loss(model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """A Hugging Face causal LM's loss on ``batch`` (``input_ids``, ``labels``, and the rest passed on) with the
    head and the loss fused (:class:`FusedLinearCrossEntropy`): the decoder's hidden states, the labels shifted
    by one as the model's own loss shifts them, no logits. Pass it as ``loss_fn`` to plan or train as a Trainer
    with ``use_liger_kernel=True`` does.

    Raises:
        TypeError: ``batch`` has no ``labels``, or the model has no decoder and output head to fuse.
        ValueError: labels that are not one token id per token of ``input_ids`` (checked before the model runs).
    """
    if not isinstance(batch, Mapping) or "labels" not in batch:
        raise TypeError("fused_causal_lm_loss needs a dict batch with 'labels' (and 'input_ids')")
    _check_labels(batch)
    decoder = getattr(model, "get_decoder", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if decoder is None or head is None:
        raise TypeError(f"fused_causal_lm_loss needs a causal LM with a decoder and an output head; {type(model).__name__} has not both")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = decoder(**inputs).last_hidden_state
    labels = nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]  # as Liger shifts them: no copy of the states
    return FusedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), head.weight, labels.reshape(-1))  # type: ignore[no-any-return]


def _check_labels(batch: Mapping[str, Any]) -> None:
    """Labels one per token, as token ids: said before the decoder runs (torch's own error comes from inside the loss)."""
    labels = batch["labels"]
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"Invalid labels of type {type(labels).__name__}: give a tensor of token ids shaped like input_ids (-100 where no loss)")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"Invalid labels of dtype {labels.dtype}: give token ids (torch.long) shaped like input_ids, -100 where no loss")
    ids, embeds = batch.get("input_ids"), batch.get("inputs_embeds")
    if isinstance(ids, torch.Tensor):
        tokens, name = tuple(ids.shape), "input_ids"
    elif isinstance(embeds, torch.Tensor):
        tokens, name = tuple(embeds.shape[:-1]), "inputs_embeds (less its last dim)"
    else:
        return  # the model's own error says what it lacks
    if tuple(labels.shape) != tokens:
        raise ValueError(
            f"Invalid labels of shape {tuple(labels.shape)} for {name} of shape {tokens}: the loss takes one label per token "
            "(shifted by one inside, as the model's own loss shifts them); give labels shaped like input_ids, -100 where no "
            "loss (padding)"
        )


def _check_shapes(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """The shapes :class:`FusedLinearCrossEntropy` takes, said before any chunk runs."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"Invalid shapes: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}; give hidden states as tokens x hidden "
            "and the head's weight as vocabulary x hidden (the same hidden size)"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"Invalid targets of shape {tuple(targets.shape)} for hidden states of shape {tuple(hidden.shape)}: give one target "
            f"per token, a 1-d tensor of {hidden.shape[0]} token ids (-100 where no loss); flatten labels with .reshape(-1)"
        )


fused_causal_lm_loss.setting = SETTING  # type: ignore[attr-defined]  # what a plan with this loss says it assumed
