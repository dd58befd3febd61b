"""A mixture-of-experts load-balancing loss under the Hugging Face Trainer, not multiplied by the accumulation.

A Transformers MoE model with ``config.output_router_logits`` adds ``coef * aux_loss`` to each
micro-batch's loss. The Trainer divides each micro-batch's loss by the step's items (the model's
cross-entropy sums and divides by ``num_items_in_batch``) and then not by the accumulation steps, so the
load-balancing term of every micro-batch is added whole: k micro-batches, k times the loss. While
prepared, the model adds none (its coefficient is 0, put back by ``restore()``), the Trainer's loss
rule is checked on the cross-entropy alone, and :func:`balanced` adds the term itself:

- ``router_loss="per_micro_batch"`` (default): each micro-batch's own load-balancing loss weighted by
  its tokens over the step's (the attention mask's), so the step holds one loss's worth, not k; how far
  that is from the big batch's is measured on the first step when preparing;
- ``router_loss="exact"``: the big batch's (:mod:`autotune.train.experts`): the step's micro-batches,
  collected by the Trainer's ``get_batch_samples`` before the first trains, run once without gradients
  to find the fraction routed to each expert over the step; each micro-batch's share is then linear and
  the shares add up to the big batch's loss and gradient. One process only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from autotune.train.experts import Routed, Router, balance, measured, share, window_routing

__all__ = ["balanced", "coefficient_off", "routed_step", "said"]


def _owner(model: Any) -> Any:
    """The module whose forward reads ``router_aux_loss_coef`` (under PEFT, the base model)."""
    return next((m for m in model.modules() if "router_aux_loss_coef" in m.__dict__), model)


@contextlib.contextmanager
def coefficient_off(model: Any) -> Iterator[None]:
    """The model adds no load-balancing loss inside (its coefficient 0), as it was after."""
    owner = _owner(model)
    was = owner.__dict__.get("router_aux_loss_coef")
    owner.router_aux_loss_coef = 0.0
    try:
        yield
    finally:
        owner.router_aux_loss_coef = was


def _tokens(batch: Mapping[str, Any]) -> float:
    """The tokens the load-balancing loss averages over: the attention mask's, else every token."""
    mask = batch.get("attention_mask")
    if torch.is_tensor(mask) and mask.dim() == 2:
        return float(mask.sum())
    ids = batch.get("input_ids")
    return float(ids.numel()) if torch.is_tensor(ids) else 0.0


def _forward(trainer: Any) -> Callable[[Any, Any], Any]:
    """The model's forward on a micro-batch as the Trainer runs it (on its device, under its autocast), in training mode."""

    def forward(model: Any, batch: Any) -> Any:
        with trainer.compute_loss_context_manager():
            return model(**trainer._prepare_inputs(dict(batch)))

    return forward


def routed_step(trainer: Any, router: Router, batches: list[Mapping[str, Any]]) -> Routed:
    """A step's micro-batches routed (:func:`autotune.train.experts.window_routing`), each weighted by
    its tokens over the step's, the modules in training mode as they train, put back after."""
    model = trainer.model
    modes = [(m, m.training) for m in model.modules()]
    total = sum(map(_tokens, batches)) or 1.0
    try:
        model.train()
        return window_routing(model, batches, [_tokens(b) / total for b in batches], router, _forward(trainer))
    finally:
        for m, training in modes:
            m.training = training


def said(router: Router, routed: Routed, micro_batches: int, mode: str, name: str) -> str:
    """The note on the load-balancing loss under the Trainer."""
    # prepare() measures a step of the dataset's first samples, in order (the Trainer's own first step may shuffle them)
    found = measured(router, routed, micro_batches, window="step").replace("on the first step (", "on a step of the dataset's first samples (", 1)
    head = (f"{name} adds a load-balancing loss (x{router.coef:g}) to each micro-batch's loss, which the Trainer alone does not "
            f"divide by the accumulation ({micro_batches} micro-batches: {micro_batches} times one loss's worth)")
    if mode == "exact":
        return (f"{head}; autotune adds it instead, the step's exactly (router_loss='exact'): each micro-batch's share uses the "
                f"fraction routed to each expert over the whole step, from one extra forward without gradients per step, so a step "
                f"is the big batch's, logged loss included; {found}")
    return (f"{head}; autotune adds each micro-batch's own instead, weighted by its tokens over the step's (router_loss="
            f"'per_micro_batch', what trainers do), so a step holds one loss's worth; it is a product of batch means, so not "
            f"the big batch's: {found}; router_loss='exact' makes it exact at one extra forward without gradients per step")


def balanced(trainer: Any, router: Router, mode: str) -> Callable[[], None]:
    """Wrap the Trainer's ``get_batch_samples`` (the step's tokens and, exact, its routing) and
    ``compute_loss`` (the load-balancing term added as ``mode`` says; the model's own added as it
    would be outside training), the model's coefficient set to 0; what puts all three back."""
    step: dict[str, Any] = {}
    original_batches, original_loss = trainer.get_batch_samples, trainer.compute_loss
    owner = _owner(trainer.model)
    had = "router_aux_loss_coef" in owner.__dict__
    was = owner.__dict__.get("router_aux_loss_coef")

    def get_batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batch_samples, num_items = original_batches(epoch_iterator, num_batches, device)
        step["tokens"] = sum(_tokens(b) for b in batch_samples)
        step["routed"] = routed_step(trainer, router, list(batch_samples)) if mode == "exact" and batch_samples else None
        return batch_samples, num_items

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        loss, outputs = original_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        aux = getattr(outputs, "aux_loss", None)
        if not torch.is_tensor(aux) or getattr(outputs, "loss", None) is None:
            pass  # nothing the model would have added (it adds the term to a loss of its own, from labels)
        elif not model.training or "tokens" not in step:
            loss = loss + (router.coef * aux).to(loss.dtype)  # what the model itself adds
        else:
            if step.get("routed") is not None:
                term = share(router, step["routed"], outputs.router_logits, inputs.get("attention_mask"))
            else:
                own = balance(router, outputs.router_logits, inputs.get("attention_mask"))
                term = router.coef * own * (_tokens(inputs) / max(step["tokens"], 1.0))
            scaled = trainer.loss_is_scaled_for_ga
            if scaled is None:
                scaled = bool(trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
            if not scaled:  # the Trainer divides the loss by the accumulation steps after this: the term is not to be
                term = term * trainer.current_gradient_accumulation_steps
            loss = loss + term.to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    trainer.get_batch_samples, trainer.compute_loss = get_batch_samples, compute_loss
    owner.router_aux_loss_coef = 0.0

    def restore() -> None:
        trainer.get_batch_samples, trainer.compute_loss = original_batches, original_loss
        if had:
            owner.router_aux_loss_coef = was
        else:
            owner.__dict__.pop("router_aux_loss_coef", None)

    return restore
