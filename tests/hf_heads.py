"""Heads people fine-tune with the Hugging Face Trainer, built from small configs (nothing is downloaded),
each with a dataset of varied lengths and a collator that pads to the longest in the batch, as a
tokenizer and ``DataCollatorWithPadding`` would. Shared by the single-process tests and the torchrun
worker."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: these are built from configs

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

VOCAB, PAD = 100, 0
PAD_VALUES = {"input_ids": PAD, "attention_mask": 0, "labels": -100}


@dataclass(frozen=True)
class Head:
    """A model factory and how its samples look."""

    make: Callable[[], torch.nn.Module]
    sample: Callable[[torch.Generator], dict[str, torch.Tensor]]
    float32_loss: bool = False  # transformers computes this head's loss in float32 (it upcasts the logits)


def _bert_config(**extra: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
                      max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD, **extra)


def _gpt2_config(**extra: Any) -> Any:
    from transformers import GPT2Config

    return GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=PAD, **extra)


def _text(g: torch.Generator, low: int = 4, high: int = 16) -> dict[str, torch.Tensor]:
    n = int(torch.randint(low, high, (1,), generator=g))
    ids = torch.randint(3, VOCAB, (n,), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(n, dtype=torch.long)}


def _classified(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_text(g), "labels": torch.randint(0, 3, (), generator=g)}


def _fixed_length(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_text(g, 12, 13), "labels": torch.randint(0, 3, (), generator=g)}


def _regression(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {**_text(g), "labels": torch.randn((), generator=g, dtype=torch.float64)}


def _tagged(g: torch.Generator) -> dict[str, torch.Tensor]:
    s = _text(g)
    return {**s, "labels": torch.randint(0, 3, s["input_ids"].shape, generator=g)}


def _masked(g: torch.Generator) -> dict[str, torch.Tensor]:
    s = _text(g)
    pick = torch.rand(s["input_ids"].shape, generator=g) < 0.3
    pick[0] = True  # at least one masked token per sample
    return {"input_ids": s["input_ids"].masked_fill(pick, 3), "attention_mask": s["attention_mask"],
            "labels": s["input_ids"].masked_fill(~pick, -100)}


def _causal(g: torch.Generator) -> dict[str, torch.Tensor]:
    s = _text(g)
    return {**s, "labels": s["input_ids"].clone()}


def _seq2seq(g: torch.Generator) -> dict[str, torch.Tensor]:
    target = torch.randint(3, VOCAB, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
    return {**_text(g), "labels": target}


def _speech(g: torch.Generator) -> dict[str, torch.Tensor]:
    target = torch.randint(3, VOCAB, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
    return {"input_features": torch.randn(8, 16, generator=g, dtype=torch.float64), "labels": target}


def _image(g: torch.Generator) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(3, 16, 16, generator=g, dtype=torch.float64), "labels": torch.randint(0, 3, (), generator=g)}


def _model(name: str, config: Any, **attrs: Any) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, name)(config() if callable(config) else config)
        for key, value in attrs.items():
            setattr(model, key, value)
        return model.double()

    return make


def _t5() -> Any:
    from transformers import T5Config

    return T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, dropout_rate=0.0,
                    decoder_start_token_id=PAD, pad_token_id=PAD, eos_token_id=2)


def _whisper() -> Any:
    from transformers import WhisperConfig

    return WhisperConfig(vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
                         max_target_positions=32, decoder_start_token_id=1, pad_token_id=PAD, eos_token_id=2, bos_token_id=1,
                         suppress_tokens=None, begin_suppress_tokens=None, dropout=0.0)


def _vit() -> Any:
    from transformers import ViTConfig

    return ViTConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, image_size=16, patch_size=8,
                     num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


HEADS: dict[str, Head] = {
    "bert-sequence-classification-padded": Head(_model("BertForSequenceClassification", lambda: _bert_config(num_labels=3)), _classified),
    "roberta-sequence-classification-unpadded": Head(
        _model("RobertaForSequenceClassification", lambda: __import__("transformers").RobertaConfig(
            num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=66,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=1, bos_token_id=0, eos_token_id=2)),
        _fixed_length),
    "gpt2-sequence-classification": Head(_model("GPT2ForSequenceClassification", lambda: _gpt2_config(num_labels=3)), _classified),
    "bert-regression": Head(_model("BertForSequenceClassification", lambda: _bert_config(num_labels=1)), _regression),
    "bert-token-classification": Head(_model("BertForTokenClassification", lambda: _bert_config(num_labels=3)), _tagged),
    "bert-masked-lm": Head(_model("BertForMaskedLM", _bert_config), _masked),
    "gpt2-causal-lm": Head(_model("GPT2LMHeadModel", _gpt2_config), _causal, float32_loss=True),
    "gpt2-causal-lm-loss-type": Head(_model("GPT2LMHeadModel", _gpt2_config, loss_type="ForCausalLM"), _causal, float32_loss=True),
    "t5-seq2seq": Head(_model("T5ForConditionalGeneration", _t5), _seq2seq),
    "whisper-speech-seq2seq": Head(_model("WhisperForConditionalGeneration", _whisper), _speech),
    "vit-image-classification": Head(_model("ViTForImageClassification", _vit), _image),
}


class Samples(Dataset):
    """``n`` samples of a head; ``accessed`` lists the indices read, in order (which samples a step saw)."""

    def __init__(self, head: Head, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.items = [head.sample(g) for _ in range(n)]
        self.accessed: list[int] = []

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.accessed.append(int(i))
        return self.items[i]


def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack what has one shape; pad what varies to the longest in the batch (ids with PAD, masks with
    0, labels with -100), on the right."""
    out = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        longest = max(v.shape[0] if v.dim() else 0 for v in values)
        if all(v.shape == values[0].shape for v in values):
            out[key] = torch.stack(values)
            continue
        batch = torch.full((len(values), longest), PAD_VALUES[key], dtype=values[0].dtype)
        for i, v in enumerate(values):
            batch[i, : len(v)] = v
        out[key] = batch
    return out


def big_batch_gradients(model: torch.nn.Module, samples: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients of one big batch of ``samples``, as the model computes them itself (no Trainer)."""
    import copy

    model = copy.deepcopy(model).train()
    model.zero_grad(set_to_none=True)
    loss = model(**collate(samples)).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def worst_relative(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """The largest difference over the parameters, relative to each gradient's largest entry (at least
    a millionth of the model's largest: some gradients are zero in exact arithmetic, such as attention's
    key bias, and only rounding is left of them)."""
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    floor = 1e-6 * max(g.abs().max().item() for g in want.values())
    return max(((got[n] - g).abs().max() / g.abs().max().clamp_min(floor)).item() for n, g in want.items())
