"""The synthetic batches of ``--hf-config`` models that take images: an image classifier's (one image and a class) and
a vision-language model's (a sample of ``--tokens`` tokens, an image's placeholder tokens among them, the image beside).

A vision-language model (LLaVA, Gemma-3, PaliGemma, Mistral-3 and their kin in Transformers) runs its vision
tower on each image, projects the features to the language model's width and puts them in place of the image's
placeholder tokens, so an image costs the tower's activations and a run of the sample's tokens. How many tokens an image
becomes is the model's own (Gemma-3's 256, LLaVA-1.5's 576, a Mistral-3 image's patches merged): it is read from the
model itself, by running its ``get_image_features`` on an image of the vision tower's size on fake tensors, as an
estimate runs the model (a model without weights costs nothing). Its labels are -100 there, as the vision-language
collators set them. Qwen2-VL and its kin, and Idefics-3 and SmolVLM, are not modelled (:func:`_unsupported` says why).
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from autotune.cli.parser import UsageError
from autotune.planning.setting import image_placeholder

__all__ = ["classifier_batch", "tokens_per_image", "vision_language_batch"]


def classifier_batch(args: argparse.Namespace, model: Any) -> dict[str, Any] | None:
    """For an image classifier (its main input ``pixel_values``): one image of the config's size and channels (224 and 3
    where it names none) and a class; None for a model of token ids. The flags of token inputs are refused."""
    import torch

    base = getattr(model, "get_base_model", lambda: model)()  # under PEFT's wrapper
    if getattr(base, "main_input_name", "input_ids") != "pixel_values":
        return None
    name = type(base).__name__
    if not name.endswith("ForImageClassification"):
        raise UsageError(f"Invalid --hf-config: {name} takes images, and only an image classifier's batch is made here (its "
                         "pixel_values and a class); give the config of a ...ForImageClassification, or MODEL and --loader")
    config = model.config
    height, width = _side(getattr(config, "image_size", 224))
    channels = int(getattr(config, "num_channels", 3))
    given = [flag for flag, on in (("--tokens", args.tokens is not None), ("--fused-ce", args.fused_ce), ("--packing", args.packing),
                                   (f"--images {args.images}", args.images is not None)) if on]
    if given:
        raise UsageError(f"{', '.join(given)}: {name} takes images ({channels}x{height}x{width} pixel_values), not token ids; "
                         f"leave {'them' if len(given) > 1 else 'it'} out")
    g = torch.Generator().manual_seed(0)
    labels = max(1, int(getattr(config, "num_labels", 2) or 2))
    return {"pixel_values": torch.randn(1, channels, height, width, generator=g), "labels": torch.randint(0, labels, (1,), generator=g)}


def vision_language_batch(args: argparse.Namespace, model: Any, batch: dict[str, Any],
                          counted: tuple[int | None, str | None]) -> tuple[dict[str, Any], str | None]:
    """``batch`` (one sample of token ids and labels) with an image in it (``--images``: 1, the default for a
    vision-language model, or 0): its placeholder tokens at the sample's start (labels -100) and its ``pixel_values`` of
    the vision tower's size; and a note where the model takes images but the batch has none. A model without a vision
    tower gets ``batch`` as it was (``--images`` refused); a count the model's batches cannot hold is refused, with why and the fix. ``counted``:
    :func:`tokens_per_image` of the model before it was quantized."""
    import torch

    base = getattr(model, "get_base_model", lambda: model)()  # under PEFT's wrapper
    name, config = type(base).__name__, base.config
    vision = getattr(config, "vision_config", None)
    placeholder = image_placeholder(config)
    if vision is None:
        if args.images:
            raise UsageError(f"Invalid --images {args.images}: {name} takes no images (its config has no vision tower); leave --images out")
        return batch, None
    if args.images == 0:
        return batch, None
    params = inspect.signature(base.forward).parameters
    each, why = counted
    if why is None and placeholder is None:
        why = f"{name}'s config names no image placeholder token (image_token_id), which marks where an image's features go"
    if why is not None or each is None:
        if args.images is not None:
            raise UsageError(f"Invalid --images {args.images}: {why}; give --images 0 to plan on text alone")
        return batch, f"planned on text alone (no image in the batch): {why}; the vision tower's weights are held, its activations not counted"
    if args.images is not None and args.images > 1:  # (images, channels, height, width): a micro-batch's first dim would not be its samples
        raise UsageError(f"Invalid --images {args.images}: {name} takes its images as one tensor of every image (not one row a sample), "
                         "which a micro-batch cannot be cut from; give --images 1 (or 0)")
    for flag, on in (("--packing", args.packing), ("--tokens max", getattr(args, "longest", False))):
        if on:
            raise UsageError(f"{flag} plans text samples; {name}'s samples hold an image here: give --images 0 for text alone, "
                             f"or leave {flag} out")
    pixels, extra = _pixel_values(vision, _features_taking(base))
    tokens = int(batch["input_ids"].shape[1])
    if each >= tokens:
        raise UsageError(f"Invalid --tokens {tokens}: an image of {name} takes {each} tokens of the sample, which leaves no text; "
                         f"give --tokens {each + 512} or more (or --images 0)")
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    ids[ids == placeholder] = 0  # the text holds no placeholder of its own
    ids[:, :each] = placeholder
    labels[:, :each] = -100
    made = {"input_ids": ids, "attention_mask": batch["attention_mask"], "pixel_values": pixels,
            **{k: v for k, v in extra.items() if k in params}, "labels": labels}
    if "token_type_ids" in params:  # Gemma-3, PaliGemma: 1 on an image's tokens (attended both ways)
        made["token_type_ids"] = (ids == placeholder).long()
    return made, None


def tokens_per_image(model: Any) -> tuple[int | None, str | None]:
    """The tokens one image of the vision tower's size becomes in a vision-language model, and why it cannot be said
    (``(None, None)`` for a model without a vision tower): its ``get_image_features`` run on one image as an estimate
    runs the model (fake tensors: shapes, and the values of integer tensors such as an image's size), its projected
    features over the language model's width. Run it on the model as built, before its layers are quantized."""
    import torch

    from autotune.probe.fakes import Counter, FakeCopy

    base = getattr(model, "get_base_model", lambda: model)()
    vision = getattr(base.config, "vision_config", None)
    if vision is None:
        return None, None
    why = _unsupported(base, inspect.signature(base.forward).parameters)
    if why is not None:
        return None, why
    pixels, extra = _pixel_values(vision, _features_taking(base))
    fake = FakeCopy(base)
    try:
        with torch.no_grad(), fake.mode, Counter("cpu"):
            out = fake.model.get_image_features(pixel_values=torch.empty(pixels.shape), **extra)
    except Exception as exc:  # a tower that picks its images by their pixels' values (Idefics-3's nonzero)
        return None, f"{type(base).__name__}'s vision tower does not run on an image without values ({type(exc).__name__}: {exc})"[:300]
    return _feature_tokens(out, base.config), None


def _unsupported(base: Any, params: Any) -> str | None:
    """Why this model's image batch is not made here (None where it is)."""
    name = type(base).__name__
    if "image_grid_thw" in params:  # Qwen2-VL and its kin: every image's patches in one tensor, their grid beside it
        return (f"{name} takes every image's patches in one tensor (pixel_values and image_grid_thw), not one row a sample, "
                "which a micro-batch cannot be cut from")
    if "pixel_attention_mask" in params:  # Idefics-3, SmolVLM: the padding images found by their pixels (all zeros)
        return f"{name} finds its images by their pixels' values (a padding image is all zeros), which an estimate without values cannot follow"
    if not callable(getattr(base, "get_image_features", None)):
        return f"{name} reads its images its own way (no get_image_features), which is not modelled here"
    return None


def _features_taking(base: Any) -> Any:
    return inspect.signature(base.get_image_features).parameters


def _side(size: Any) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else tuple(int(s) for s in size)[-2:]  # type: ignore[return-value]


def _pixel_values(vision: Any, features: Any) -> tuple[Any, dict[str, Any]]:
    """An image of the vision tower's size and channels (random pixels), as its ``get_image_features`` takes it, and its
    size where it asks for it (Mistral-3's Pixtral tower, which takes any size and reads it)."""
    import torch

    height, width = _side(getattr(vision, "image_size", 224))
    channels = int(next((v for v in (getattr(vision, k, None) for k in ("num_channels", "in_channels", "in_chans")) if v), 3))
    extra: dict[str, Any] = {}
    if "image_sizes" in features and features["image_sizes"].default is inspect.Parameter.empty:
        extra["image_sizes"] = torch.tensor([[height, width]])
    return torch.randn(1, channels, height, width, generator=torch.Generator().manual_seed(1)), extra


def _feature_tokens(out: Any, config: Any) -> int:
    """The tokens ``get_image_features``' output stands for: its projected features (a tensor, or one per image) over
    the language model's width."""
    import torch

    feats = out if torch.is_tensor(out) or isinstance(out, (list, tuple)) else getattr(out, "pooler_output", None)
    if feats is None:
        feats = out.last_hidden_state
    parts = list(feats) if isinstance(feats, (list, tuple)) else [feats]
    return sum(int(p.numel()) for p in parts) // int(config.get_text_config().hidden_size)
