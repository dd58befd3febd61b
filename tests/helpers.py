"""Small models, data and an independent reference for the tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from autotune.memory.ledger import TensorLedger


def estimating(t: torch.Tensor) -> bool:
    """Whether ``t`` belongs to an estimate (a fake or meta tensor, no data) rather than a real step."""
    from torch._subclasses.fake_tensor import FakeTensor

    return t.is_meta or isinstance(t, FakeTensor)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(128, 10),
    )


class TinyTransformer(nn.Module):
    """A two-layer causal-free token model returning logits of shape (batch, length, vocab)."""

    def __init__(self, vocab: int = 64, dim: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def transformer() -> nn.Module:
    return TinyTransformer()


class AttentionLM(nn.Module):
    """A causal language model block over 512 tokens: scaled_dot_product_attention, 4 heads of 64."""

    def __init__(self, vocab: int = 64, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, dim)
        return self.head(x + self.out(y))


def data_for(name: str, *, batches: int = 4, batch: int = 32, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batches):
        if name == "mlp":
            out.append((torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        elif name == "cnn":
            out.append((torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 10, (batch,), generator=g)))
        else:
            length = 512 if name == "attention-lm" else 24
            tokens = torch.randint(0, 64, (batch, length), generator=g)
            out.append((tokens, torch.randint(0, 64, (batch, length), generator=g)))
    return out


MODELS = {"mlp": mlp, "cnn": cnn_bn, "transformer": transformer, "attention-lm": AttentionLM}
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def reference_fits(model: nn.Module, make_opt, batch, size: int, budget: int) -> bool:
    """Does one steady-state step at ``size`` stay within ``budget``? Written without autotune's probe.

    Fresh copies of the model and optimizer; the step is micro-step, optimizer step, micro-step,
    each micro-step a plain forward, cross-entropy and backward.
    """
    model = copy.deepcopy(model)
    model.train()
    opt = make_opt(model.parameters())
    x, y = batch
    index = torch.arange(size) % x.shape[0]
    x, y = x[index], y[index]
    ledger = TensorLedger("cpu", limit=budget)
    ledger.track(list(model.parameters()) + list(model.buffers()) + [x, y])

    def micro() -> None:
        # One expression: the logits are not kept alive through backward (a loop that keeps them
        # holds more memory than the step autotune runs).
        loss = nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()

    try:
        with ledger:
            micro()
            opt.step()
            micro()
    except torch.OutOfMemoryError:
        return False
    return True


def true_max(model: nn.Module, make_opt, batch, budget: int, upper: int) -> int:
    """The largest size in [1, upper] that fits, by trying every size from 1 upwards."""
    best = 0
    for size in range(1, upper + 1):
        if not reference_fits(model, make_opt, batch, size, budget):
            break
        best = size
    return best


# A token loss over padded sequences, for the trainer integrations' count= (1 and 2 ranks).


class TokenData(torch.utils.data.Dataset):
    """Sequences of 2 to 15 tokens whose labels are the tokens (a token loss over padded batches)."""

    def __init__(self, n=44):
        g = torch.Generator().manual_seed(0)
        self.items = [torch.randint(1, 50, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g) for _ in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_tokens(seqs):
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)
    return {"input_ids": ids, "labels": torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=-100)}


def token_lm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Tanh(), nn.Linear(16, 50)).double()


def token_mean(net, batch):
    logits = net(batch["input_ids"])
    return F.cross_entropy(logits.reshape(-1, 50), batch["labels"].reshape(-1), ignore_index=-100)


def items(batch):
    return int(batch["labels"].ne(-100).sum())
