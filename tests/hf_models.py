"""Small Hugging Face models built from configs (nothing is downloaded), as factories for the tests
and for ``autotune report tests/hf_models.py:gpt2``."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a hub: these are built from configs

import torch


def gpt2(layers: int = 2, dim: int = 64, vocab: int = 500, positions: int = 256) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=positions,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def llama(layers: int = 2, dim: int = 64, vocab: int = 500, heads: int = 4, kv_heads: int = 2, mlp: int = 128) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=mlp, vocab_size=vocab, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def bert(layers: int = 2, dim: int = 64, vocab: int = 500, labels: int = 3) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=4, intermediate_size=4 * dim,
                        vocab_size=vocab, max_position_embeddings=256, num_labels=labels,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def vit(layers: int = 2, dim: int = 64, image: int = 32, labels: int = 10) -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(num_hidden_layers=layers, hidden_size=dim, num_attention_heads=4, intermediate_size=4 * dim,
                       image_size=image, patch_size=8, num_labels=labels, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def resnet(labels: int = 10) -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=labels)
    return ResNetForImageClassification(config)
