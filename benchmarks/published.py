"""The CUDA estimate against peaks others measured on real GPUs and published: each case rebuilt from its
public configuration and code on the meta device (no weights), estimated for its GPU, and the ratio
estimate / published printed beside its source.

Sources (each case says which, what its figure is, and how it was taken):

- ``litgpt``: LitGPT's resource tables (``tutorials/resource-tables.md``, added in commit 0cc02afa,
  measured with lit-gpt at commit 8641822 on an A100-SXM4-40GB, PyTorch 2.1.0, bitsandbytes 0.41.1).
  ``finetune/lora.py`` prints ``torch.cuda.max_memory_allocated() / 1e9`` after the run: bf16-true weights,
  LoRA r=8, alpha 16, dropout 0.05 on the query and value projections, AdamW (bitsandbytes' paged AdamW with a
  quantized base), the lm head's logits in chunks of 128 tokens and cross-entropy per chunk, the longest
  Alpaca sample first (phi-1.5 1044 tokens, StableLM-alpha 1034, Llama 2 1304) and every sample of a
  micro-batch padded to it. The run's procedure is reproduced with it (:func:`fabric_module`, :class:`Loop`): the
  model goes through Lightning Fabric's ``setup_module``, whose wrapper converts every floating output to the
  default dtype (the bf16 logits come back as fp32 copies), and the loop's ``logits`` holds them through the
  backward until the next iteration's forward has returned.
- ``hf-perf``: Transformers' single-GPU training page (``docs/source/en/perf_train_gpu_one.mdx`` at 0016acf7):
  BERT-large sequence classification at 512 tokens on a V100-16GB, the Trainer's settings of the time; the figure
  is NVML's used memory after training, so the estimate's reserved bytes and the 1343 MiB the page measured for
  the CUDA context are compared with it.
- ``fms``: fms-acceleration's A100-80GB references (``scripts/benchmarks/refs/a100_80gb.csv`` at 24bdadb):
  Mistral-7B full and LoRA fine-tunes, bf16, gradient checkpointing, packed rows of 4096 tokens; the figure is the
  Trainer's ``max_memory_allocated`` in bytes.

Model code: LitGPT's figures were measured on lit-gpt's own model code at commit 8641822. Where a checkout of it
is given (``--litgpt DIR``, or the ``LITGPT_DIR`` variable; ``git clone https://github.com/Lightning-AI/litgpt
&& git -C litgpt checkout 8641822``), that code is estimated; Transformers' model of the same shape is
estimated beside it, with the same LoRA and the same chunked loss.

    python benchmarks/published.py                        # Transformers' models; a few minutes on 2 cores
    python benchmarks/published.py --litgpt ../litgpt     # lit-gpt's code too
    python benchmarks/published.py --cases llama-2-7b     # some cases (their ids' first words)
    python benchmarks/published.py --later                # LitGPT's cases at a later iteration (see Loop)

``measure()`` runs a case's first training step on a CUDA device with random weights (``gpu_validate.py``
calls it), so that a lent GPU checks the estimate against the same code's real step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

GB = 1e9
LORA = {"r": 8, "alpha": 16, "dropout": 0.05}  # finetune/lora.py at 8641822
CHUNK = 128  # lm_head_chunk_size in finetune/lora.py


@dataclass(frozen=True)
class Source:
    name: str
    where: str
    gpu: str
    figure: str  # what the published number measures


SOURCES = {
    "litgpt": Source("LitGPT resource tables", "github.com/Lightning-AI/litgpt tutorials/resource-tables.md @ 0cc02afa (lit-gpt 8641822)",
                     "A100-SXM4-40GB, PyTorch 2.1.0+cu121", "max_memory_allocated / 1e9 over the run"),
    "hf-perf": Source("Transformers' single-GPU training page", "github.com/huggingface/transformers docs/source/en/perf_train_gpu_one.mdx @ 0016acf7",
                      "V100-SXM2-16GB, CUDA 11.2", "NVML used MiB after training: the CUDA context (1343 MiB, measured on the page) "
                      "and the caching allocator's reserved bytes"),
    "fms": Source("fms-acceleration's A100-80GB references", "github.com/foundation-model-stack/fms-acceleration "
                  "scripts/benchmarks/refs/a100_80gb.csv @ 24bdadb", "A100-80GB, PyTorch 2.4.1, transformers 4.48.1, peft 0.13.2",
                  "the Trainer's mem_peak_torch_mem_alloc_in_bytes (max_memory_allocated), exact bytes"),
}
UNITS = {"litgpt": 1e9, "hf-perf": 2**20, "fms": 1.0}  # bytes in a published unit
CONTEXT_ON_THE_PAGE = 1343 * 2**20  # hf-perf: "GPU memory occupied: 1343 MB" once torch has the CUDA context


@dataclass(frozen=True)
class Shape:
    """A model as lit-gpt names it and as Transformers builds it (``config`` for ``family``)."""

    litgpt: str
    family: str  # "llama", "phi", "gpt_neox"
    config: dict[str, Any]
    tokens: int  # the longest Alpaca sample in this model's tokens
    layers: int | None = None  # fewer layers than published (a quick check of the code path)


SHAPES = {
    # Config values as published in each model's config.json (and lit-gpt's lit_gpt/config.py at 8641822).
    "phi-1.5": Shape("phi-1_5", "phi", {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32, "intermediate_size": 8192,
                                        "vocab_size": 51200, "partial_rotary_factor": 0.5, "hidden_act": "gelu_new",
                                        "max_position_embeddings": 2048, "layer_norm_eps": 1e-5}, 1044),
    "stablelm-alpha-3b": Shape("stablelm-base-alpha-3b", "gpt_neox", {"hidden_size": 4096, "num_hidden_layers": 16, "num_attention_heads": 32,
                                                                      "intermediate_size": 16384, "vocab_size": 50688, "rotary_pct": 0.25,
                                                                      "use_parallel_residual": True, "max_position_embeddings": 4096,
                                                                      "layer_norm_eps": 1e-5}, 1034),
    "llama-2-7b": Shape("Llama-2-7b-hf", "llama", {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                                                   "intermediate_size": 11008, "vocab_size": 32000, "max_position_embeddings": 4096,
                                                   "rms_norm_eps": 1e-5}, 1304),
    "llama-2-13b": Shape("Llama-2-13b-hf", "llama", {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
                                                     "num_key_value_heads": 40, "intermediate_size": 13824, "vocab_size": 32000,
                                                     "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}, 1304),
}


@dataclass(frozen=True)
class Setup:
    """A case outside lit-gpt's shapes: its model on a device, optimizer, loss, one sample, precision and whether
    its blocks are checkpointed."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[nn.Module, Any], torch.Tensor]
    sample: dict[str, torch.Tensor]
    precision: str = "fp32"
    checkpointing: bool = False


@dataclass(frozen=True)
class Case:
    id: str
    source: str
    shape: str  # a SHAPES key (lit-gpt's and Transformers' code), or "" with ``make``
    micro_batch: int
    published: float  # in the source's unit (UNITS), as printed
    quantization: str | None = None  # "nf4", "nf4-dq"
    make: Callable[[str], Setup] | None = None  # (device) -> Setup, for cases outside SHAPES

    @property
    def published_bytes(self) -> float:
        return self.published * UNITS[self.source]


CASES = [
    Case("phi-1.5 lora mb1", "litgpt", "phi-1.5", 1, 4.82),
    Case("phi-1.5 lora mb2", "litgpt", "phi-1.5", 2, 6.76),
    Case("phi-1.5 lora mb4", "litgpt", "phi-1.5", 4, 10.68),
    Case("phi-1.5 qlora nf4 mb1", "litgpt", "phi-1.5", 1, 3.78, "nf4"),
    Case("phi-1.5 qlora nf4-dq mb1", "litgpt", "phi-1.5", 1, 3.72, "nf4-dq"),
    Case("stablelm-alpha-3b lora mb1", "litgpt", "stablelm-alpha-3b", 1, 9.69),
    Case("stablelm-alpha-3b lora mb2", "litgpt", "stablelm-alpha-3b", 2, 12.10),
    Case("stablelm-alpha-3b lora mb4", "litgpt", "stablelm-alpha-3b", 4, 16.92),
    Case("stablelm-alpha-3b qlora nf4 mb1", "litgpt", "stablelm-alpha-3b", 1, 6.35, "nf4"),
    Case("stablelm-alpha-3b qlora nf4-dq mb1", "litgpt", "stablelm-alpha-3b", 1, 6.19, "nf4-dq"),
    Case("llama-2-7b lora mb1", "litgpt", "llama-2-7b", 1, 21.30),
    Case("llama-2-7b lora mb2", "litgpt", "llama-2-7b", 2, 29.07),
    Case("llama-2-7b qlora nf4 mb1", "litgpt", "llama-2-7b", 1, 14.14, "nf4"),
    Case("llama-2-7b qlora nf4-dq mb1", "litgpt", "llama-2-7b", 1, 13.84, "nf4-dq"),
    Case("llama-2-13b lora mb1", "litgpt", "llama-2-13b", 1, 38.12),
    Case("llama-2-13b qlora nf4 mb1", "litgpt", "llama-2-13b", 1, 23.14, "nf4"),
    Case("llama-2-13b qlora nf4-dq mb1", "litgpt", "llama-2-13b", 1, 22.55, "nf4-dq"),
]


# --- building a case ---------------------------------------------------------------------------------


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def litgpt_path(given: str | None) -> str | None:
    """The lit-gpt checkout to import ``lit_gpt`` from (``--litgpt`` or ``LITGPT_DIR``), put on ``sys.path``."""
    path = given or os.environ.get("LITGPT_DIR")
    if path and path not in sys.path:
        if not os.path.isdir(os.path.join(path, "lit_gpt")):
            raise SystemExit(f"--litgpt {path!r} holds no lit_gpt package: give a checkout of lit-gpt at commit 8641822")
        sys.path.insert(0, path)
    return path


def bnb_quantization(kind: str | None) -> Any:
    """Lightning's ``BitsandbytesPrecision`` as lit-gpt's ``--quantize bnb.nf4[-dq]`` sets it: every linear layer
    (the lm head too) in 4 bits, bf16 compute."""
    if kind is None:
        return None
    from autotune.memory.quantized import Quantization

    return Quantization("nf4", double_quant=kind.endswith("-dq"), compute_dtype=torch.bfloat16)


def litgpt_config(shape: Shape) -> Any:
    """lit-gpt's config of ``shape`` with finetune/lora.py's LoRA: rank, alpha and dropout, on query and value."""
    from lit_gpt.lora import Config

    fewer = {"n_layer": shape.layers} if shape.layers else {}
    return Config.from_name(shape.litgpt, r=LORA["r"], alpha=LORA["alpha"], dropout=LORA["dropout"], to_query=True, to_value=True, **fewer)


def fabric_module(model: nn.Module, device: str, quantization: str | None = None) -> nn.Module:
    """``model`` as ``finetune/lora.py``'s ``fabric.setup_module`` returns it: Lightning Fabric's module wrapper with
    the run's precision plugin, left on its device (the meta device for an estimate).

    Under ``bf16-true`` the wrapper runs the forward with bf16 as the default dtype and converts every floating
    output to the default dtype after it (``HalfPrecision.convert_output``, the same function in the Lightning of
    lit-gpt 8641822 and in Lightning 2.6): lit-gpt's list of bf16 logit chunks comes back as fp32 copies. With
    ``--quantize bnb.nf4[-dq]`` the run's plugin is ``BitsandbytesPrecision``, whose input and output conversions and
    forward context are the same functions; Lightning sets it up on CUDA only, so off CUDA the wrapper takes
    ``bf16-true``'s plugin (the layers are quantized already, by :func:`bnb_quantization`'s settings)."""
    import lightning as L

    if quantization and device.startswith("cuda"):
        from lightning.fabric.plugins import BitsandbytesPrecision

        fabric = L.Fabric(accelerator="cuda", devices=1, plugins=BitsandbytesPrecision(quantization, torch.bfloat16))
    else:
        fabric = L.Fabric(accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1, precision="bf16-true")
    return fabric.setup_module(model, move_to_device=False)


def litgpt_model(shape: Shape, device: str, quantization: str | None = None) -> nn.Module:
    """lit-gpt's GPT with its LoRA (query and value) as ``finetune/lora.py`` makes it under ``bf16-true``, set up by
    Fabric (:func:`fabric_module`); the rope cache rebuilt at the longest sample's length outside the bf16 default,
    as its ``train()`` does."""
    from lit_gpt.lora import GPT, mark_only_lora_as_trainable

    config = litgpt_config(shape)
    with default_dtype(torch.bfloat16), torch.device(device):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    if quantization:
        from autotune.memory.quantized import quantize

        quantize(model, bnb_quantization(quantization))
    model.max_seq_length = shape.tokens
    return fabric_module(model, device, quantization)


def litgpt_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """lit-gpt's ``chunked_cross_entropy``: cross-entropy per chunk of logits."""
    from lit_gpt.utils import chunked_cross_entropy

    return chunked_cross_entropy(logits, targets)


class Loop:
    """``finetune/lora.py``'s loop body at 8641822 as a loss function, with its reference to the logits.

    Each call is an iteration: ``logits = model(input_ids, lm_head_chunk_size=128)``, the last chunk shifted, and
    ``loss(logits, targets)``. The loop's ``logits`` outlives the loss: it holds the chunks (fp32 copies under Fabric)
    through ``fabric.backward`` until the next iteration's forward has returned and the name is rebound. :attr:`logits`
    is that reference, released the same way; an estimate sees the chunks live through the backward it traces.

    The published run peaks at its first iteration (``get_batch`` puts the longest sample there only), where nothing
    is held from before. A later iteration of that length would hold the previous one's logits through its forward:
    ``previous=True`` runs that iteration (forward, loss, backward, same batch) first in each call, one traced step.
    """

    def __init__(self, loss: Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor], *, previous: bool = False) -> None:
        self.loss = loss
        self.previous = previous
        self.logits: list[torch.Tensor] | None = None

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.previous:
            self._iteration(model, batch).backward()
        return self._iteration(model, batch)

    def _iteration(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["input_ids"], lm_head_chunk_size=CHUNK)
        self.logits = logits  # the previous iteration's chunks are freed here, as rebinding the loop's name frees them
        logits[-1] = logits[-1][..., :-1, :]  # shift the targets: output n predicts token n + 1
        return self.loss(logits, batch["labels"][..., 1:])


TRANSFORMERS = {"llama": ("LlamaConfig", "LlamaForCausalLM", ["q_proj", "v_proj"]),
                "phi": ("PhiConfig", "PhiForCausalLM", ["q_proj", "v_proj"]),
                # GPT-NeoX holds q, k and v in one layer: LoRA on it has lit-gpt's parameter count (r x (4096 + 3 x 4096))
                "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", ["query_key_value"])}


class ChunkedHead(nn.Module):
    """A Transformers causal language model called as lit-gpt's GPT is (``model(idx, lm_head_chunk_size=128)``): its
    backbone, then the head in chunks of tokens, a list of logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor, lm_head_chunk_size: int = CHUNK) -> list[torch.Tensor]:
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = base.base_model(input_ids=idx).last_hidden_state
        head = base.get_output_embeddings()
        return [head(h) for h in hidden.split(lm_head_chunk_size, dim=1)]


def chunked_cross_entropy(logits: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per chunk of logits, as lit-gpt's ``chunked_cross_entropy`` computes it (label -1 ignored)."""
    chunks = [F.cross_entropy(lg.reshape(-1, lg.size(-1)), t.reshape(-1), ignore_index=-1, reduction="none")
              for lg, t in zip(logits, targets.split(logits[0].size(1), dim=1))]
    return torch.cat(chunks).mean()


def transformers_model(shape: Shape, device: str, quantization: str | None = None) -> nn.Module:
    """Transformers' model of the shape, bf16, with PEFT's LoRA of lit-gpt's rank, alpha and dropout, called as
    lit-gpt's GPT is (:class:`ChunkedHead`) and set up by Fabric as lit-gpt's (:func:`fabric_module`)."""
    import warnings

    import peft
    import transformers

    config_name, model_name, modules = TRANSFORMERS[shape.family]
    config = getattr(transformers, config_name)(**{**shape.config, **({"num_hidden_layers": shape.layers} if shape.layers else {})})
    config._attn_implementation = "sdpa"
    with default_dtype(torch.bfloat16), torch.device(device):
        model = getattr(transformers, model_name)(config)
    if quantization:
        from autotune.memory.quantized import quantize

        quantize(model, bnb_quantization(quantization))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = peft.get_peft_model(model, peft.LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                          target_modules=modules))
    return fabric_module(ChunkedHead(lora), device, quantization)


# Each code's model builder and its cross-entropy over a list of logit chunks (the loop: :class:`Loop`).
CODES: dict[str, tuple[Callable[..., nn.Module], Callable[[list[torch.Tensor], torch.Tensor], torch.Tensor]]] = {
    "lit-gpt": (litgpt_model, litgpt_cross_entropy),
    "transformers": (transformers_model, chunked_cross_entropy),
}


def tokens(samples: int, length: int, vocab: int = 32000) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (samples, length), generator=torch.Generator().manual_seed(samples * 31 + length))
    return {"input_ids": ids, "labels": ids.clone()}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """finetune/lora.py's AdamW (lr 3e-4, weight decay 0.01) over the trainable parameters."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.01)


def bert_large(batch: int, *, precision: str = "fp32", optimizer: str = "adamw", checkpointing: bool = False) -> Callable[[str], Setup]:
    """hf-perf's model: ``bert-large-uncased`` for sequence classification (2 labels), fp32 weights, eager attention
    (Transformers had no other then), 512 random tokens, the Trainer's optimizer of the time (``adamw_hf``:
    single-tensor AdamW; ``adafactor`` as the Trainer made it; bitsandbytes' ``Adam8bit``)."""

    def make(device: str) -> Setup:
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, vocab_size=30522,
                            max_position_embeddings=512, type_vocab_size=2)
        config._attn_implementation = "eager"
        with torch.device(device):
            model = BertForSequenceClassification(config)
        params = list(model.parameters())
        if optimizer == "adafactor":
            from transformers.optimization import Adafactor

            opt: torch.optim.Optimizer = Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)
        elif optimizer == "adam8bit":
            import bitsandbytes as bnb

            opt = bnb.optim.Adam8bit(params, lr=5e-5)
        else:
            opt = torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0, foreach=False)
        ids = torch.randint(100, 30000, (1, 512), generator=torch.Generator().manual_seed(0))
        sample = {"input_ids": ids, "labels": torch.zeros(1, dtype=torch.long)}
        return Setup(model, opt, hf_loss, sample, precision, checkpointing)

    return make


def mistral_7b(lora: bool) -> Callable[[str], Setup]:
    """fms's Mistral-7B-v0.1 rows: bf16 weights without autocast, gradient checkpointing, flash attention (as SDPA's
    flash kernel), packed rows of 4096 tokens, AdamW (weight decay 0.01, eps 1e-4); LoRA r=16, alpha 16, dropout 0.1
    on q, k, v and o, its adapters in fp32 (PEFT's ``autocast_adapter_dtype``)."""

    def make(device: str) -> Setup:
        import warnings

        import peft
        from transformers import MistralConfig, MistralForCausalLM

        config = MistralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
                               num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
                               rms_norm_eps=1e-5, rope_theta=10000.0)
        config._attn_implementation = "sdpa"
        with default_dtype(torch.bfloat16), torch.device(device):
            model: nn.Module = MistralForCausalLM(config)
        if lora:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1,
                                                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-5, weight_decay=0.01, eps=1e-4)
        return Setup(model, opt, hf_loss, tokens(1, 4096), "fp32", True)

    return make


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


CASES += [
    Case("bert-large bs4 fp32", "hf-perf", "", 4, 14949, make=bert_large(4)),
    Case("bert-large bs1 ga4 fp32", "hf-perf", "", 1, 8681, make=bert_large(1)),
    Case("bert-large bs1 ga4 checkpointing", "hf-perf", "", 1, 6775, make=bert_large(1, checkpointing=True)),
    Case("bert-large bs4 fp16", "hf-perf", "", 4, 13939, make=bert_large(4, precision="fp16")),
    Case("bert-large bs1 ga4 checkpointing fp16", "hf-perf", "", 1, 7275, make=bert_large(1, precision="fp16", checkpointing=True)),
    Case("bert-large bs4 adafactor", "hf-perf", "", 4, 12295, make=bert_large(4, optimizer="adafactor")),
    Case("bert-large bs1 ga4 checkpointing fp16 adafactor", "hf-perf", "", 1, 4847,
         make=bert_large(1, precision="fp16", optimizer="adafactor", checkpointing=True)),
    Case("bert-large bs4 adam8bit", "hf-perf", "", 4, 13085, make=bert_large(4, optimizer="adam8bit")),
    Case("bert-large bs1 ga4 checkpointing fp16 adam8bit", "hf-perf", "", 1, 5363,
         make=bert_large(1, precision="fp16", optimizer="adam8bit", checkpointing=True)),
    Case("mistral-7b full bs4", "fms", "", 4, 72434837504, make=mistral_7b(lora=False)),
    Case("mistral-7b full bs8", "fms", "", 8, 72435230720, make=mistral_7b(lora=False)),
    Case("mistral-7b lora bs4", "fms", "", 4, 26704571904, make=mistral_7b(lora=True)),
    Case("mistral-7b lora bs8", "fms", "", 8, 38742912512, make=mistral_7b(lora=True)),
]


# --- estimating and measuring --------------------------------------------------------------------------


def built(case: Case, code: str, device: str, shape: Shape | None = None, *, later: bool = False) -> Setup:
    """``case`` on ``device``: its own setup, or its shape in ``code`` (lit-gpt's or Transformers') set up by Fabric,
    with finetune/lora.py's AdamW and loop (:class:`Loop`; ``later``: a later iteration's, which holds the previous
    one's logits through its forward), one sample of the longest length, bf16 weights without autocast."""
    if case.make is not None:
        return case.make(device)
    shape = shape or SHAPES[case.shape]
    build, loss = CODES[code]
    model = build(shape, device, case.quantization)
    return Setup(model, adamw(model), Loop(loss, previous=later), tokens(1, shape.tokens))


def estimate(case: Case, code: str, *, later: bool = False) -> float:
    """The estimate of what ``case``'s source measured, in GB: the steady state's allocated peak as the caching
    allocator replays it; for hf-perf, its reserved bytes and the CUDA context the page measured."""
    allocated, reserved = estimated_peaks(case, code, later=later)
    return reserved + CONTEXT_ON_THE_PAGE / GB if case.source == "hf-perf" else allocated


def estimated_peaks(case: Case, code: str, shape: Shape | None = None, *, later: bool = False) -> tuple[float, float]:
    """The steady state's allocated and reserved peaks (GB) as the estimate replays CUDA's caching allocator."""
    from autotune.probe.estimate import Estimator
    from autotune.probe.trial import Workload

    setup = built(case, code, "meta", shape, later=later)
    work = Workload(model=setup.model, optimizer=setup.optimizer, loss_fn=setup.loss, batch=setup.sample, device=torch.device("cuda"),
                    precision=setup.precision, checkpointing=setup.checkpointing)  # type: ignore[arg-type]
    peaks = Estimator(work).allocator(case.micro_batch)
    return peaks.allocated / GB, peaks.reserved / GB


@dataclass
class Measured:
    """A real first step on a CUDA device: ``max_memory_allocated`` over it (weights included), what was
    allocated when the backward began, and what each block's forward added."""

    allocated: float
    reserved: float
    at_backward: float
    per_block: list[float] = field(default_factory=list)
    saved: list[tuple[str, str, int]] = field(default_factory=list)  # the second block's saved tensors: shape, dtype, bytes


def measure(case: Case, code: str, device: torch.device, shape: Shape | None = None, *, later: bool = False) -> Measured:
    """``case``'s first step (the longest sample, no optimizer state yet) and a second after an optimizer step with
    the gradients kept (accumulation's steady state), on ``device`` with random weights: the peak over both. The
    second step of a LitGPT case holds nothing of the first (as the published run's first iteration holds nothing
    from before it), or with ``later`` the first's logits through its forward, as :class:`Loop` says."""
    torch.manual_seed(0)
    setup = built(case, code, str(device), shape, later=later)
    model, opt, loss = setup.model, setup.optimizer, setup.loss
    model.train()
    if setup.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    batch = {k: v.repeat(case.micro_batch, *[1] * (v.dim() - 1)).to(device) for k, v in setup.sample.items()}
    cuda = device.type == "cuda"
    half = torch.autocast(device.type, dtype=torch.float16) if setup.precision == "fp16" else contextlib.nullcontext()
    scaler = torch.amp.GradScaler(device.type, enabled=setup.precision == "fp16" and cuda)

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    blocks = [m for m in model.modules() if type(m).__name__ in ("Block", "LlamaDecoderLayer", "PhiDecoderLayer", "GPTNeoXLayer",
                                                                  "MistralDecoderLayer", "BertLayer")]
    added: list[float] = []
    before: list[int] = []
    hooks = [b.register_forward_pre_hook(lambda *_: before.append(allocated())) for b in blocks]
    hooks += [b.register_forward_hook(lambda *_: added.append((allocated() - before[-1]) / GB)) for b in blocks]
    saved: dict[int, tuple[str, str, int]] = {}
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if len(before) == 2 and len(added) == 1:  # inside the second block's forward
            s = t.untyped_storage()
            if s.data_ptr() not in held:
                saved.setdefault(s.data_ptr(), (str(tuple(t.shape)), str(t.dtype).replace("torch.", ""), s.nbytes()))
        return t

    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), half:
        value = loss(model, batch)
    at_backward = allocated() / GB
    for h in hooks:
        h.remove()
    scaler.scale(value).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=False)  # accumulation's steady state, which the estimate models: the gradients stay
    if isinstance(loss, Loop) and not later:
        loss.logits = None  # a step with nothing held from before, as the published run's first
    with half:
        value = loss(model, batch)
    scaler.scale(value).backward()
    peaks = (0, 0)
    if cuda:
        torch.cuda.synchronize(device)
        peaks = (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
    out = Measured(peaks[0] / GB, peaks[1] / GB, at_backward, added,
                   sorted(saved.values(), key=lambda v: -v[2]))
    del model, opt, batch, value
    return out


def lightning_init_peak(case: Case, device: torch.device) -> float:
    """``max_memory_allocated`` (GB) while Lightning Fabric builds lit-gpt's model as ``finetune/lora.py`` does with
    ``--quantize bnb.nf4[-dq]`` (``BitsandbytesPrecision``, ``init_module(empty_init=False)``, ``setup_module``),
    before any step: what loading alone holds at its peak."""
    import lightning as L
    from lightning.fabric.plugins import BitsandbytesPrecision
    from lit_gpt.lora import GPT, mark_only_lora_as_trainable

    config = litgpt_config(SHAPES[case.shape])
    plugin = BitsandbytesPrecision(case.quantization or "nf4", torch.bfloat16)
    fabric = L.Fabric(devices=1, accelerator="cuda", precision=None, plugins=plugin)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with fabric.init_module(empty_init=False):
        model = GPT(config)
    mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / GB
    del model
    return peak


# --- the table -----------------------------------------------------------------------------------------


def chosen(wanted: str | None) -> list[Case]:
    if not wanted:
        return CASES
    words = wanted.split(",")
    return [c for c in CASES if any(c.id == w or c.id.startswith(w) for w in words)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--litgpt", help="a checkout of lit-gpt at commit 8641822 (else LITGPT_DIR; else Transformers' models only)")
    parser.add_argument("--cases", help="comma-separated case ids or their first words (default: all)")
    parser.add_argument("--later", action="store_true",
                        help="LitGPT's cases at a later iteration of the longest length: the previous one's logits held through its forward")
    args = parser.parse_args(argv)
    codes = (["lit-gpt"] if litgpt_path(args.litgpt) else []) + ["transformers"]
    print("| case | source | published GB | " + " | ".join(f"{c} estimate GB | ratio" for c in codes) + " |")
    print("|---|---|---|" + "---|---|" * len(codes))
    ratios: dict[str, list[float]] = {}
    began = time.perf_counter()
    for case in chosen(args.cases):
        cells, published = [], case.published_bytes / GB
        for code in codes:
            if case.make is not None and code != "transformers":  # the other sources' models are Transformers'
                cells.append("- | -")
                continue
            got = estimate(case, code, later=args.later)
            ratios.setdefault(f"{case.source}, {code}", []).append(got / published)
            cells.append(f"{got:.2f} | {got / published:.3f}")
        print(f"| {case.id} | {case.source} | {published:.2f} | " + " | ".join(cells) + " |", flush=True)
    for key, r in ratios.items():
        print(f"{key}: {len(r)} cases, ratio {min(r):.3f}-{max(r):.3f}")
    for key in sorted({c.source for c in chosen(args.cases)}):
        s = SOURCES[key]
        print(f"{key}: {s.name}, {s.where}; {s.gpu}; {s.figure}")
    print(f"({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
