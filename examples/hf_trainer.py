"""The Hugging Face Trainer with the effective batch kept: a small GPT-2 (built from its config, nothing
downloaded) on synthetic text with dynamic padding, a target of 64 sequences per optimizer step under
a 16 MiB limit that 64 do not fit. autotune sets the per-device batch and the accumulation, the Trainer
trains. Runs in seconds on a CPU.

    pip install -e ".[hf]"
    python examples/hf_trainer.py
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # built from a config: nothing to fetch

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autotune.integrations import hf

VOCAB, PAD = 256, 0


def texts(n: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of 8 to 48 tokens that count up in steps of 3 (learnable), with 10% noise."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        length = int(torch.randint(8, 49, (1,), generator=g))
        ids = (torch.randint(1, VOCAB, (1,), generator=g) + 3 * torch.arange(length)) % (VOCAB - 1) + 1
        noise = torch.rand(length, generator=g) < 0.1
        out.append({"input_ids": torch.where(noise, torch.randint(1, VOCAB, (length,), generator=g), ids)})
    return out


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding: to the longest in the batch; labels -100 where padded."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])], mask[i, : len(s["input_ids"])] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    torch.manual_seed(0)
    # bos/eos inside the small vocabulary (GPT-2's defaults, 50256, are not): no config warnings
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=VOCAB - 1,
                                       eos_token_id=VOCAB - 1, pad_token_id=PAD))
    model.loss_type = "ForCausalLM"  # a config that names its loss: the Trainer counts the shifted tokens itself
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=64, gradient_accumulation_steps=1, max_steps=30,
                                 learning_rate=3e-3, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                 seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=texts(1024), data_collator=pad)
        prepared = hf.prepare(trainer, memory_limit="16MiB", progress=False)  # 64 per step, kept
        print(prepared)
        result = trainer.train()
    print(f"trained {result.global_step} optimizer steps of {prepared.settings.effective_batch} sequences; "
          f"training loss {result.training_loss:.3f}")


if __name__ == "__main__":
    main()
