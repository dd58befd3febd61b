"""Every ```python block of README.md and docs/*.md runs as printed.

Each block runs with ``exec`` in a fresh namespace, in a temporary working directory and with a temporary
``XDG_CACHE_HOME``; blocks share no names. A block that uses names it does not define says which, in an
html comment on the line above its fence (``<!-- names: model, loader -->``), and gets them from the
fixtures of this file: small real objects the block can run on. A block that cannot run here says why
(``<!-- not run: needs CUDA -->``) and is skipped with that reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMENT = re.compile(r"<!-- (names|not run): (.+) -->")

# What a block's model, loader, dataset and loss stand for where they are not images with class labels:
# "tokens", a tiny language model returning logits and padded token batches with -100 labels; "hf", a
# Hugging Face causal LM and its dict batches (its own loss).
KINDS = {
    "docs/accumulate.md:2": "tokens",
    "docs/accelerate.md:2": "hf",
    "docs/getting-started.md:4": "hf",
    "docs/hf.md:1": "hf",
}
# The blocks that take more than about 20 seconds here (none at present).
SLOW: set[str] = set()
# Optional packages: a block that imports one is skipped without it (as are the fixtures that need one).
OPTIONAL = {"accelerate", "bitsandbytes", "lightning", "peft", "ray", "transformers", "trl"}
# What a block needs without importing it: make_optimizer("paged_adamw_8bit") and quantize(..., "nf4").
NEEDS = {"docs/settings.md:1": {"bitsandbytes"}}


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    index: int  # 1-based, within its file
    line: int  # of the first line of code in the file, 1-based
    code: str
    names: tuple[str, ...] = ()
    not_run: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.index}"


def blocks_of(path: Path) -> list[Block]:
    """The ```python blocks of a markdown file, each with the comment line above its fence."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = path.relative_to(ROOT).as_posix()
    found, start = [], None
    for i, line in enumerate(lines):
        if start is None and line == "```python":
            start = i
        elif start is not None and line == "```":
            above = lines[start - 1].strip() if start else ""
            names, not_run = (), None
            if above.startswith("<!--"):
                match = COMMENT.fullmatch(above)
                assert match, f"{name}:{start}: unreadable comment above a python block: {above!r}"
                if match.group(1) == "names":
                    names = tuple(n.strip() for n in match.group(2).split(","))
                else:
                    not_run = match.group(2)
            found.append(Block(name, len(found) + 1, start + 2, "\n".join(lines[start + 1:i]) + "\n", names, not_run))
            start = None
    assert start is None, f"{name}:{start + 1}: a python block that never ends"
    return found


BLOCKS = [block for path in FILES for block in blocks_of(path)]


def imported(code: str) -> set[str]:
    """The top-level packages a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_every_python_block_is_found_and_every_table_names_one():
    for path in FILES:  # an indented fence (inside a list) would be skipped silently: there is none
        assert all(line.strip() != "```python" or line == "```python" for line in path.read_text(encoding="utf-8").splitlines()), path
    ids = {block.id: block for block in BLOCKS}
    for name in [*KINDS, *SLOW, *NEEDS]:  # not left behind when a block is added above it
        assert name in ids and not ids[name].not_run, name
    assert all(ids[name].names for name in KINDS)


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.id in SLOW else []) for b in BLOCKS]
)
def test_block_runs(block, request, tmp_path, monkeypatch):
    if block.not_run:
        pytest.skip(block.not_run)
    for package in sorted(imported(block.code) & OPTIONAL | NEEDS.get(block.id, set())):
        pytest.importorskip(package)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace = {"__name__": "__main__"}
    namespace.update({name: request.getfixturevalue(name) for name in block.names})
    # Line numbers as in the markdown file: a traceback points at the line of the example.
    code = compile("\n" * (block.line - 1) + block.code, str(ROOT / block.path), "exec")
    exec(code, namespace)


# --- the names blocks take from their context ------------------------------------------------------


@pytest.fixture
def kind(block):
    return KINDS.get(block.id, "images")


@pytest.fixture
def autotune():
    import autotune

    return autotune


@pytest.fixture
def F():
    return torch.nn.functional


@pytest.fixture
def L():
    return pytest.importorskip("lightning.pytorch")


@pytest.fixture
def hf():
    pytest.importorskip("transformers")
    from autotune.integrations import hf

    return hf


@pytest.fixture
def AutotuneCallback():
    pytest.importorskip("lightning")
    from autotune.integrations.lightning import AutotuneCallback

    return AutotuneCallback


@pytest.fixture
def plan_accumulation():
    pytest.importorskip("accelerate")
    from autotune.integrations.accelerate import plan_accumulation

    return plan_accumulation


def images(n: int = 2048, seed: int = 0) -> TensorDataset:
    """3x16x16 images with 10 classes, synthetic."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def cnn() -> nn.Module:
    """A small CNN whose activations dominate its memory (256 samples do not fit in 2 MiB)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


def texts(n: int = 512) -> list[dict[str, torch.Tensor]]:
    """Sequences of 8 to 32 token ids, one dict each."""
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 500, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g)} for _ in range(n)]


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Dynamic padding to the longest in the batch: ids and mask 0, labels -100 where padded."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["input_ids"])], mask[i, : len(s["input_ids"])] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.fixture
def hf_model():
    pytest.importorskip("transformers")
    from hf_models import gpt2

    return gpt2()


@pytest.fixture
def hf_loader():
    return DataLoader(texts(), batch_size=32, collate_fn=pad)


@pytest.fixture
def model(kind, request):
    if kind == "hf":
        return request.getfixturevalue("hf_model")
    if kind == "tokens":
        from helpers import token_lm

        return token_lm()
    return cnn()


@pytest.fixture
def dataset(kind):
    return texts() if kind == "hf" else images()


@pytest.fixture
def loader(kind, dataset):
    if kind == "hf":
        return DataLoader(dataset, batch_size=32, collate_fn=pad)
    if kind == "tokens":
        from helpers import TokenData, pad_tokens

        return DataLoader(TokenData(), batch_size=8, collate_fn=pad_tokens)
    return DataLoader(dataset, batch_size=32, shuffle=True)


@pytest.fixture
def loss_fn(kind):
    if kind == "hf":
        return lambda model, batch: model(**batch).loss
    if kind == "tokens":
        from helpers import token_mean

        return token_mean
    return lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1])


@pytest.fixture
def xy_loader():
    """Dict batches {"x": images, "y": float targets shaped as the model's output}."""
    x, _ = images().tensors
    y = torch.randn(len(x), 10, generator=torch.Generator().manual_seed(1))
    return DataLoader([{"x": a, "y": b} for a, b in zip(x, y)], batch_size=32)


@pytest.fixture
def x():
    return images(32).tensors[0]


@pytest.fixture
def criterion():
    return nn.CrossEntropyLoss()


@pytest.fixture
def accumulation_steps():
    return 4


@pytest.fixture
def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def opt(optimizer):
    return optimizer


@pytest.fixture
def scheduler(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)


@pytest.fixture
def plan(kind, model, loader, optimizer, loss_fn, autotune):
    """A plan for the block's model and loader, under a limit that forces accumulation."""
    limit = "150KiB" if kind == "tokens" else "2MiB"
    plan = autotune.plan(model, loader, target_batch=64, optimizer=optimizer, loss_fn=loss_fn, memory_limit=limit,
                         headroom=0, progress=False)
    assert plan.accumulation_steps > 1
    return plan


@pytest.fixture
def accelerator():
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4)


@pytest.fixture
def collator():
    return pad


@pytest.fixture
def args(tmp_path):
    transformers = pytest.importorskip("transformers")
    return transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=32, num_train_epochs=1,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True)


@pytest.fixture
def trainer(hf_model, args):
    transformers = pytest.importorskip("transformers")
    return transformers.Trainer(model=hf_model, args=args, train_dataset=texts(), data_collator=pad)


@pytest.fixture
def module():
    L = pytest.importorskip("lightning.pytorch")

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = cnn()

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Classifier()


@pytest.fixture
def dm():
    L = pytest.importorskip("lightning.pytorch")

    class Images(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 256  # what the callback sets (Lightning's batch_arg_name)

        def train_dataloader(self):
            return DataLoader(images(), batch_size=self.batch_size, shuffle=True, drop_last=True)

    return Images()


def test_the_readme_counts_the_bad_inputs_errors_md_numbers():
    """The README's "lists N of them" is the number of numbered rows of docs/errors.md (it said 149 of 152)."""
    said = re.search(r"docs/errors\.md\) lists (\d+) of them", (ROOT / "README.md").read_text())
    rows = re.findall(r"^\| (\d+) \|", (ROOT / "docs" / "errors.md").read_text(), flags=re.M)
    assert said is not None and int(said.group(1)) == len(rows) == int(rows[-1])
