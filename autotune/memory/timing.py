"""How long a step takes on a card: predicted from the work the estimate traced, or measured where the card is here.

The estimate walks every operation of a training step on fake tensors and counts each one's floating-point work and
the bytes it reads and writes (:mod:`autotune.memory.work`). On a card of the catalogue (:mod:`autotune.memory.gpus`)
a micro-step then takes, part by part (phase, dtype, kind):

- **matrix products and attention kernels**: the longer of their FLOPs at the card's peak dense rate for their dtype
  (bf16 and fp16 on tensor cores; fp32 at the plain rate, or TF32 where PyTorch allows it) times an efficiency, and
  their bytes at the memory bandwidth times an efficiency;
- **element-wise and reduction work** (``"memory"``), **dequantization** and the **optimizer's step**: their bytes at
  the bandwidth times its efficiency (a fused 4-bit matmul's dequantization, counted by elements alone, at two bytes
  written and half a byte read an element);

the micro-step's kernels run one after another on one stream, so their times add up. The host dispatches every
kernel too (Python, the dispatcher, the launch), ahead of the card while it can: where the kernels are short, the
host is the bound, its launches times :attr:`Efficiency.dispatch`. The two overlap, imperfectly where they are close
(the host falls behind in one block and ahead in the next): a micro-step takes ``(kernels^p + host^p)^(1/p)``, with
``p`` (:attr:`Efficiency.overlap`) fitted beside the efficiencies. A checkpointed block's recomputed forward,
a 4-bit weight's dequantization and the optimizer's foreach or fused kernels are in the work already, each as traced.

An optimizer step at ``k`` micro-batches is ``k`` micro-steps and one optimizer step.

The constants (:data:`CALIBRATED`) were fitted to five published throughputs of fine-tunes on an A100-80GB, each
chosen for the constant it pins (a full fine-tune bound by its matmuls, a LoRA one with more element-wise work, the
longest sequence for attention, the smallest model at the shortest for the host), and checked against 21 others, full,
LoRA and QLoRA, 256 to 8192 tokens, within 0.83-1.16 (``benchmarks/step_time.py`` lists them apart, with their
sources; ``docs/benchmarks.md`` holds the table). The attention efficiency is above 1: torch's formula counts every
score of a causal attention, of which the kernels compute half. All the cases are of one card: other cards are
predicted from their datasheets' peaks with the same efficiencies, checked by ``benchmarks/gpu_validate.py``'s
``step time`` case on a lent card. A sharded step's all-gathers and reduce-scatters are added by
:mod:`autotune.planning.collectives`, a data-parallel step's all-reduce after each window by
:mod:`autotune.planning.times` (:attr:`StepTime.sync`). Not modelled: host-device copies of the batch, the data
loader, and CUDA graphs or compilation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.memory.gpus import Gpu
    from autotune.memory.work import Work

__all__ = ["CALIBRATED", "Efficiency", "StepTime", "measured", "predict"]

_PEAK_OF = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
            "int8": "int8"}
_FUSED_DEQUANTIZED_BYTES = 2.5  # a 4-bit matmul's dequantized element: half a byte read, two bytes (bf16) written


@dataclass(frozen=True)
class Efficiency:
    """The fractions of a card's peaks that a step's kernels reach, and the host's time per kernel.

    Attributes:
        matmul: of the peak dense FLOP/s, for matrix products (cuBLAS).
        attention: of the peak dense FLOP/s, for fused attention kernels (flash, memory-efficient, cuDNN).
        memory: of the memory bandwidth, for work bound by its bytes (element-wise, reductions, the optimizer).
        dispatch: seconds of the host's time per kernel.
        overlap: how closely the host's dispatch and the kernels overlap (the exponent of the module docstring: the
            larger, the closer to the longer of the two alone).
        source: where the figures come from.
    """

    matmul: float
    attention: float
    memory: float
    dispatch: float
    overlap: float
    source: str


CALIBRATED = Efficiency(
    matmul=0.65, attention=1.8, memory=0.85, dispatch=2e-5, overlap=3,
    source="fitted to five published A100-80GB fine-tunes (fms-acceleration's Mistral-7B full and LoRA and SantaCoder "
           "full at batch 4; Qwen's 1.8B LoRA at 256 tokens and 7B LoRA at 8192) and checked against 21 others "
           "(benchmarks/step_time.py)",
)


@dataclass(frozen=True)
class StepTime:
    """Seconds per step, and what they rest on.

    Attributes:
        micro_step: seconds of one forward and backward at the micro-batch.
        optimizer: seconds of the optimizer's step.
        accumulation: micro-steps per optimizer step.
        samples: samples per optimizer step on this device.
        tokens: tokens per optimizer step on this device, where the batch has tokens.
        flops: floating-point operations per optimizer step run on this device (recomputed forwards included).
        peak: the card's peak dense FLOP/s for the step's main dtype (None when measured without a card's figures).
        basis: e.g. ``"predicted for an H100 SXM (989 TFLOP/s bf16 dense, 3.35 TB/s)"`` or ``"measured on this device:
            ..."``.
        bound: what bounds a micro-step: ``"compute"``, ``"memory"``, ``"host"`` (the kernels' dispatch), or
            ``"measured"``.
        sync: seconds of the gradients' all-reduce over data-parallel ranks after each window (autotune syncs once
            a window, after its last backward: nothing overlaps it), predicted for the card's link; 0 on one device.
    """

    micro_step: float
    optimizer: float
    accumulation: int
    samples: int
    tokens: int | None
    flops: float
    peak: float | None
    basis: str
    bound: str
    sync: float = 0.0

    @property
    def step(self) -> float:
        """Seconds per optimizer step."""
        return self.accumulation * self.micro_step + self.optimizer + self.sync

    @property
    def samples_per_second(self) -> float:
        """Samples a second on this device."""
        return self.samples / self.step

    @property
    def tokens_per_second(self) -> float | None:
        """Tokens a second on this device, where the batch has tokens."""
        return None if self.tokens is None else self.tokens / self.step

    @property
    def utilisation(self) -> float | None:
        """The step's FLOPs a second over the card's peak (recomputed forwards included: with checkpointing this is
        above the model FLOP utilisation, whose FLOPs count each forward once)."""
        return None if not self.peak else self.flops / self.step / self.peak

    @property
    def qualified(self) -> list[str]:
        """The basis cut at each ``"; "`` outside parentheses: how the time was found, then each of its qualifications
        (a card's figures, in parentheses, stay with it)."""
        parts, depth, start = [], 0, 0
        for i, c in enumerate(self.basis):
            depth += (c == "(") - (c == ")")
            if depth == 0 and self.basis.startswith("; ", i):
                parts.append(self.basis[start:i])
                start = i + 2
        return parts + [self.basis[start:]]

    def run(self, steps: int) -> float:
        """Seconds of ``steps`` optimizer steps."""
        return steps * self.step

    def describe(self) -> str:
        """One line: the optimizer step's time, the throughput and the basis."""
        rate = f"{self.samples_per_second:,.3g} samples/s"
        if self.tokens_per_second is not None:
            rate += f", {self.tokens_per_second:,.0f} tokens/s"
        return f"{seconds(self.step)} per optimizer step ({rate}), {self.basis}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values for ``--json``: the fields, and the optimizer step's seconds, the throughput and the utilisation."""
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "step": self.step, "samples_per_second": self.samples_per_second,
                "tokens_per_second": self.tokens_per_second, "utilisation": self.utilisation}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepTime:
        """Back from :meth:`to_dict` (the derived values are left out)."""
        return cls(**{f.name: data.get(f.name, f.default) for f in fields(cls)})  # a plan saved before a field: its default


def seconds(s: float) -> str:
    """``s`` as people read a duration: ``"85 ms"``, ``"5.35 s"``, ``"12 min 4 s"``, ``"3 h 20 min"``."""
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    if s < 60:
        return f"{s:.3g} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60)} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60)} min"


def _peak(card: Gpu, dtype: str) -> float | None:
    name = _PEAK_OF.get(dtype)
    if name is None:
        return None
    if name == "fp32" and card.tf32 is not None and _tf32_allowed():
        name = "tf32"
    return card.peak(name)


def _tf32_allowed() -> bool:
    import torch

    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def _kernels(work: Work, card: Gpu, eff: Efficiency) -> tuple[float, float, float]:
    """Seconds of ``work``'s kernels, and of them the seconds bound by compute and by memory."""
    bandwidth = card.bandwidth * eff.memory
    compute = memory = 0.0
    for _phase, dtype, kind, flops, nbytes in work.parts:
        if kind in ("matmul", "attention") and flops:
            peak = _peak(card, dtype) or card.fp32
            by_flops = flops / (peak * (eff.matmul if kind == "matmul" else eff.attention))
            by_bytes = nbytes / bandwidth
            if by_flops >= by_bytes:
                compute += by_flops
            else:
                memory += by_bytes
        elif kind == "dequantize":
            memory += max(nbytes, _FUSED_DEQUANTIZED_BYTES * flops) / bandwidth
        else:
            memory += nbytes / bandwidth
    return compute + memory, compute, memory


def _overlapped(kernels: float, host: float, p: float) -> float:
    return float((kernels**p + host**p) ** (1 / p)) if kernels or host else 0.0


def _matmul_flops(work: Work) -> dict[str, float]:
    """The FLOPs of ``work``'s matmuls and attention kernels by dtype (the dtypes that have any)."""
    return {dtype: flops for dtype, (flops, _) in work.of(kind=("matmul", "attention")).by("dtype").items() if flops}


def _main_peak(work: Work, card: Gpu) -> float | None:
    by_dtype = _matmul_flops(work)
    return (_peak(card, max(by_dtype, key=by_dtype.__getitem__)) or card.fp32) if by_dtype else None


def _without_tensor_cores(work: Work, card: Gpu) -> str:
    """What the basis adds where the step's matmuls are in a dtype the card has no peak for (bf16 on a T4 or a V100):
    they are predicted at its fp32 rate, as :func:`_kernels` times them; else nothing."""
    lacking = sorted({_PEAK_OF[dtype] for dtype in _matmul_flops(work) if dtype in _PEAK_OF and _peak(card, dtype) is None})
    if not lacking:
        return ""
    fast = ", ".join(f"{name} {card.peak(name) / 1e12:.3g}" for name in ("bf16", "fp16") if card.peak(name)) + " TFLOP/s"
    return (f"; its {' and '.join(lacking)} matmuls at the card's fp32 rate ({card.fp32 / 1e12:.3g} TFLOP/s): {card.title} has no "
            f"{' or '.join(lacking)} tensor cores ({fast})")


def predict(work: Work, card: Gpu, *, accumulation: int = 1, samples: int, tokens: int | None = None,
            efficiency: Efficiency = CALIBRATED) -> StepTime:
    """The time of an optimizer step on ``card``: ``accumulation`` micro-steps of ``work``'s forward and backward, and
    its optimizer step (``work`` is one micro-step's, as :meth:`autotune.probe.estimate.Estimator.work` gives it).

    Args:
        work: the FLOPs, bytes and kernel launches of one micro-step and of the optimizer's step.
        card: the card.
        accumulation: micro-steps per optimizer step.
        samples: samples per optimizer step on this device (micro-batch times ``accumulation``).
        tokens: tokens per optimizer step on this device, where the batch has tokens.
        efficiency: the fractions of the card's peaks reached (default: :data:`CALIBRATED`).

    Example:
        >>> from autotune.memory.gpus import gpu_named
        >>> w = Work((("forward", "bfloat16", "matmul", 10**15, 10**9), ("step", "float32", "memory", 0, 10**10)))
        >>> t = predict(w, gpu_named("h100-sxm"), accumulation=4, samples=32)
        >>> round(t.micro_step, 1), t.bound  # 10^15 FLOPs at 65% of 989 TFLOP/s
        (1.6, 'compute')
    """
    if accumulation < 1:
        raise ValueError(f"Invalid accumulation={accumulation}: give at least one micro-step per optimizer step")
    micro = work.of(phase=("forward", "backward"))
    kernels, compute, memory = _kernels(micro, card, efficiency)
    host = micro.launched() * efficiency.dispatch
    bound = "host" if host > kernels else ("compute" if compute >= memory else "memory")
    step = work.of(phase="step")
    optimizer = _overlapped(_kernels(step, card, efficiency)[0], step.launched() * efficiency.dispatch, efficiency.overlap)
    return StepTime(micro_step=_overlapped(kernels, host, efficiency.overlap), optimizer=optimizer, accumulation=accumulation, samples=samples,
                    tokens=tokens, flops=float(accumulation * micro.flops + step.flops), peak=_main_peak(micro, card),
                    basis=f"predicted for {card.describe()}{_without_tensor_cores(micro, card)}", bound=bound)


def measured(micro_step: float, optimizer: float, steps: int, *, accumulation: int, samples: int, tokens: int | None,
             flops: float, where: str, caveats: Sequence[str] = ()) -> StepTime:
    """A step time from real trial steps: the fastest steady micro-step (``micro_step`` seconds, the optimizer state
    live) and optimizer step (``optimizer`` seconds) of ``steps`` trial steps on the device named by ``where``; an
    optimizer step is ``accumulation`` micro-steps and one optimizer step. The basis says so, then each of ``caveats``
    (how the trial's times differ from a training step's), after ``"; "``."""
    basis = "; ".join([f"measured on this device ({where}) over {steps} trial step{'s' if steps != 1 else ''}", *caveats])
    return StepTime(micro_step=micro_step, optimizer=optimizer, accumulation=accumulation, samples=samples, tokens=tokens,
                    flops=flops, peak=None, basis=basis, bound="measured")
