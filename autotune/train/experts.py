"""A mixture-of-experts load-balancing loss over a window of micro-batches: exact, or its deviation said.

Transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) add to their loss, when
``config.output_router_logits`` is on, the Switch Transformer's load-balancing loss::

    aux = E * sum_e f_e * P_e        f_e: fraction of the top-k assignments that go to expert e
                                     P_e: mean router probability of expert e

both over the batch's tokens (padding excluded by the attention mask) and every routed layer. It is a
product of two batch means, so the micro-batches' own losses, weighted and added, are not the big
batch's: that is the convention every trainer follows (``router_loss="per_micro_batch"``, the default),
and ``fit`` says in the plan's notes how far it is from the window's value on the first window.

``router_loss="exact"`` makes it the big batch's: a forward of the window's micro-batches without
gradients, before they train, gives the window's ``f`` (which has no gradient); each micro-batch's share
is then linear in its own probabilities, ``E * sum_e f_e^window * (sum of P over its tokens) / (the
window's tokens)``, and the shares add up to the big batch's loss, gradient included. The cost: one
forward without gradients per window. The forward runs in the model's training mode from the same
random state as the training forwards that follow (restored after it), so dropout and router jitter
route the same way; a kernel that is not deterministic (some CUDA atomics) could route a token whose
top-k is a near-tie otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from autotune import batches as B
from autotune.errors import AutotuneError
from autotune.memory.ledger import is_out_of_memory
from autotune.rng import RNGState
from autotune.step import LossFn, autocast

__all__ = [
    "ROUTER_LOSSES",
    "Routed",
    "Router",
    "RouterLoss",
    "balance",
    "check_router_loss",
    "measured",
    "router_loss_for",
    "router_of",
    "routing",
    "share",
    "window_routing",
]

RouterLossMode = Literal["per_micro_batch", "exact"]
ROUTER_LOSSES = ("per_micro_batch", "exact")


@dataclasses.dataclass(frozen=True)
class Router:
    """A model's load-balancing loss, as its forward computes it.

    Attributes:
        experts: routed experts per layer (``E``).
        top_k: experts each token is sent to.
        coef: what the model multiplies the loss by before adding it (``router_aux_loss_coef``).
    """

    experts: int
    top_k: int
    coef: float


def router_of(model: Any) -> Router | None:
    """The load-balancing loss ``model`` adds to its own loss (None: it adds none: no router logits
    asked for in its config, or a coefficient of 0)."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return None
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    experts = getattr(model, "num_experts", None) or getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None) or getattr(config, "num_experts_per_tok", None)
    if not coef or not isinstance(experts, int) or not isinstance(top_k, int):
        return None
    return Router(experts=experts, top_k=top_k, coef=float(coef))


def check_router_loss(model: Any, router_loss: Any, *, loss_fn: Any, distributed: bool) -> None:
    """Refuse a ``router_loss`` that is not a mode, or ``"exact"`` where it cannot be made exact."""
    if router_loss not in ROUTER_LOSSES:
        raise ValueError(f"Invalid router_loss {router_loss!r}: use 'per_micro_batch' (each micro-batch's own load-balancing "
                         "loss, what trainers do) or 'exact' (the window's, at one extra forward without gradients per window)")
    if router_loss != "exact":
        return
    if distributed:
        raise ValueError("Invalid router_loss 'exact' with several ranks: the window's expert fractions would have to be summed "
                         "over the ranks, which is not supported yet; leave router_loss out (each micro-batch's own loss)")
    name = type(model).__name__
    if router_of(model) is None:
        raise ValueError(f"Invalid router_loss 'exact' for {name}: it adds no load-balancing loss to its own loss (no "
                         "config.output_router_logits, or router_aux_loss_coef 0); leave router_loss out")
    if loss_fn is not None:
        raise ValueError(f"Invalid router_loss 'exact' with a loss_fn: autotune replaces the load-balancing term of {name}'s own "
                         "loss (output.loss, output.aux_loss, output.router_logits) and cannot see what a loss_fn adds; leave "
                         "loss_fn out (the model's own loss), or router_loss out")


def routing(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None, router: Router, *, curvature: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Over every routed layer and every token the mask keeps (all without a mask): the top-k
    assignments of each expert (no gradient), the sum of each expert's router probability (with the
    logits' gradient), the rows counted (layers x tokens), all in float32 at least; with ``curvature``
    also ``sum_t J_t @ J_t`` over the rows, ``J_t`` the softmax's Jacobian at row ``t`` (an ``E x E``
    matrix: ``d @ M @ d`` is the squared norm of the gradient a change ``d`` in the loss's gradient with
    respect to the probabilities sends to the router logits), else None."""
    logits = [layer.reshape(-1, layer.shape[-1]) for layer in router_logits]
    dtype = torch.promote_types(logits[0].dtype, torch.float32)
    assigned = torch.zeros(router.experts, dtype=dtype, device=logits[0].device)
    probs = torch.zeros(router.experts, dtype=dtype, device=logits[0].device)
    rows = torch.zeros((), dtype=dtype, device=logits[0].device)
    jacobians = torch.zeros(router.experts, router.experts, dtype=dtype, device=logits[0].device) if curvature else None
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.numel() != logits[0].shape[0]:
            raise ValueError(f"Invalid attention_mask of shape {tuple(attention_mask.shape)} for the load-balancing loss: it takes "
                             f"a (batch, sequence) mask of the {logits[0].shape[0]} routed tokens; leave router_loss out")
        mask = attention_mask.reshape(-1).to(device=logits[0].device, dtype=dtype)
    for layer in logits:
        p = torch.softmax(layer.to(dtype), dim=-1)
        chosen = torch.zeros_like(p).scatter_(1, torch.topk(p.detach(), router.top_k, dim=-1).indices, 1.0)
        if mask is not None:
            p, chosen = p * mask[:, None], chosen * mask[:, None]
            rows = rows + mask.sum()
        else:
            rows = rows + p.shape[0]
        assigned = assigned + chosen.sum(0)
        probs = probs + p.sum(0)
        if jacobians is not None:  # J = diag(p) - p p^T, so J @ J = diag(p^2) - (p*p) p^T - p (p*p)^T + |p|^2 p p^T
            square = (p * p).T @ p
            jacobians = jacobians + torch.diag((p * p).sum(0)) - square - square.T + (p * (p * p).sum(-1, keepdim=True)).T @ p
    return assigned, probs, rows, jacobians


@dataclasses.dataclass(frozen=True)
class Routed:
    """A window's routing, from a forward of its micro-batches without gradients (:func:`window_routing`).

    Attributes:
        assigned: each expert's top-k assignments over the window's rows (every layer, padding excluded).
        rows: the rows counted (layers x tokens).
        per_micro: the load-balancing loss as the micro-batches add it (each its own, times its weight).
        exact: the window's load-balancing loss (the big batch's).
        gradient_off: relative: the gradient of the per-micro-batch losses with respect to the router
            logits (the loss's own inputs) against the window's loss's.
        agrees: the model's own per-micro-batch loss (``output.aux_loss``) is the one computed here,
            within its precision (False: it is some other form, and nothing here describes it).
    """

    assigned: torch.Tensor
    rows: torch.Tensor
    per_micro: float
    exact: float
    gradient_off: float
    agrees: bool


def window_routing(model: Any, batches: Sequence[Any], weights: Sequence[float], router: Router,
                   forward: Callable[[Any, Any], Any], *, measure: bool = True) -> Routed:
    """The window's routing (:class:`Routed`): ``forward(model, batch)`` (the model's output, with
    ``router_logits``) of every micro-batch without gradients, from the random state the training
    forwards will start from, which is put back after it, so dropout and router jitter route them
    alike. ``weights``: what each micro-batch's loss is multiplied by in training. ``measure=False``:
    the routing only, nothing read from the device (``per_micro``, ``exact`` and ``gradient_off`` NaN,
    ``agrees`` True: what the first window measured holds)."""
    rng = RNGState()
    parts = []
    agrees = True
    try:
        with torch.no_grad():
            for batch, weight in zip(batches, weights):
                if not isinstance(batch, Mapping):
                    raise TypeError(f"Invalid batch of type {type(batch).__name__} for the load-balancing loss: it runs "
                                    "model(**batch) on dict batches only; leave router_loss out")
                output = forward(model, batch)
                if not getattr(output, "router_logits", None):
                    raise TypeError(f"Invalid model output {type(output).__name__} for the load-balancing loss: it holds no "
                                    "router_logits; leave router_loss out")
                assigned, probs, rows, jacobians = routing(output.router_logits, batch.get("attention_mask"), router, curvature=True)
                parts.append((assigned, probs, rows, weight, jacobians))
                own = getattr(output, "aux_loss", None)
                if measure and torch.is_tensor(own):
                    mine = float(router.experts * (assigned / rows) @ (probs / rows))
                    # the model's softmax runs in its logits' dtype: half precision rounds its probabilities
                    tolerance = 1e-4 if output.router_logits[0].dtype in (torch.float32, torch.float64) else 2e-2
                    agrees = agrees and abs(float(own) - mine) <= tolerance * max(abs(mine), 1e-30)
    finally:
        rng.restore()
    assigned = sum(p[0] for p in parts)
    probs = sum(p[1] for p in parts)
    rows = sum(p[2] for p in parts)
    if not measure:
        return Routed(assigned, rows, math.nan, math.nan, math.nan, True)  # type: ignore[arg-type]
    per_micro = sum(w * float(router.experts * (a / r) @ (p / r)) for a, p, r, w, _ in parts)
    exact = float(router.experts * (assigned / rows) @ (probs / rows))
    # The loss's gradient with respect to a micro-batch's summed probabilities: E f_i w_i / R_i as the
    # micro-batches add it, E f / R over the window; what each sends to the router logits, compared.
    window = router.experts * assigned / rows**2
    off = sum(float((d := router.experts * w * a / r**2 - window) @ m @ d) for a, _, r, w, m in parts)
    whole = sum(float(window @ m @ window) for *_, m in parts)
    return Routed(assigned, rows, per_micro, exact, (off / whole) ** 0.5 if whole > 0 else 0.0, agrees)  # type: ignore[arg-type]


def share(router: Router, routed: Routed, router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor:
    """A micro-batch's exact share of the window's load-balancing loss, coefficient included: linear in
    its router probabilities (the window's fractions carry no gradient), so the shares of the window's
    micro-batches add up to the big batch's loss and gradient."""
    _, probs, _, _ = routing(router_logits, attention_mask, router)
    fractions = (routed.assigned / routed.rows).to(probs.dtype)
    return router.coef * router.experts * (fractions @ probs) / routed.rows.to(probs.dtype)


def balance(router: Router, router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None) -> torch.Tensor:
    """A batch's own load-balancing loss (coefficient not included), as the model computes it but in
    float32 at least (transformers accumulates it in float32 whatever the model's dtype)."""
    assigned, probs, rows, _ = routing(router_logits, attention_mask, router)
    return router.experts * (assigned / rows) @ (probs / rows)


def measured(router: Router, routed: Routed, micro_batches: int, *, window: str = "window") -> str:
    """What the first window showed: the per-micro-batch convention against the window's loss."""
    if not routed.agrees:
        return ("the model's load-balancing loss (output.aux_loss) is not the Switch Transformer form autotune computes "
                "(E * sum over experts of the fraction routed times the mean router probability, padding excluded), so how far "
                "accumulating it per micro-batch is from the big batch's was not measured")
    if micro_batches == 1:
        return f"the first {window} is one micro-batch, so there the two agree"
    off = routed.per_micro / routed.exact - 1 if routed.exact else 0.0
    return (f"on the first {window} ({micro_batches} micro-batches) the load-balancing loss as the micro-batches add it is "
            f"{routed.per_micro:.6g} against the {window}'s {routed.exact:.6g} ({off:+.3%}; x{router.coef:g} in the loss), and its "
            f"gradient with respect to the router logits is {routed.gradient_off:.1%} off the {window}'s")


class RouterLoss:
    """The load-balancing loss of one ``fit`` run: measured on the first window and, in ``"exact"``
    mode, made the window's on every window (:meth:`before_window`, :meth:`loss_fn`)."""

    def __init__(self, router: Router, mode: RouterLossMode) -> None:
        self.router, self.mode = router, mode
        self.note: str | None = None  # said once, after the first window's forward

    def before_window(self, run: Any, window: Any) -> Routed | None:
        """Exact mode, and the first window in either: the window's routing (:func:`window_routing`),
        BatchNorm's statistics put back after it too. None when nothing is needed."""
        if self.mode != "exact" and self.note is not None:
            return None

        def forward(model: Any, batch: Any) -> Any:
            with autocast(run.device.type, run.precision):
                return model(**B.to_device(batch, run.device))

        bn = run.save_bn()
        try:
            routed = window_routing(run.model, [m.batch for m in window], [m.weight for m in window], self.router, forward,
                                    measure=self.note is None)  # measured on the first window only: no read in later ones
        except Exception as exc:
            if self.mode == "exact" or is_out_of_memory(exc):
                raise
            # the default trains as trainers do whatever the measurement meets; the note says what stopped it
            self.note = (f"load-balancing loss per micro-batch (router_loss='per_micro_batch', what trainers do): how far it is from "
                         f"the window's was not measured ({type(exc).__name__}: {exc})")
            run.plan = dataclasses.replace(run.plan, notes=run.plan.notes + (self.note,))
            return None
        finally:
            run.restore_bn(bn)
        if self.mode == "exact" and not routed.agrees:
            raise AutotuneError(f"Invalid router_loss 'exact' for {type(run.model).__name__}, found at its first window before it "
                                f"trained (nothing has changed): {measured(self.router, routed, len(window))}; leave router_loss out")
        if self.note is None:
            self.note = self._said(routed, len(window))
            run.plan = dataclasses.replace(run.plan, notes=run.plan.notes + (self.note,))
        return routed if self.mode == "exact" else None

    def _said(self, routed: Routed, micro_batches: int) -> str:
        """The note: what the mode does, and what the first window measured."""
        found = measured(self.router, routed, micro_batches)
        if self.mode == "exact":
            return (f"router_loss='exact': each micro-batch's load-balancing share uses the fraction routed to each expert over "
                    f"the whole window, so the sum is the big batch's loss and gradient, at the cost of one extra forward "
                    f"without gradients per window; {found}")
        return (f"load-balancing loss per micro-batch (router_loss='per_micro_batch', what trainers do): it is a product of "
                f"batch means, so its sum over micro-batches is not the big batch's; {found}; router_loss='exact' makes it "
                "exact at one extra forward without gradients per window")

    def loss_fn(self, routed: Routed, weight: float) -> LossFn:
        """The model's own loss with its load-balancing term replaced by this micro-batch's exact share,
        divided by ``weight`` (what ``fit`` multiplies the loss by), so that the weighted losses add up to
        the big batch's."""
        router = self.router

        def loss(model: Any, batch: Any) -> torch.Tensor:
            output = model(**batch)
            own = output.loss
            if own is None:
                raise ValueError("Invalid batch for router_loss='exact': the model returned no loss (no labels in the batch?); "
                                 "give labels, or leave router_loss out")
            # the model added ``coef * aux_loss`` (in the aux loss's dtype): taken out again, its gradient cancels exactly
            own = own - (router.coef * output.aux_loss).to(own.dtype)
            return own + (share(router, routed, output.router_logits, batch.get("attention_mask")) / weight).to(own.dtype)

        return loss


def router_loss_for(model: Any, mode: RouterLossMode) -> RouterLoss | None:
    """The :class:`RouterLoss` of a ``fit`` run on ``model`` (None: the model adds no load-balancing loss)."""
    router = router_of(model)
    return RouterLoss(router, mode) if router is not None else None
