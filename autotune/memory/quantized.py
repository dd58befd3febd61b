"""Quantized base weights (bitsandbytes 4-bit and 8-bit): what they hold, and how a model gets them.

QLoRA trains LoRA adapters over a frozen base whose linear layers are quantized by bitsandbytes. Such a
layer holds less than its weight's dtype says, and holds some of it outside its parameters:

- **4-bit** (``nf4`` or ``fp4``, :class:`bitsandbytes.nn.Linear4bit`): the weight packed two values to a
  byte (a ``uint8`` tensor of half its elements) and its quantization state: one ``absmax`` per block of
  64 values (``float32``; with double quantization a ``uint8`` per block, itself quantized per 256 blocks
  with a ``float32`` absmax, an offset and a 256-value code), and the 16-value code. Forward and backward
  dequantize the weight to the compute dtype (a temporary as large as the layer's weight in that dtype).
- **8-bit** (``int8``, LLM.int8(), :class:`bitsandbytes.nn.Linear8bitLt`): an ``int8`` weight and one
  ``float32`` scale per output row (``SCB``).

The quantization state is an attribute of the weight (``weight.quant_state``), not a parameter or a
buffer: :func:`autotune.memory.ledger.held_outside_parameters` lists it so that every count of what training holds includes it.

A model gets quantized layers three ways, all estimated alike: quantized by bitsandbytes already (on the
CPU, bitsandbytes quantizes and runs forward and backward), :func:`quantize` (here; on the meta device the
layers stay unquantized until the estimate's fake copy quantizes them with bitsandbytes' own function, whose
kernels have fake implementations), or a Hugging Face config whose ``quantization_config`` asks for it
(:meth:`Quantization.from_config`, the same convention as ``BitsAndBytesConfig``). Other quantization
methods (GPTQ, AWQ, HQQ, torchao, ...) are refused by name: their layers hold other tensors and run other
kernels, which nothing here models.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Quantization", "bitsandbytes", "copy_memo", "fake_quantized", "fsdp2_refused", "is_quantized", "is_quantized_weight", "logical_numel", "quantization_of", "quantize", "quantized_layer_types"]

KINDS = ("nf4", "fp4", "int8")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "fp32": torch.float32,
           "bf16": torch.bfloat16, "fp16": torch.float16}


def bitsandbytes() -> Any:
    """bitsandbytes, imported quietly (it logs a warning when an optional CPU kernel package is missing, which
    a plan that does not need that kernel must not print), or a clear error naming the install."""
    try:
        with _quiet("bitsandbytes"), _quiet("kernels"):
            import bitsandbytes as bnb
    except ImportError:
        raise ImportError("Quantized weights need bitsandbytes: pip install 'torch-autotune[quantized]', or 'torch-autotune[llm]' "
                          "with transformers and peft too (or pip install bitsandbytes)") from None
    return bnb


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_kind(kind: Any) -> None:
    if not isinstance(kind, str):
        raise TypeError(f"Invalid quantization {kind!r} ({type(kind).__name__}): give 'nf4', 'fp4' or 'int8', or an "
                        "autotune.memory.quantized.Quantization")
    if kind not in KINDS:
        raise ValueError(f"Invalid quantization {kind!r}: use one of {', '.join(KINDS)}")


def compute_dtype_of(value: Any) -> torch.dtype | None:
    """A 4-bit layer's compute dtype from a torch floating-point dtype, or its name (``"bfloat16"``, ``"bf16"``,
    ``"torch.float16"``, ``"fp32"``...); None stays None (the input's dtype).

    Raises:
        ValueError: a name that is not one of those, or a dtype that is not floating-point.
        TypeError: neither a dtype nor a name.
    """
    accepted = ("give torch.bfloat16, torch.float16 or torch.float32 (or the names 'bfloat16', 'bf16', 'float16', 'fp16', "
                "'float32', 'fp32'), or None for the input's dtype")
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        if not value.is_floating_point:
            raise ValueError(f"Invalid compute_dtype {value}: not a floating-point dtype; {accepted}")
        return value
    if isinstance(value, str):
        found = _DTYPES.get(value.strip().lower().removeprefix("torch."))
        if found is None:
            raise ValueError(f"Invalid compute_dtype {value!r}: {accepted}")
        return found
    raise TypeError(f"Invalid compute_dtype {value!r} ({type(value).__name__}): {accepted}")


@dataclass(frozen=True)
class Quantization:
    """How the base weights are quantized (bitsandbytes).

    Attributes:
        kind: ``"nf4"``, ``"fp4"`` (4-bit) or ``"int8"`` (LLM.int8()).
        double_quant: 4-bit only: the absmax of each block quantized again (``bnb_4bit_use_double_quant``).
        compute_dtype: 4-bit only: the dtype the weight is dequantized to for each matmul
            (``bnb_4bit_compute_dtype``; a torch dtype or its name, ``"bfloat16"`` or ``"bf16"``; None: the input's dtype).
        skip: names of linear layers left unquantized (``llm_int8_skip_modules``; default: the output head).
        threshold: 8-bit only: the outlier threshold (``llm_int8_threshold``).
    """

    kind: str
    double_quant: bool = False
    compute_dtype: torch.dtype | None = None
    skip: tuple[str, ...] = ()
    threshold: float = 6.0

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if not isinstance(self.double_quant, bool):
            raise TypeError(f"Invalid double_quant {self.double_quant!r} ({type(self.double_quant).__name__}): give True or False")
        object.__setattr__(self, "compute_dtype", compute_dtype_of(self.compute_dtype))
        if isinstance(self.skip, str) or not isinstance(self.skip, Iterable) or not all(isinstance(s, str) for s in self.skip):
            raise TypeError(f"Invalid skip {self.skip!r}: give the names of the linear layers to leave unquantized, e.g. ('lm_head',)")
        object.__setattr__(self, "skip", tuple(self.skip))
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or not self.threshold >= 0:
            raise ValueError(f"Invalid threshold {self.threshold!r}: give LLM.int8()'s outlier threshold, a number >= 0 (6.0 by default, "
                             "as Transformers'; 0 turns the outlier decomposition off, as bitsandbytes' own default)")

    @classmethod
    def named(cls, name: str, *, compute_dtype: torch.dtype | None = torch.bfloat16) -> Quantization:
        """``nf4``, ``fp4`` or ``int8`` as QLoRA uses them: 4-bit with double quantization and bf16 compute.

        Raises:
            ValueError: another name (``TypeError`` for a value that is not a name), or an unknown ``compute_dtype``.
        """
        _check_kind(name)
        if name == "int8":
            return cls("int8")
        return cls(name, double_quant=True, compute_dtype=compute_dtype)

    @classmethod
    def from_config(cls, config: Any) -> Quantization | None:
        """The quantization a Hugging Face ``quantization_config`` asks for (a dict as in ``config.json``, or a
        ``BitsAndBytesConfig``); None when it asks for none.

        Raises:
            ValueError: a method other than bitsandbytes (GPTQ, AWQ, HQQ, torchao, ...), or bitsandbytes settings
                that are not 4-bit or 8-bit loading.
        """
        if config is None:
            return None
        data = config.to_dict() if hasattr(config, "to_dict") else dict(config) if isinstance(config, Mapping) else None
        if data is None:
            raise ValueError(f"Invalid quantization_config of type {type(config).__name__}: give a dict or a BitsAndBytesConfig")
        method = str(data.get("quant_method", "bitsandbytes"))
        if method != "bitsandbytes":
            raise ValueError(
                f"Cannot estimate quantization_config with quant_method={method!r}: only bitsandbytes 4-bit and 8-bit weights "
                "(load_in_4bit / load_in_8bit) are modelled; their layers hold other tensors and run other kernels. Plan the "
                "model unquantized (an upper bound for its weights), or drop the quantization_config"
            )
        skip = tuple(data.get("llm_int8_skip_modules") or ())
        if data.get("load_in_4bit") and data.get("load_in_8bit"):
            raise ValueError(
                "Invalid quantization_config: it asks for both load_in_4bit and load_in_8bit, which Transformers refuses (one "
                "quantization per weight); set one of them to false"
            )
        if data.get("load_in_4bit"):
            kind = str(data.get("bnb_4bit_quant_type", "fp4"))
            if kind not in ("nf4", "fp4"):
                raise ValueError(f"Invalid bnb_4bit_quant_type {kind!r} in quantization_config: use 'nf4' or 'fp4'")
            dtype = data.get("bnb_4bit_compute_dtype")
            compute = _DTYPES.get(str(dtype).replace("torch.", "")) if dtype is not None else None
            if dtype is not None and compute is None:
                raise ValueError(f"Invalid bnb_4bit_compute_dtype {dtype!r} in quantization_config: use float32, bfloat16 or float16")
            return cls(kind, double_quant=bool(data.get("bnb_4bit_use_double_quant", False)), compute_dtype=compute, skip=skip)
        if data.get("load_in_8bit"):
            return cls("int8", skip=skip, threshold=float(data.get("llm_int8_threshold", 6.0)))
        raise ValueError(
            "Invalid bitsandbytes quantization_config: it asks for neither load_in_4bit nor load_in_8bit; set one, or drop "
            "the quantization_config"
        )

    def describe(self) -> str:
        """In words, e.g. ``"bitsandbytes nf4, double quantization, compute bfloat16"``."""
        if self.kind == "int8":
            return f"bitsandbytes int8 (LLM.int8(), outlier threshold {self.threshold:g})"
        parts = [f"bitsandbytes {self.kind}"]
        if self.double_quant:
            parts.append("double quantization")
        parts.append(f"compute {str(self.compute_dtype).replace('torch.', '') if self.compute_dtype else 'in the input dtype'}")
        return ", ".join(parts)


def quantized_layer_types() -> tuple[type, ...]:
    """bitsandbytes' 4-bit and 8-bit linear classes where bitsandbytes has been imported, else none: no layer can
    be one before (so a model's modules are checked with ``isinstance``, and nothing is imported to check them)."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    return tuple(getattr(modules, name) for name in ("Linear4bit", "Linear8bitLt") if hasattr(modules, name)) if modules else ()


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` is a bitsandbytes 4-bit or 8-bit linear layer (without importing bitsandbytes)."""
    return isinstance(module, quantized_layer_types())


def quantization_of(model: nn.Module) -> Quantization | None:
    """The quantization of ``model``'s base weights: from its bitsandbytes layers, else from the
    ``quantization_config`` of its Hugging Face config (None when neither).

    Raises:
        ValueError: a quantization_config that is not bitsandbytes (see :meth:`Quantization.from_config`).
    """
    for module in model.modules():
        if not is_quantized(module):
            continue
        weight = module.weight
        if weight.dtype != torch.int8 and hasattr(weight, "quant_type"):
            state = getattr(weight, "quant_state", None)
            nested = bool(state.nested) if state is not None else bool(weight.compress_statistics)
            return Quantization(str(weight.quant_type), double_quant=nested, compute_dtype=getattr(module, "compute_dtype", None))
        return Quantization("int8", threshold=float(module.state.threshold))
    config = getattr(model, "config", None)
    return Quantization.from_config(getattr(config, "quantization_config", None)) if config is not None else None


def fsdp2_refused(model: nn.Module | None = None, *, quantization: Quantization | None = None) -> str | None:
    """Why FSDP2 (``fully_shard``: sharded over devices, or offloaded to host memory) is not planned for ``model``: its
    weights are quantized by bitsandbytes (None: they are not); or for a model to be quantized by ``quantization``.

    ``fully_shard`` makes each parameter a plain tensor sharded across the ranks. A bitsandbytes quantized weight
    then loses what it is: an 8-bit or uint8-stored 4-bit weight cannot be made a parameter that takes a gradient,
    and a 4-bit weight stored as a float (``bnb_4bit_quant_storage``, the FSDP-QLoRA setting for FSDP1) is gathered
    as a plain tensor without its quantization state, computing wrong values (bitsandbytes issue 1945, open with
    bitsandbytes 0.50, which gives its weights no FSDP2 hooks; Accelerate issue 3983)."""
    layer = None if model is None else next((m for m in model.modules() if is_quantized(m)), None)
    if layer is not None:  # read from the layer: sharded by FSDP2 already, its weight is a plain tensor without its kind
        kind = (getattr(layer.weight, "quant_type", None) or getattr(getattr(layer, "quant_state", None), "quant_type", None)
                or ("int8" if hasattr(layer, "state") else "4-bit"))
    else:  # a model to be quantized, or a config that asks for it
        quantization = quantization if model is None else quantization_of(model)
        kind = None if quantization is None else quantization.kind
    if kind is None:
        return None
    return (f"FSDP2 is not planned for weights quantized by bitsandbytes ({kind}): its fully_shard drops their "
            "quantization state (bitsandbytes issue 1945)")


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) or name.split(".")[-1] == s for s in skip)


def _heads(model: nn.Module) -> set[str]:
    """The output head's name(s), left unquantized by default as transformers leaves them (its weight is often
    tied to the input embedding, and quantizing it costs accuracy for little memory)."""
    out = getattr(model, "get_output_embeddings", None)
    head = out() if callable(out) else None
    return {name for name, m in model.named_modules() if head is not None and m is head}


def quantize(model: nn.Module, quantization: Quantization | str) -> nn.Module:
    """Replace ``model``'s linear layers by bitsandbytes quantized ones, in place, and return it.

    The linear layers are ``torch.nn.Linear`` ones, and Transformers' ``Conv1D`` (GPT-2's, a transposed linear layer,
    quantized transposed as Transformers' own 4-bit and 8-bit loading does). Layers named in ``quantization.skip`` and
    the output head stay as they are. Weights with data (on the CPU
    or a GPU) are quantized by bitsandbytes; weights on the meta device stay unquantized (the layer knows its
    quantization), and an estimate quantizes its fake copy of them (:func:`fake_quantized`), so a model too
    large for this machine is estimated as quantized. A model quantized already in the same scheme keeps its
    quantized layers (any linear layer left unquantized is quantized alike).

    Args:
        model: the model (its linear layers frozen by the replacement: quantized weights do not train).
        quantization: a :class:`Quantization`, or ``"nf4"``, ``"fp4"`` or ``"int8"`` (:meth:`Quantization.named`).

    Returns:
        ``model``, quantized.

    Raises:
        TypeError: ``model`` is not a module, or ``quantization`` neither a :class:`Quantization` nor a name.
        ValueError: an unknown name; a model quantized already in another scheme; a model with no linear layer to
            quantize. Refused before any layer changes.
        ImportError: bitsandbytes is not installed.

    Example:
        >>> model = autotune.quantize(model, "nf4")  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"Invalid model of type {type(model).__name__}: give the torch.nn.Module whose linear layers to quantize")
    if isinstance(quantization, str):
        q = Quantization.named(quantization)
    elif isinstance(quantization, Quantization):
        q = quantization
    else:
        raise TypeError(f"Invalid quantization {quantization!r} ({type(quantization).__name__}): give 'nf4', 'fp4' or 'int8', or an "
                        "autotune.memory.quantized.Quantization")
    bnb = bitsandbytes()
    already = next((m for m in model.modules() if is_quantized(m)), None)
    if already is not None:
        done = quantization_of(model)
        if done is not None and done.kind != q.kind:
            raise ValueError(
                f"Invalid quantization {q.kind!r} for {type(model).__name__}: its linear layers are quantized already "
                f"({done.describe()}), and a quantized weight cannot be quantized again to another scheme (its original values "
                f"are gone); quantize the unquantized model (built or loaded again) with {q.kind!r}, or keep {done.kind}"
            )
    skip = (*q.skip, *_heads(model))
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)  # GPT-2's linear layers, if transformers is loaded
    linear = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear or (conv1d is not None and type(m) is conv1d)]
    targets = [(name, m) for name, m in linear if not _skipped(name, skip)]
    if not targets and already is None:
        if linear:
            raise ValueError(
                f"Invalid quantization for {type(model).__name__}: its linear layers ({', '.join(name for name, _ in linear)}) are "
                "all skipped (the output head, quantization.skip), so nothing would change; skip fewer, or plan it unquantized"
            )
        raise ValueError(
            f"Invalid model {type(model).__name__} for quantize: it has no linear layer (torch.nn.Linear, or Transformers' Conv1D), "
            f"the only layers quantize replaces (by bitsandbytes {q.kind} ones), so nothing would change; give a model with "
            "linear layers, or plan this one unquantized"
        )
    for name, module in targets:
        weight = module.weight
        device = weight.device
        data = weight.data if type(module) is nn.Linear else weight.data.t().contiguous()  # Conv1D: in x out, as Transformers transposes it
        outputs, inputs = data.shape
        if q.kind == "int8":
            layer = bnb.nn.Linear8bitLt(inputs, outputs, bias=module.bias is not None, has_fp16_weights=False, threshold=q.threshold,
                                        device="meta")
            layer.weight = bnb.nn.Int8Params(data, requires_grad=False, has_fp16_weights=False)
        else:
            layer = bnb.nn.Linear4bit(inputs, outputs, bias=module.bias is not None, compute_dtype=q.compute_dtype,
                                      compress_statistics=q.double_quant, quant_type=q.kind, device="meta")
            layer.weight = bnb.nn.Params4bit(data, requires_grad=False, compress_statistics=q.double_quant, quant_type=q.kind,
                                             module=layer)
        if module.bias is not None:
            layer.bias = module.bias
        if device.type != "meta":
            with _quiet("bitsandbytes"):
                layer = layer.to(device)  # bitsandbytes quantizes when the weight reaches a device with data
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attribute, layer)
    return model


def is_quantized_weight(p: torch.Tensor) -> bool:
    """Whether ``p`` is a bitsandbytes quantized weight (its dtype is its packing's, not its values')."""
    if hasattr(p, "quant_type"):  # 4-bit, packed or (on the meta device) to be
        return True
    if getattr(p, "has_fp16_weights", True) is False and hasattr(p, "SCB"):  # 8-bit, int8 or (on the meta device) to be
        return True
    return p.dtype == torch.int8 and (hasattr(p, "SCB") or hasattr(p, "CB"))


def logical_numel(p: torch.Tensor) -> int:
    """The parameters ``p`` stands for: a 4-bit weight packs two in a byte (its quantization state knows the
    weight's shape)."""
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(p, "bnb_quantized", False):
        shape = state.shape
        return int(torch.Size(shape).numel())
    return p.numel()


def copy_memo(layers: Iterable[nn.Module]) -> dict[int, Any]:
    """Entries for ``copy.deepcopy``'s memo that keep the quantization state of a model's quantized ``layers`` out
    of a copy (an estimate's fake copy makes its own, :func:`fake_quantized`)."""
    memo: dict[int, Any] = {}
    for module in layers:
        if is_quantized(module):
            for held in (getattr(module.weight, "quant_state", None), getattr(module, "quant_state", None),
                         getattr(getattr(module, "state", None), "CB", None), getattr(getattr(module, "state", None), "SCB", None)):
                if held is not None:
                    memo[id(held)] = None
    return memo


def fake_quantized(made: nn.Module, original: nn.Module, fake: Any) -> None:
    """Give ``made``, the fake copy of the quantized layer ``original``, fake quantized weights, in place: a
    weight quantized already gets fake tensors of its shapes; one left unquantized (on the meta device) is
    quantized by bitsandbytes under the fake mode (its kernels have fake implementations), so its shapes are
    bitsandbytes' own. ``fake(t)`` makes a fake tensor like ``t``; call under the fake mode."""
    bnb = bitsandbytes()
    weight = original.weight
    if hasattr(weight, "quant_type"):  # 4-bit
        state = getattr(weight, "quant_state", None) or getattr(original, "quant_state", None)
        if state is not None and weight.bnb_quantized:
            data, state = fake(_plain(weight)), _fake_state(state, fake)
        else:
            _warm_codes(bnb)
            data, state = bnb.functional.quantize_4bit(fake(_plain(weight)), blocksize=weight.blocksize,
                                                       compress_statistics=weight.compress_statistics, quant_type=weight.quant_type,
                                                       quant_storage=weight.quant_storage)
        made.weight = _fake_parameter(data, quant_state=state, blocksize=weight.blocksize, compress_statistics=weight.compress_statistics,
                                      quant_type=weight.quant_type, quant_storage=weight.quant_storage, module=made, bnb_quantized=True)
        made.quant_state = state
        return
    scales = getattr(weight, "SCB", None)
    if scales is None:
        scales = original.state.SCB
    if weight.dtype == torch.int8 and scales is not None:
        data, scales = fake(_plain(weight)), fake(scales)
    else:  # on the meta device, not quantized yet: quantized as bitsandbytes quantizes it
        data, scales, _ = bnb.functional.int8_vectorwise_quant(fake(_plain(weight)).to(torch.float16))
    made.weight = _fake_parameter(data, CB=data, SCB=scales, has_fp16_weights=False)
    made.state.CB = made.state.SCB = None  # the forward takes them from the weight, as after quantizing


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """A bitsandbytes weight's data as a plain tensor, taken outside the fake mode: its parameter class's
    ``__torch_function__`` sends ``.data`` (a ``detach``) through the mode, which refuses that class on PyTorch
    2.11 (a CUDA estimate of a QLoRA model failed so on an H200)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunctionSubclass():
        return weight.data


def _fake_parameter(data: torch.Tensor, **attributes: Any) -> nn.Parameter:
    """A frozen fake parameter carrying a quantized weight's attributes (its quantization state): bitsandbytes'
    parameter classes cannot wrap a fake tensor, and its layers read only these attributes."""
    made = nn.Parameter(data, requires_grad=False)  # a fake tensor marked as a parameter
    for name, value in attributes.items():
        setattr(made, name, value)
    return made


def _fake_state(state: Any, fake: Any) -> Any:
    """A copy of a bitsandbytes ``QuantState`` whose tensors are fake."""
    import copy

    made = copy.copy(state)
    for name in ("absmax", "code", "offset"):
        value = getattr(state, name)
        if isinstance(value, torch.Tensor):
            setattr(made, name, fake(value))
    if state.state2 is not None:
        made.state2 = _fake_state(state.state2, fake)
    return made


def _warm_codes(bnb: Any) -> None:
    """bitsandbytes builds its 8-bit code once, with operations that read values: built here on real tensors
    first (outside the fake mode), quantizing under the fake mode finds it made."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        bnb.functional.quantize_blockwise(torch.zeros(256))
