"""Mixture-of-experts layers on fake tensors, and the routing the estimate assumes.

A mixture-of-experts layer sends each token to ``k`` of its ``E`` experts, chosen by a router from the
token's values, which an estimate does not have. How the tokens spread over the experts changes what a step
holds only where the experts run one by one (each on the tokens it got, a shape read from the router's
output); run as Transformers runs them by default (``experts_implementation="grouped_mm"``: every token's
``k`` copies sorted by expert and multiplied in one grouped matmul), every activation is ``tokens x k`` rows
whatever the spread, and a fake step holds exactly what the real one does (measured to the byte against real
CPU steps of Mixtral, Qwen2-MoE and a DeepSeek-V3-style model). So:

- the fake copy of a model whose experts run one by one (``"eager"``) runs them grouped instead, and the plan
  says so: the same activations in total, all ``tokens x k`` rows held at once rather than one expert's;
- every plan of a model with experts names the assumption: no capacity limit, every token reaches its ``k``
  experts (no token dropped), memory independent of the spread.

The grouped matmul's fake kernel checks CUDA's old dtype rule (bf16 only) while the CPU's real kernel takes
fp32 too; :mod:`autotune.probe.fakes` answers it with the real kernel's shapes.
"""

from __future__ import annotations

from torch import nn

__all__ = ["routed_experts"]


def _experts(model: nn.Module) -> list[nn.Module]:
    """The model's experts modules: Transformers' ``@use_experts_implementation`` classes (their forward reads
    ``config._experts_implementation``)."""
    return [m for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "has_gate") and hasattr(m, "config")]


def routed_experts(model: nn.Module) -> str | None:
    """Make the experts of ``model`` (a fake copy) run grouped, and say what the estimate assumes of their
    routing; None for a model without experts."""
    found = _experts(model)
    if not found:
        return None
    first = found[0]
    k = getattr(first.config, "num_experts_per_tok", None)
    kind = type(first).__name__
    how = str(getattr(first.config, "_experts_implementation", None) or "grouped_mm")
    said = (f"mixture of experts ({first.num_experts} experts a layer, {kind}, top-{k}): every token reaches "
            f"its experts (no capacity limit, none dropped); run as one grouped matmul over tokens x {k} rows, the memory does "
            "not depend on how the router spreads the tokens")
    if how != "grouped_mm":
        for module in found:
            module.config._experts_implementation = "grouped_mm"
        said += (f" (the model runs its experts {how!r}, one by one on the tokens each gets, a shape fake tensors cannot "
                 "know: estimated grouped, the same activations in total, held at once)")
    return said
