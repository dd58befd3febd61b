"""Published training throughputs against the step time the estimate predicts for the same setting on the same card.

Each case is a published measurement of a fine-tune's throughput on one GPU, with its procedure reproduced: the model
built from its published config on the meta device (no weights), the fine-tuning method, precision, checkpointing,
attention kernel, optimizer, sequence length and micro-batch as the source ran them. The estimate traces the step
(:class:`autotune.probe.estimate.Estimator`) and :func:`autotune.memory.timing.predict` gives its time on the card of
the catalogue the source used; the ratio printed is the predicted throughput over the published one.

The cases are in two groups: those the efficiencies of :data:`autotune.memory.timing.CALIBRATED` were fitted to
(``calibration``), and the rest, never fitted to (``validation``), each of which should fall within [0.8, 1.2].
``--fit`` refits the efficiencies on the calibration cases (a grid over the matmul, attention and bandwidth
efficiencies, least squares in the logarithm of the ratio) and prints them.

Sources:

- ``fms``: fms-acceleration's A100-80GB references (``scripts/benchmarks/refs/a100_80gb.csv`` at 24bdadb,
  github.com/foundation-model-stack/fms-acceleration): the Transformers Trainer / TRL's SFTTrainer, 100 steps, packed
  rows (4096 tokens; SantaCoder's 2048), gradient checkpointing, flash attention 2, AdamW, one GPU, no accumulation;
  ``train_tokens_per_second`` (the Trainer's: input tokens over the run's time, its first steps included). The
  memory cases of ``benchmarks/published.py`` are the same rows. The card: an A100-SXM4-80GB is assumed (the file
  names the memory only; the PCIe card's bandwidth is 2% lower, its peak the same). Its Mixtral-8x7B QLoRA rows are
  left out: Transformers 5 holds Mixtral's experts as 3-D parameters, which bitsandbytes does not quantize, where
  the Transformers of the measurement held them as linear layers and quantized them (a different step).
- ``qwen``: Qwen (v1)'s README, "Profiling of Memory and Speed" (github.com/QwenLM/Qwen README.md @ e8e1596): one
  A100-SXM4-80G, PyTorch 2.0, flash attention 2, micro-batch 1 with 8 accumulated (``finetune.py`` pads every
  sample to the length), LoRA r=64, alpha 16, dropout 0.05 on every linear layer of the blocks, bf16 weights under
  the Trainer's bf16 autocast, gradient checkpointing, ``adamw_torch``; seconds per optimizer step at 256 to 8192
  tokens. Qwen's blocks are Llama's (RMSNorm, rotary, SwiGLU, biased q, k and v, multi-head attention): built as a
  Llama of Qwen-1.8B's, Qwen-7B's and Qwen-14B's published configs, the fused q, k, v layer as three (the same
  FLOPs; LoRA's adapters on it three times as many rows of A). The short lengths are bound by the host's dispatch.

Run::

    python benchmarks/step_time.py            # every case, a few minutes on a CPU
    python benchmarks/step_time.py --fit      # refit the efficiencies on the calibration cases
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import published  # noqa: E402  (a sibling script: the memory cases' setups)

from autotune.memory.gpus import gpu_named  # noqa: E402
from autotune.memory.timing import CALIBRATED, Efficiency, StepTime, predict  # noqa: E402
from autotune.memory.work import Work  # noqa: E402

FMS = "fms-acceleration a100_80gb.csv @ 24bdadb"


@dataclass(frozen=True)
class Case:
    """A published throughput: ``tokens_per_second`` (or ``samples_per_second``) of ``make``'s setting at
    ``micro_batch`` samples of ``length`` tokens on ``gpu``."""

    id: str
    source: str
    gpu: str
    micro_batch: int
    length: int
    tokens_per_second: float
    make: Callable[[str], published.Setup]
    calibration: bool = False
    what: str = ""
    accumulation: int = 1


def mistral_config(**more: Any) -> Any:
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8,
                           vocab_size=32000, max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5, rope_theta=10000.0, **more)
    config._attn_implementation = "sdpa"
    return config


def qlora(config: Callable[[], Any], model_class: str, length: int) -> Callable[[str], published.Setup]:
    """fms's ``baseline-peft-bnb`` rows: the base in nf4 with double quantization and bf16 compute (bitsandbytes,
    ``BitsAndBytesConfig``), PEFT's ``prepare_model_for_kbit_training`` as TRL's SFTTrainer calls it on one device
    (every weight left unquantized cast to fp32), LoRA r=16, alpha 16, dropout 0.1 on q, k, v and o, bf16 autocast
    (``bf16=True``), gradient checkpointing, AdamW."""

    def make(device: str) -> published.Setup:
        import peft
        import transformers

        from autotune.memory.quantized import Quantization, quantize

        with published.default_dtype(torch.bfloat16), torch.device(device):
            model: nn.Module = getattr(transformers, model_class)(config())
        quantize(model, Quantization("nf4", double_quant=True, compute_dtype=torch.bfloat16))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for p in model.parameters():  # prepare_model_for_kbit_training's cast (it also turns checkpointing on)
                if p.dtype in (torch.float16, torch.bfloat16):
                    p.data = p.data.float()
            model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=16, lora_dropout=0.1,
                                                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4, weight_decay=0.01, eps=1e-4)
        return published.Setup(model, opt, published.hf_loss, published.tokens(1, length), "bf16", True)

    return make


def santacoder(device: str) -> published.Setup:
    """fms's SantaCoder full fine-tune: GPT-BigCode (multi-query attention), bf16 weights, 2048-token rows."""
    from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

    config = GPTBigCodeConfig(n_embd=2048, n_layer=24, n_head=16, n_inner=8192, n_positions=2048, vocab_size=49280, multi_query=True,
                              activation_function="gelu_pytorch_tanh")
    config._attn_implementation = "sdpa"
    with published.default_dtype(torch.bfloat16), torch.device(device):
        model = GPTBigCodeForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, eps=1e-4)
    return published.Setup(model, opt, published.hf_loss, published.tokens(1, 2048, vocab=49280), "fp32", True)


QWEN = {"1.8b": {"hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 5504, "vocab_size": 151936},
        "7b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008, "vocab_size": 151936},
        "14b": {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40, "intermediate_size": 13696, "vocab_size": 152064}}


def qwen_lora(size: str, length: int) -> Callable[[str], published.Setup]:
    """Qwen's README rows: LoRA r=64 on every linear layer of the blocks, bf16 weights under bf16 autocast,
    checkpointing, one sample of ``length`` tokens."""

    def make(device: str) -> published.Setup:
        import peft
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**QWEN[size], num_key_value_heads=QWEN[size]["num_attention_heads"], attention_bias=True, rms_norm_eps=1e-6,
                             max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=False)
        config._attn_implementation = "sdpa"
        with published.default_dtype(torch.bfloat16), torch.device(device):
            model: nn.Module = LlamaForCausalLM(config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lora = peft.LoraConfig(r=64, lora_alpha=16, lora_dropout=0.05,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
            model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)  # PEFT of 2023: adapters in the base's bf16
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
        return published.Setup(model, opt, published.hf_loss, published.tokens(1, length, vocab=151936), "bf16", True)

    return make


# Seconds per optimizer step of 8 samples, as the README prints them (Qwen-1.8B's, 7B's and 14B's LoRA rows).
QWEN_SECONDS = {"1.8b": (1.0, 1.0, 1.1, 1.7, 3.3, 6.8), "7b": (1.2, 1.5, 2.8, 5.2, 10.1, 21.3), "14b": (1.6, 2.4, 4.4, 8.4, 17.0, 36.0)}
QWEN_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QWEN_SRC = "Qwen README @ e8e1596"
QWEN_CALIBRATION = {("1.8b", 256), ("7b", 8192)}

FULL, LORA = published.mistral_7b(lora=False), published.mistral_7b(lora=True)
MISTRAL_QLORA = qlora(mistral_config, "MistralForCausalLM", 4096)
A100 = "a100-80gb-sxm"

CASES = [
    Case("mistral-7b full bs4", FMS, A100, 4, 4096, 3062.694, FULL, True, "full fine-tune, bf16 weights"),
    Case("mistral-7b lora bs4", FMS, A100, 4, 4096, 3324.155, LORA, True, "LoRA r16 q,k,v,o, bf16 base"),
    Case("santacoder full bs4", FMS, A100, 4, 2048, 17188.262, santacoder, True, "full fine-tune, bf16 weights"),
    Case("mistral-7b full bs8", FMS, A100, 8, 4096, 3143.118, FULL, what="full fine-tune, bf16 weights"),
    Case("mistral-7b lora bs8", FMS, A100, 8, 4096, 3353.809, LORA, what="LoRA r16 q,k,v,o, bf16 base"),
    Case("santacoder full bs8", FMS, A100, 8, 2048, 18410.851, santacoder, what="full fine-tune, bf16 weights"),
    Case("mistral-7b qlora bs4", FMS, A100, 4, 4096, 2903.78, MISTRAL_QLORA, what="QLoRA nf4-dq (baseline-peft-bnb)"),
    Case("mistral-7b qlora bs8", FMS, A100, 8, 4096, 2987.456, MISTRAL_QLORA, what="QLoRA nf4-dq (baseline-peft-bnb)"),
] + [
    Case(f"qwen-{size} lora {length}", QWEN_SRC, A100, 1, length, 8 * length / secs, qwen_lora(size, length), (size, length) in QWEN_CALIBRATION,
         "LoRA r64 all linear, 1 x 8 accumulated", accumulation=8)
    for size, row in QWEN_SECONDS.items() for length, secs in zip(QWEN_LENGTHS, row)
]


def traced(case: Case) -> Work:
    """The work of one micro-step of ``case`` and of its optimizer step, from the estimate's trace."""
    from autotune.probe.estimate import Estimator
    from autotune.probe.trial import Workload

    setup = case.make("meta")
    work = Workload(model=setup.model, optimizer=setup.optimizer, loss_fn=setup.loss, batch=setup.sample, device=torch.device("cuda"),
                    precision=setup.precision, checkpointing=setup.checkpointing)  # type: ignore[arg-type]
    return Estimator(work).work(case.micro_batch)


def ratio(case: Case, work: Work, efficiency: Efficiency = CALIBRATED) -> float:
    """Predicted over published tokens a second."""
    t = timed(case, work, efficiency)
    return t.tokens_per_second / case.tokens_per_second  # type: ignore[operator]


def timed(case: Case, work: Work, efficiency: Efficiency = CALIBRATED) -> StepTime:
    """The predicted optimizer step of ``case``."""
    samples = case.micro_batch * case.accumulation
    return predict(work, gpu_named(case.gpu), accumulation=case.accumulation, samples=samples, tokens=samples * case.length, efficiency=efficiency)


def fit(cases: list[Case], works: dict[str, Work]) -> Efficiency:
    """The efficiencies that bring the calibration cases' ratios closest to 1 (least squares of their logarithms)."""
    grid = [i / 100 for i in range(30, 101, 5)]
    best: tuple[float, Efficiency] | None = None
    for mm in grid:
        for attention in [a * 2 for a in grid]:  # causal kernels skip half the scores torch's formula counts: up to 2
            for memory in grid:
                for dispatch, overlap in itertools.product((4e-6, 8e-6, 1.2e-5, 1.6e-5, 2e-5, 2.4e-5, 3e-5, 4e-5), (1.5, 2, 3, 4, 8)):
                    eff = replace(CALIBRATED, matmul=mm, attention=attention, memory=memory, dispatch=dispatch, overlap=overlap)
                    err = sum(math.log(ratio(c, works[c.id], eff)) ** 2 for c in cases)
                    if best is None or err < best[0] - 1e-12:
                        best = (err, eff)
    assert best is not None
    return best[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="refit the efficiencies on the calibration cases")
    parser.add_argument("--only", help="the cases whose id contains this")
    parser.add_argument("--cache", help="keep the traced work in this file (JSON) and read it back instead of tracing again")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.only or args.only in c.id]
    kept = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    works: dict[str, Work] = {}
    for case in cases:
        if case.id in kept:
            works[case.id] = Work(tuple(map(tuple, kept[case.id]["parts"])), tuple(map(tuple, kept[case.id]["launches"])))  # type: ignore[arg-type]
            continue
        start = time.perf_counter()
        works[case.id] = traced(case)
        print(f"  traced {case.id} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if args.cache:
        kept.update({k: {"parts": w.parts, "launches": w.launches} for k, w in works.items()})
        Path(args.cache).write_text(json.dumps(kept))
    efficiency = CALIBRATED
    if args.fit:
        efficiency = fit([c for c in cases if c.calibration], works)
        print(f"fitted: matmul {efficiency.matmul:.2f}, attention {efficiency.attention:.2f}, memory {efficiency.memory:.2f}, "
              f"dispatch {efficiency.dispatch * 1e6:.0f} us, overlap {efficiency.overlap:g}")
    print(f"{'case':<26} {'group':<12} {'card':<14} {'published tok/s':>15} {'predicted':>10} {'ratio':>6}  bound    setting")
    outside = []
    for group, wanted in (("calibration", True), ("validation", False)):
        for case in (c for c in cases if c.calibration == wanted):
            work = works[case.id]
            t = timed(case, work, efficiency)
            r = t.tokens_per_second / case.tokens_per_second  # type: ignore[operator]
            if not wanted and not 0.8 <= r <= 1.2:
                outside.append(case.id)
            print(f"{case.id:<26} {group:<12} {case.gpu:<14} {case.tokens_per_second:>15,.0f} {t.tokens_per_second:>10,.0f} {r:>6.3f}  "
                  f"{t.bound:<8} {case.what} ({case.source})")
    print(f"validation cases outside [0.8, 1.2]: {', '.join(outside) if outside else 'none'}")
    return 1 if outside else 0


if __name__ == "__main__":
    raise SystemExit(main())
