"""What ``autotune report`` plans: the model, a loader of synthetic batches, the loss and the
optimizer, from the command line's arguments (the user's code called, its errors said in one line)."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autotune.cli.images import classifier_batch, tokens_per_image, vision_language_batch
from autotune.cli.parser import (
    UsageError,
    load_callable,
    parse_shape,
)
from autotune.probe.attention import supports

__all__ = ["call_user", "describe_batch", "first_line", "logits_of", "workload_from_args"]


def call_user(fn: Callable[[], Any], what: str, debug: bool) -> Any:
    """Call the user's factory; its error becomes a one-line usage error (``--debug``: the traceback)."""
    try:
        return fn()
    except UsageError:  # already the one line, with its fix
        raise
    except Exception as exc:
        if debug:
            raise
        raise UsageError(f"{what} raised {type(exc).__name__}: {first_line(exc)} (--debug shows the traceback)") from None


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def logits_of(output: Any) -> Any:
    """The logits in a model's output: the tensor itself, ``.logits``, ``["logits"]``, or a tuple's first."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def workload_from_args(args: argparse.Namespace, base_batch: int) -> tuple[Any, Any, Callable[[Any, Any], Any] | None, dict[str, Any]]:
    """Build (model, loader, loss_fn, description for the cache key) from the arguments: the model, then
    the user's loader, or inputs made from ``--input-shape`` with targets fitted to the model's output."""
    if args.hf_config:
        made = _config_workload(args)
        args.precision = args.precision or "fp32"
        return made
    args.precision = args.precision or "fp32"
    model = _checked_blocks(args, _with_lora(args, _as_asked(args, _model_from_args(args))))
    if args.loader:
        return (model, *_loader_from_args(args))
    inputs, names, describe, g = _inputs_from_args(args, base_batch)

    def call(model: Any, xs: Sequence[Any]) -> Any:
        return model(**dict(zip(names, xs))) if names else model(*xs)

    out = _first_output(args, model, call, inputs)
    return (model, *_targets_for(args, out, call, inputs, describe, base_batch, g))


def _model_from_args(args: argparse.Namespace) -> Any:
    from torch import nn

    if args.demo and not args.model:
        from autotune.cli.demo import demo_model

        model = demo_model()
    elif args.model:
        factory = load_callable(args.model, "MODEL")
        model = call_user(factory, f"MODEL {args.model!r}", args.debug)
    else:
        raise UsageError("Missing MODEL: give module:callable or path/file.py:callable, or --demo")
    if not isinstance(model, nn.Module):
        raise UsageError(f"Invalid MODEL {args.model!r}: it returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _as_asked(args: argparse.Namespace, model: Any) -> Any:
    """The model with fp32 weights (``--master-weights fp32``) and its linear layers quantized (``--quantize``), as asked."""
    import torch

    if args.master_weights == "fp32":
        model = model.to(torch.float32)
    if args.quantize:
        from autotune.memory.quantized import Quantization, quantize

        try:
            model = quantize(model, Quantization.named(args.quantize))
        except (ImportError, ValueError) as exc:  # bitsandbytes missing; a model with nothing to quantize
            raise UsageError(f"--quantize {args.quantize}: {exc}") from None
    _refuse_shard(args, model=model)
    return model


def _checked_blocks(args: argparse.Namespace, model: Any) -> Any:
    """The model, where ``--checkpointing N`` or ``auto`` can count its blocks (:func:`autotune.memory.checkpointing.settled`
    in the command line's words)."""
    from autotune.memory.checkpointing import blocks, own_switch

    if args.checkpointing is False or args.checkpointing == 0 or (args.checkpointing is True and own_switch(model)):
        return model
    total = len(blocks(model))
    if total == 0:
        flag = "--checkpointing" + ("" if args.checkpointing is True else f" {args.checkpointing}")
        raise UsageError(f"Invalid {flag}: {type(model).__name__} has no nn.ModuleList of blocks (or top-level nn.Sequential) to "
                         f"{'count' if flag != '--checkpointing' else 'checkpoint'}; leave it out, or checkpoint the blocks in the "
                         "model's own forward (torch.utils.checkpoint.checkpoint)")
    if args.checkpointing != "auto" and args.checkpointing > total:
        raise UsageError(f"Invalid --checkpointing {args.checkpointing}: {type(model).__name__} has {total} blocks; give a count from 0 "
                         f"to {total}, auto, or --checkpointing alone for every block")
    return model


def _refuse_shard(args: argparse.Namespace, *, model: Any = None, quantization: Any = None) -> None:
    """``--shard`` with weights quantized by bitsandbytes (``model``'s, or those ``quantization`` will make): refused
    (:func:`autotune.memory.quantized.fsdp2_refused`)."""
    from autotune.memory.quantized import fsdp2_refused

    refused = None if args.shard is None else fsdp2_refused(model, quantization=quantization)
    if refused:
        raise UsageError(f"Invalid --shard {args.shard}: {refused}; plan the quantized model on one device (without --shard), or "
                         "shard it unquantized (without --quantize, or a config without a quantization_config)")


def _config_workload(args: argparse.Namespace) -> tuple[Any, Any, Callable[[Any, Any], Any], dict[str, Any]]:
    """The model of a Hugging Face config, built on the meta device (no weights: an 8B model costs no memory) in
    the config's dtype (fp32 with ``--master-weights fp32``), its linear layers quantized as its
    ``quantization_config`` or ``--quantize`` asks, LoRA on it if asked, and one batch of ``--tokens`` token ids
    with the labels its head's loss needs."""
    import json
    from pathlib import Path

    import torch

    path = Path(args.hf_config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: no such file{' (config.json) in that directory' if path.is_dir() else ''}")
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: not a JSON config ({first_line(exc)})") from None
    if not isinstance(data, dict):
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: a config is a JSON object, this is a {type(data).__name__}")
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf-config needs transformers: pip install 'torch-autotune[llm]' (or pip install transformers)") from None
    kind = data.get("model_type")
    if isinstance(kind, str) and kind not in transformers.CONFIG_MAPPING:
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: its model_type {kind!r} is not one this transformers "
                         f"({transformers.__version__}) knows; upgrade transformers (pip install -U transformers), or give the "
                         "config of a model it has")
    _check_shape(args, transformers, data)
    quantization = _quantization_of(args, data)
    _refuse_shard(args, quantization=quantization)  # before the model is built
    dtype = getattr(torch, str(data.get("dtype") or data.get("torch_dtype") or "float32").replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: its dtype {data.get('dtype') or data.get('torch_dtype')!r} is not a floating-point dtype")
    weights = torch.float32 if args.master_weights == "fp32" else dtype
    if args.precision is None and args.master_weights == "fp32" and dtype in (torch.bfloat16, torch.float16):
        args.precision = "bf16" if dtype == torch.bfloat16 else "fp16"  # fp32 master weights under the config's dtype's autocast

    def build() -> tuple[Any, tuple[int | None, str | None]]:
        if "model_type" not in data:
            raise ValueError("the config has no model_type")
        fields = {k: v for k, v in data.items() if k != "quantization_config"}
        config = transformers.AutoConfig.for_model(**fields)
        cls = _model_class(transformers, data, config)
        attention = _attention(args, cls, transformers.__version__)
        # FlashAttention-2 and FlexAttention need their kernels to build; the model is built with SDPA (eager where it
        # has none) and told which it runs, and the estimate stands in for it (autotune.probe.attention)
        fused = attention in ("flash_attention_2", "flex_attention")
        config._attn_implementation = ("sdpa" if supports(cls, "sdpa") is not False else "eager") if fused else attention
        with torch.device("meta"):
            model = cls(config).to(weights)
        model.config._attn_implementation = attention
        # an image's tokens, counted while every layer still runs on the meta device
        counted = tokens_per_image(model) if args.images != 0 else (None, None)
        if quantization is not None:
            from autotune.memory.quantized import quantize

            quantize(model, quantization)
        return model, counted

    from autotune.planning.lengths import max_length
    from autotune.planning.setting import attention_of

    model, counted = call_user(build, f"--hf-config {args.hf_config!r}", args.debug)
    model = _checked_blocks(args, _with_lora(args, model))
    described = {"hf_config": data, "tokens": None, "lora": args.lora, "lora_modules": args.lora_modules, "quantize": args.quantize,
                 "master_weights": args.master_weights, "attention": attention_of(model), "fused_ce": args.fused_ce, "packing": args.packing}
    image = classifier_batch(args, model)
    if image is not None:  # an image classifier: a sample is an image, not --tokens token ids
        return model, [image], _own_loss, described
    longest = max_length(model)
    tokens = args.tokens or min(2048, longest or 2048)
    if longest is not None and tokens > longest:
        raise UsageError(f"Invalid --tokens {tokens}: the model takes 1 to {longest} tokens a sample")
    text = getattr(model.config, "get_text_config", lambda: model.config)()  # a vision-language model's: its language model's
    vocab = int(getattr(text, "vocab_size", None) or args.vocab_size)
    batch, loss_fn, head = _batch_for_head(model, tokens, vocab)
    batch, note = vision_language_batch(args, model, batch, counted)
    described = {**described, "images": args.images, "note": note}
    if args.fused_ce:
        if head != "causal LM":
            raise UsageError(f"--fused-ce fuses a causal LM's head and loss; {type(model).__name__} is a {head} model")
        from autotune.losses import fused_causal_lm_loss

        loss_fn = fused_causal_lm_loss
    if args.packing:
        if head != "causal LM":
            raise UsageError(f"--packing packs a causal LM's sequences; {type(model).__name__} is a {head} model")
        loss_fn = _packed(loss_fn, tokens)
    return model, [batch], loss_fn, {**described, "tokens": tokens}


def _attention(args: argparse.Namespace, cls: Any, version: str) -> str:
    """The attention kernel to build ``cls`` with: ``--attention``, else Transformers' own default for the class (SDPA
    where it has it, else eager: Gemma-2, BLOOM, MPT); a kernel the class lacks refused, with the ones it has."""
    if args.attention is None:
        return "eager" if supports(cls, "sdpa") is False else "sdpa"
    if supports(cls, args.attention) is False:
        has = " or ".join(a for a in ("sdpa", "flash_attention_2", "flex_attention", "eager") if supports(cls, a))
        raise UsageError(f"Invalid --attention {args.attention}: Transformers {version} has no {args.attention} for "
                         f"{cls.__name__}; give --attention {has}, or leave it out for the model's default")
    return args.attention


# The fields that shape a model, by Transformers' common names (a config class may spell them its own way: its
# ``attribute_map``, e.g. GPT-2's ``n_embd``): a config without one would be built with its class's default.
SHAPE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def _check_shape(args: argparse.Namespace, transformers: Any, data: dict[str, Any]) -> None:
    """Refuse a config missing a field of the model's shape that its config class has (it would be filled with the
    class's default, e.g. ``LlamaConfig``'s 4096 and 32 layers, and another model estimated), naming the fields and the fix."""
    kind = data.get("model_type")
    if not isinstance(kind, str) or kind not in transformers.CONFIG_MAPPING:
        return  # no model_type, or one this transformers does not know: said when the model is built
    cls = transformers.CONFIG_MAPPING[kind]  # a lazy mapping: its .get does not import the class
    own = vars(cls())
    missing = {}
    for field in SHAPE_FIELDS:
        name = cls.attribute_map.get(field, field)
        if name in own and field not in data and name not in data:
            missing[name] = own[name]
    if missing:
        names = ", ".join(missing)
        defaults = ", ".join(f"{k}={v!r}" for k, v in missing.items())
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: it has no {names} (the model's shape; {cls.__name__} would fill "
                         f"in its defaults, {defaults}, and estimate another model); give the model's own config.json, or add "
                         f"{'these fields' if len(missing) > 1 else 'this field'}")


def _quantization_of(args: argparse.Namespace, data: dict[str, Any]) -> Any:
    """The quantization ``--quantize`` or the config's ``quantization_config`` asks for (the flag over the config), or None."""
    from autotune.memory.quantized import Quantization

    if args.quantize:
        import torch

        dtype = str(data.get("dtype") or data.get("torch_dtype") or "bfloat16").replace("torch.", "")
        compute = {"float16": torch.float16}.get(dtype, torch.bfloat16)
        return Quantization.named(args.quantize, compute_dtype=compute)
    try:
        return Quantization.from_config(data.get("quantization_config"))
    except ValueError as exc:
        raise UsageError(f"Invalid --hf-config {args.hf_config!r}: {exc}") from None


def _model_class(transformers: Any, data: dict[str, Any], config: Any) -> Any:
    """What makes the model of ``config``: the class the config names (``architectures``), else its causal LM; an
    unknown name refused whole, with the fix."""
    names = list(data.get("architectures") or [])
    if not names:  # the config's causal LM, as AutoModelForCausalLM would build it
        found = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
        if found is not None:
            return found
        others = [m.get(type(config), None) for m in (transformers.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING, transformers.MODEL_FOR_MASKED_LM_MAPPING,
                                                      transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING,
                                                      getattr(transformers, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING", {}))]
        example = next((c.__name__ for c in others if c is not None), None)
        raise UsageError(f"Invalid --hf-config: it names no \"architectures\" and {type(config).__name__} has no causal LM to build "
                         f"in its place; add the model's class, e.g. \"architectures\": [\"{example or 'LlamaForCausalLM'}\"]")
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise UsageError(f"Invalid --hf-config: its architecture {names[0]!r} is not a class of this transformers "
                         f"({transformers.__version__}); upgrade transformers, or set \"architectures\" to one it has "
                         "(e.g. LlamaForCausalLM)")
    return cls


def _batch_for_head(model: Any, tokens: int, vocab: int) -> tuple[dict[str, Any], Callable[[Any, Any], Any], str]:
    """One sample of ``tokens`` token ids and the labels the model's head computes its loss from: token ids for a causal
    or masked LM, a class for sequence classification, a class per token for token classification, target ids for a
    sequence-to-sequence model; and the loss (the model's own), and what the head is."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens), generator=g)
    batch: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    base = getattr(model, "get_base_model", lambda: model)()  # under PEFT's wrapper
    name = type(base).__name__
    labels = max(1, int(getattr(model.config, "num_labels", 2) or 2))
    if name.endswith("ForSequenceClassification"):
        head = "sequence classification"
        batch["labels"] = torch.randint(0, labels, (1,), generator=g)
    elif name.endswith("ForTokenClassification"):
        head = "token classification"
        batch["labels"] = torch.randint(0, labels, (1, tokens), generator=g)
    elif getattr(model.config, "is_encoder_decoder", False):
        head = "sequence-to-sequence"
        batch["labels"] = ids.clone()
    elif name.endswith("ForMaskedLM"):
        head = "masked LM"
        batch["labels"] = ids.clone()
    else:
        head = "causal LM"
        batch["labels"] = ids.clone()

    return batch, _own_loss, head


def _own_loss(model: Any, batch: Any) -> Any:
    """The model's own loss on a batch of its keywords."""
    return model(**batch).loss


def _packed(loss_fn: Callable[[Any, Any], Any], tokens: int) -> Callable[[Any, Any], Any]:
    """``loss_fn`` on padding-free packed batches, as TRL's ``packing=True`` with its flattening collator makes them:
    a micro-batch's rows (each a packed sequence of ``tokens`` tokens) joined into one row, the positions restarting
    at each sequence, no label predicted across a boundary."""
    import torch

    def packed(model: Any, batch: Any) -> Any:
        rows, length = batch["input_ids"].shape
        labels = batch["labels"].clone()
        labels[:, 0] = -100  # a sequence's first token is not predicted from the one before it
        flat = {"input_ids": batch["input_ids"].reshape(1, -1), "labels": labels.reshape(1, -1),
                "position_ids": torch.arange(length, device=batch["input_ids"].device).repeat(rows).reshape(1, -1)}
        return loss_fn(model, flat)

    packed.setting = f"padding-free packing: a micro-batch of n rows is one row of n x {tokens} tokens"  # type: ignore[attr-defined]
    return packed


def _with_lora(args: argparse.Namespace, model: Any) -> Any:
    """``model`` with LoRA adapters of rank ``--lora`` on ``--lora-modules`` (PEFT's default for the architecture
    without it), the rest frozen."""
    if args.lora is None:
        if args.lora_modules:
            raise UsageError(f"--lora-modules {args.lora_modules} names the modules LoRA adapts: give --lora R too")
        return model
    if args.lora < 1:
        raise UsageError(f"Invalid --lora {args.lora}: give the adapters' rank, at least 1 (e.g. 16)")
    try:
        from autotune.memory.quantized import bitsandbytes

        with contextlib.suppress(ImportError):
            bitsandbytes()  # imported quietly first: PEFT imports it, and it logs about an optional kernel package
        import peft
    except ImportError:
        raise UsageError("--lora needs peft: pip install 'torch-autotune[llm]' (or pip install peft)") from None
    if args.lora_modules:
        modules: Any = "all-linear" if args.lora_modules == "all-linear" else [m.strip() for m in args.lora_modules.split(",") if m.strip()]
    else:
        modules = _default_lora_modules(args, model)

    def wrap() -> Any:
        with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns (not the user's doing)
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, peft.LoraConfig(r=args.lora, target_modules=modules))

    return call_user(wrap, f"--lora {args.lora}" + (f" --lora-modules {args.lora_modules}" if modules else ""), args.debug)


def _default_lora_modules(args: argparse.Namespace, model: Any) -> Any:
    """The modules LoRA adapts without ``--lora-modules``: PEFT's default for the model's architecture (its table by
    ``model_type``), given to PEFT by name, as it would pick them (with Transformers 5 PEFT empties its own default for
    some mixture-of-experts models, such as Mixtral, before reading it); an architecture it has no default for, or whose
    default names no module of the model, refused with the fix."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults
    from torch import nn

    kind = getattr(getattr(model, "config", None), "model_type", None)
    found = defaults.get(kind) if kind else None
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if found is None or (not isinstance(found, str) and not names & set(found)):
        which = f"{kind!r} models" if kind else f"{type(model).__name__} (not a Transformers model)"
        why = f"PEFT's default modules for {which} ({', '.join(found)}) are not in the model" if found else f"PEFT has no default modules for {which}"
        linear = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)))
        example = ",".join(n for n in linear if n not in ("lm_head", "score", "classifier"))[:80].rsplit(",", 1)[0] or "q_proj,v_proj"
        raise UsageError(f"Invalid --lora {args.lora} without --lora-modules: {why}; name the modules to adapt with --lora-modules "
                         f"(e.g. --lora-modules all-linear, or some of its linear layers: {example})")
    return found if isinstance(found, str) else list(found)


def _loader_from_args(args: argparse.Namespace) -> tuple[Any, None, dict[str, Any]]:
    """The user's loader (an iterator's first batches kept: the probe looks at them), checked to yield a batch."""
    from autotune.checks import is_one_shot

    made = call_user(load_callable(args.loader, "--loader"), f"--loader {args.loader!r}", args.debug)
    if made is None or not hasattr(made, "__iter__"):
        raise UsageError(f"Invalid --loader {args.loader!r}: it returned {type(made).__name__}; return an iterable of batches (a DataLoader or a list)")
    # An iterator can be looked at once: keep the batches the probe looks at.
    loader = list(itertools.islice(made, 8)) if is_one_shot(made) else made
    try:
        first = next(iter(loader), None)
    except Exception as exc:
        if args.debug:
            raise
        raise UsageError(f"Invalid --loader {args.loader!r}: iterating it raised {type(exc).__name__}: {first_line(exc)}") from None
    if first is None:
        raise UsageError(f"Invalid --loader {args.loader!r}: it yielded no batches")
    return loader, None, {"loader": args.loader, "first": describe_batch(first)}


def _inputs_from_args(args: argparse.Namespace, base_batch: int) -> tuple[list[Any], list[str], dict[str, Any], Any]:
    """``base_batch`` samples of each ``--input-shape`` and ``--input-dtype`` (token ids below ``--vocab-size``),
    the ``--input-name`` of each, their description, and the generator that drew them (the targets' next)."""
    import torch

    shapes = [parse_shape(s) for s in (args.input_shape or [])]
    if not shapes:
        raise UsageError("Missing --input-shape: give the per-sample input shape (e.g. 3,224,224), or --loader")
    dtypes = args.input_dtype or ["float32"]
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError(f"Invalid --input-dtype: {len(dtypes)} given for {len(shapes)} --input-shape; give one, or one per input")
    names = args.input_name or []
    if names and len(names) != len(shapes):
        raise UsageError(f"Invalid --input-name: {len(names)} given for {len(shapes)} --input-shape; give one name per input")
    if len(set(names)) != len(names):
        raise UsageError(f"Invalid --input-name: {names} repeats a name")
    if args.vocab_size < 1:
        raise UsageError(f"Invalid --vocab-size {args.vocab_size}: it must be at least 1")
    if args.num_classes is not None and args.num_classes < 1:
        raise UsageError(f"Invalid --num-classes {args.num_classes}: it must be at least 1")
    g = torch.Generator().manual_seed(0)
    inputs = []
    for shape, name in zip(shapes, dtypes):
        if name == "mask":
            inputs.append(torch.ones((base_batch, *shape), dtype=torch.long))
            continue
        dtype = {"long": torch.long, "int": torch.int32}.get(name) or getattr(torch, name)
        if dtype in (torch.long, torch.int32):
            inputs.append(torch.randint(0, args.vocab_size, (base_batch, *shape), generator=g, dtype=dtype))
        elif dtype == torch.bool:
            inputs.append(torch.rand((base_batch, *shape), generator=g) > 0.5)
        else:
            inputs.append(torch.randn((base_batch, *shape), generator=g).to(dtype))
    describe = {"inputs": [[list(s), d] for s, d in zip(shapes, dtypes)], "names": names, "vocab": args.vocab_size}
    return inputs, names, describe, g


def _first_output(args: argparse.Namespace, model: Any, call: Callable[[Any, Sequence[Any]], Any], inputs: list[Any]) -> Any:
    """One forward on the first two samples: what the output is tells which targets to make."""
    import torch
    from torch import nn

    from autotune.memory.quantized import quantized_layer_types

    dtypes = args.input_dtype or ["float32"]
    types = quantized_layer_types()
    with torch.no_grad():
        was_training = model.training
        if not (types and any(isinstance(m, types) for m in model.modules())):
            model.eval()  # a quantized model stays in training mode: for inference bitsandbytes repacks its CPU weights in place
        try:
            return call(model, [t[:2] for t in inputs])
        except IndexError as exc:
            if any(d in ("long", "int") for d in dtypes) and "index out of range" in str(exc):
                sizes = sorted({m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)})
                raise UsageError(
                    f"Invalid --vocab-size {args.vocab_size}: token ids up to {args.vocab_size - 1} do not fit an "
                    f"embedding of the model (sizes {sizes}); use --vocab-size at most its vocabulary"
                ) from None
            raise UsageError(f"The model failed on inputs of shape {[tuple(t.shape[1:]) for t in inputs]} (IndexError: {first_line(exc)}); check --input-shape and --input-dtype") from None
        except Exception as exc:
            if args.debug:
                raise
            raise UsageError(f"The model failed on inputs of shape {[tuple(t.shape[1:]) for t in inputs]} ({type(exc).__name__}: {first_line(exc)}); check --input-shape, --input-dtype and --input-name") from None
        finally:
            model.train(was_training)


def _targets_for(args: argparse.Namespace, out: Any, call: Callable[[Any, Sequence[Any]], Any], inputs: list[Any],
                 describe: dict[str, Any], base_batch: int, g: Any) -> tuple[Any, Callable[[Any, Any], Any], dict[str, Any]]:
    """The loader (one batch: the inputs and targets) and the loss: the model's own loss when its output
    is one, else cross-entropy on class targets (or ``--regression``: mean squared error)."""
    import torch
    from torch import nn

    from autotune.step import _output_loss

    try:
        _output_loss(out)
        own_loss = not (isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[0] == 2 and out.numel() > 1)
    except TypeError:
        own_loss = False
    if own_loss and args.num_classes is None and not args.regression:
        def loss_fn(model: Any, batch: Any) -> Any:
            return _output_loss(call(model, batch))

        return [tuple(inputs)], loss_fn, {**describe, "targets": "own loss"}
    logits = logits_of(out)
    if logits is None or logits.dim() < 2:
        raise UsageError(
            f"The model's output ({type(out).__name__}) is neither a loss nor logits with a batch dimension "
            "(a tensor, .logits or ['logits']): pass --loader with real batches"
        )
    if args.regression:
        targets = torch.randn((base_batch, *logits.shape[1:]), generator=g)

        def loss_fn(model: Any, batch: Any) -> Any:
            return nn.functional.mse_loss(logits_of(call(model, batch[:-1])), batch[-1])
    else:
        classes = args.num_classes or logits.shape[-1]
        if logits.shape[-1] != classes:
            raise UsageError(f"Invalid --num-classes {classes}: the model's output has {logits.shape[-1]} logits in its last dimension")
        targets = torch.randint(0, classes, (base_batch, *logits.shape[1:-1]), generator=g)

        def loss_fn(model: Any, batch: Any) -> Any:
            out = logits_of(call(model, batch[:-1]))
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[-1].reshape(-1))

    return [(*inputs, targets)], loss_fn, {**describe, "targets": [list(targets.shape[1:]), str(targets.dtype)]}


def describe_batch(batch: Any) -> Any:
    from autotune import batches as B

    return [[list(t.shape), str(t.dtype)] for t in B.tensors(batch)]
