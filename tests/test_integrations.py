"""The real trainers, planned, on the CPU with tiny models under a memory limit the target does not fit:
each trains the planned micro-batch and accumulation, every optimizer step sees the target's samples
(counted from what the model saw), and where the trainer's accumulation is exact the first step's
gradient equals one big batch's in float64 (a reference computed here, apart from autotune)."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autotune

pytestmark = pytest.mark.usefixtures("float64")

VOCAB, PAD = 500, 0


# --- Hugging Face Trainer -----------------------------------------------------------------------


class Texts(Dataset):
    """Token sequences of different lengths (5 to 24), as a tokenizer leaves them."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(5, 25, (n,), generator=g)
        self.items = [torch.randint(1, VOCAB, (int(n_),), generator=g) for n_ in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.items[i]}


def pad_collate(samples):
    """Pad to the longest in the batch: ids with PAD, labels with -100, an attention mask."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), longest), PAD, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n], mask[i, :n] = s["input_ids"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Seen:
    """Per optimizer step: the samples the model saw in training forwards (unpadded), and the first step's gradients."""

    def __init__(self, model):
        self.steps, self.current, self.grads, self.micro = [], [], None, []
        model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output):
        if module.training and not autotune.is_planning():
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            self.current += [row[m.bool()].clone() for row, m in zip(ids, mask)]
            self.micro.append(len(ids))

    def step(self, model):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        self.steps.append(self.current)
        self.current = []


def lm_big_batch_grads(model, sequences):
    """The gradient of the mean next-token loss over all the tokens of ``sequences``, each run alone."""
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    total = sum(F.cross_entropy(model(t.unsqueeze(0)).logits[0, :-1], t[1:], reduction="sum") for t in sequences)
    (total / sum(len(t) - 1 for t in sequences)).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def float64_lm_loss(outputs, labels, num_items_in_batch=None):
    """The next-token loss over the step's items, in float64 (transformers' own upcasts to float32)."""
    logits, labels = outputs.logits[:, :-1], labels[:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else (labels != -100).sum())


@pytest.mark.parametrize("loss", ["float64", "the-models-own"])
def test_the_hf_trainer_trains_the_planned_split_and_the_first_step_is_the_big_batch(tmp_path, loss):
    """Token-weighted accumulation (the Trainer's num_items_in_batch) with a data collator that pads:
    with the planned split every step is the exact token mean of its samples. The model's own loss
    computes in float32 (transformers upcasts its logits), hence the looser bound there; and since a
    GPT-2 built from a config has no loss_type, the Trainer counts unshifted labels, which prepare()
    corrects (without it each step is scaled by (tokens - sequences) / tokens, about 7% here)."""
    transformers = pytest.importorskip("transformers")
    import hf_models

    from autotune.integrations import hf

    model = hf_models.gpt2(layers=2, dim=32, vocab=VOCAB, positions=64).double()
    if loss == "float64":
        model.loss_type = "ForCausalLM"  # as a config that names its loss: the Trainer then counts shifted labels itself
    start = copy.deepcopy(model)
    own = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=16, gradient_accumulation_steps=1, max_steps=2, learning_rate=0.1,
        optim="sgd", lr_scheduler_type="constant", use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        seed=0, dataloader_drop_last=True, max_grad_norm=0.0,  # no clipping: the gradient as accumulated
    )
    seen = Seen(model)

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.step(model)

    trainer = transformers.Trainer(model=model, args=own, train_dataset=Texts(64), data_collator=pad_collate, callbacks=[Record()],
                                   compute_loss_func=float64_lm_loss if loss == "float64" else None)
    before = dataclasses.asdict(own)
    prepared = hf.prepare(trainer, memory_limit="2MiB", headroom=0, progress=False)
    s = prepared.settings
    assert s.effective_batch == 16 and s.accumulation_steps > 1 and s.micro_batch <= s.plan.micro_batch < 16
    assert trainer.args is not own and dataclasses.asdict(own) == before  # your arguments untouched
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (s.micro_batch, s.accumulation_steps)
    assert any("learning rate left as it is" in n for n in s.notes) and any("num_items_in_batch" in n for n in s.notes)
    assert any("corrected for this Trainer" in n for n in s.notes) is (loss != "float64")
    trainer.train()
    assert [len(step) for step in seen.steps] == [16, 16]  # the target's samples, every step
    assert set(seen.micro) == {s.micro_batch}
    want = lm_big_batch_grads(start, seen.steps[0])
    worst = max(((seen.grads[n] - g).abs().max() / g.abs().max()).item() for n, g in want.items())
    assert worst <= (1e-12 if loss == "float64" else 1e-5)
    prepared.restore()
    assert trainer.args is own and "_inner_training_loop" not in trainer.__dict__


def test_an_out_of_memory_retry_of_the_trainer_keeps_the_target(tmp_path):
    transformers = pytest.importorskip("transformers")
    import hf_models

    from autotune.integrations import hf

    model = hf_models.gpt2(layers=1, dim=32, vocab=VOCAB, positions=64).double()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=12, gradient_accumulation_steps=2, max_steps=1, learning_rate=0.1,
        optim="sgd", use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0, auto_find_batch_size=True,
    )
    seen = Seen(model)

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            seen.step(model)

    trainer = transformers.Trainer(model=model, args=args, train_dataset=Texts(48), data_collator=pad_collate, callbacks=[Record()])
    prepared = hf.prepare(trainer, memory_limit="1GiB", progress=False)  # everything fits: 24 in one micro-batch
    assert (prepared.settings.micro_batch, prepared.settings.accumulation_steps) == (24, 1)
    failed = []

    def first_forward_fails(module, args, kwargs):
        if module.training and not failed and not autotune.is_planning():
            failed.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")  # what the finder retries on

    handle = model.register_forward_pre_hook(first_forward_fails, with_kwargs=True)
    trainer.train()
    handle.remove()
    assert failed and prepared.retries  # the finder retried smaller, and the accumulation was raised with it
    micro, steps = prepared.retries[-1]
    assert micro * steps == 24 and micro < 24
    assert [len(step) for step in seen.steps] == [24]  # the target kept


def bert_trainer(tmp_path, per_device=24, accumulation=1, **extra):
    transformers = pytest.importorskip("transformers")
    from hf_heads import HEADS, Samples, collate

    head = HEADS["bert-sequence-classification-padded"]
    model = head.make()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=1,
        learning_rate=0.1, use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no", seed=0, disable_tqdm=True, **extra,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Samples(head, 48), data_collator=collate)


def test_an_out_of_memory_retry_tries_each_failing_size_once(tmp_path):
    """The finder shrinks by 0.9 (24 -> 21 -> 18 -> 16): each retry trains the largest divisor of the
    per-device share strictly below the size that failed, so 24, 12 and 8 fail once each and 6 trains."""
    from autotune.integrations import hf

    trainer = bert_trainer(tmp_path, optim="sgd", auto_find_batch_size=True)
    prepared = hf.prepare(trainer, memory_limit="1GiB", progress=False)
    assert (prepared.settings.micro_batch, prepared.settings.accumulation_steps) == (24, 1)
    attempts = []

    def too_big(module, args, kwargs):
        if module.training and not autotune.is_planning():
            size = len(kwargs["input_ids"])
            attempts.append(size)
            if size > 6:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    handle = trainer.model.register_forward_pre_hook(too_big, with_kwargs=True)
    trainer.train()
    handle.remove()
    assert attempts == [24, 12, 8, 6, 6, 6, 6]  # each failing size once, then one step of 4 x 6
    assert prepared.retries == [(12, 2), (8, 3), (6, 4)]
    assert (prepared.micro_batch, prepared.accumulation_steps) == (6, 4)
    assert "after out-of-memory errors at 24, 12, 8 per device: trains 6 per device x 4 accumulation steps" in str(prepared)


def test_a_prepared_trainer_is_refused_a_second_prepare_and_restore_puts_it_back_once(tmp_path):
    from autotune.integrations import hf

    trainer = bert_trainer(tmp_path)
    own_args, own_loss = trainer.args, trainer.compute_loss
    first = hf.prepare(trainer, memory_limit="1GiB", progress=False)
    prepared_args = trainer.args
    with pytest.raises(ValueError, match="prepared already .* call restore"):
        hf.prepare(trainer, memory_limit="1GiB", progress=False)
    assert trainer.args is prepared_args  # the refused call changed nothing
    first.restore()
    first.restore()
    assert trainer.args is own_args and trainer.compute_loss == own_loss and "_autotune_prepared" not in trainer.__dict__
    second = hf.prepare(trainer, target_batch=12, memory_limit="1GiB", progress=False)
    assert second.settings.effective_batch == 12
    first.restore()  # an old preparation does not undo the one in force
    assert trainer.args.per_device_train_batch_size == 12
    second.restore()
    assert trainer.args is own_args


@pytest.mark.parametrize("name, value", [("target_batch", 0), ("base_batch", 0), ("target_batch", True), ("target_batch", 2.5)],
                         ids=["target-0", "base-0", "target-bool", "target-float"])
def test_a_batch_that_is_not_a_positive_int_is_refused_before_anything_changes(tmp_path, name, value):
    from autotune.integrations import hf

    trainer = bert_trainer(tmp_path)
    own = trainer.args
    with pytest.raises(ValueError, match=f"Invalid {name} {value!r}: give a positive int"):
        hf.prepare(trainer, progress=False, **{name: value})
    assert trainer.args is own and "compute_loss" not in trainer.__dict__


def test_the_warm_up_is_capped_when_the_run_is_short(tmp_path):
    """A learning rate scaled up under AdamW asks for 2,000 warm-up steps; a run of 20 steps gets 2."""
    from autotune.integrations import hf

    trainer = bert_trainer(tmp_path, per_device=8, accumulation=1)
    trainer.args.max_steps = 20
    prepared = hf.prepare(trainer, target_batch=24, memory_limit="1GiB", lr_rule="sqrt", progress=False)
    assert trainer.args.warmup_steps == 2 == prepared.settings.warmup_steps
    assert any("warm-up capped at 2 steps, 10% of a run of 20 steps (the rule gives 2000)" in n for n in prepared.settings.notes)


# --- Lightning ------------------------------------------------------------------------------------


def regression(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g, dtype=torch.float64)
    return TensorDataset(x, x @ torch.randn(8, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, generator=g, dtype=torch.float64))


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")  # inside Lightning, with this torch
def test_lightning_trains_the_planned_split_restores_what_it_set_and_the_first_step_is_the_big_batch(tmp_path):
    L = pytest.importorskip("lightning.pytorch")
    from autotune.integrations.lightning import AutotuneCallback

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    start = copy.deepcopy(net)
    seen = {"x": [], "steps": [], "grads": None, "micro": []}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.batch_size = net, 48

        def training_step(self, batch, batch_idx):
            x, y = batch
            if not autotune.is_planning():
                seen["x"].append(x.clone())
                seen["micro"].append(len(x))
            loss = F.mse_loss(self.net(x).squeeze(-1), y)
            self.log("loss", loss)
            return loss

        def on_before_optimizer_step(self, optimizer):
            if seen["grads"] is None:
                seen["grads"] = [p.grad.clone() for p in self.net.parameters()]
            seen["steps"].append(torch.cat(seen["x"]))
            seen["x"] = []

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return DataLoader(regression(), batch_size=self.batch_size)

    callback = AutotuneCallback(memory_limit="40KiB", headroom=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback], default_root_dir=str(tmp_path), precision="64-true")
    module = Module()
    trainer.fit(module)
    s = callback.settings
    assert s.effective_batch == 48 and s.accumulation_steps > 1 and s.micro_batch < 48
    assert [len(step) for step in seen["steps"]] == [48, 48] and set(seen["micro"]) == {s.micro_batch}
    assert module.batch_size == 48 and trainer.accumulate_grad_batches == 1  # put back when fitting ended
    x, y = regression()[:48]
    ref = copy.deepcopy(start)
    F.mse_loss(ref(x).squeeze(-1), y).backward()
    assert max((g - p.grad).abs().max().item() for g, p in zip(seen["grads"], ref.parameters())) <= 1e-12  # equal micro-batches: exact
    assert any("divides each micro-batch's loss by accumulate_grad_batches" in n for n in s.notes)


def lightning_parts(tmp_path, *, fail_at=None, samples=96, batch_size=48, datamodule_batch=None, ignore_batch_size=False,
                    manual=False, reads_trainer=False, callbacks=None, lr_rule="none"):
    """A regression module (SGD with a StepLR), optionally a datamodule, and a trainer with the callback."""
    L = pytest.importorskip("lightning.pytorch")
    from autotune.integrations.lightning import AutotuneCallback

    torch.manual_seed(0)
    data = regression(samples)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1)).double()
            self.batch_size, self.automatic_optimization = batch_size, not manual

        def training_step(self, batch, batch_idx):
            if reads_trainer:
                assert self.trainer.accumulate_grad_batches >= 1 and self.optimizers() is not None
            if fail_at is not None and not autotune.is_planning() and batch_idx == fail_at[0]:
                raise fail_at[1]
            x, y = batch
            return F.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=100)]

        def train_dataloader(self):
            return DataLoader(data, batch_size=64 if ignore_batch_size else self.batch_size)

    class Data(L.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = datamodule_batch

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size)

    callback = AutotuneCallback(memory_limit="40KiB", headroom=0, lr_rule=lr_rule, base_batch=16 if lr_rule != "none" else None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, *(callbacks or [])], default_root_dir=str(tmp_path),
                        precision="64-true")
    return Module(), (Data() if datamodule_batch else None), trainer, callback


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["exception", "ctrl-c"])
def test_lightning_puts_everything_back_when_fitting_stops(tmp_path, error):
    """Batch sizes on both the module and the datamodule (each back to its own), the accumulation, the
    learning rates and the scheduler's base rates, after an error in training_step or Ctrl-C."""
    import signal

    module, dm, trainer, callback = lightning_parts(tmp_path, fail_at=(1, error), batch_size=32, datamodule_batch=48, lr_rule="linear")
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit if isinstance(error, KeyboardInterrupt) else RuntimeError):
            trainer.fit(module, datamodule=dm)
    finally:
        signal.signal(signal.SIGINT, handler)  # Lightning ignores further Ctrl-C after the first
    s = callback.settings
    assert s.accumulation_steps > 1 and s.learning_rate is not None  # it had set them
    assert (module.batch_size, dm.batch_size, trainer.accumulate_grad_batches) == (32, 48, 1)
    optimizer = trainer.optimizers[0]
    assert optimizer.param_groups[0]["lr"] == 0.05 and optimizer.param_groups[0]["initial_lr"] == 0.05
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [0.05]


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
@pytest.mark.parametrize("case, match", [
    ("two-callbacks", "2 AutotuneCallbacks on one Trainer"),
    ("manual", "automatic_optimization is False"),
    ("given-loader", "Invalid train_dataloaders=DataLoader: a loader passed to trainer.fit"),
    ("loader-ignores-batch-size", "its first batch has 64 samples, but AutotuneCallback set batch_size=16"),
])
def test_lightning_refuses_what_would_train_other_batches_and_changes_nothing(tmp_path, case, match):
    from autotune.integrations.lightning import AutotuneCallback

    extra = [AutotuneCallback(memory_limit="40KiB")] if case == "two-callbacks" else None
    module, _, trainer, callback = lightning_parts(tmp_path, manual=case == "manual", callbacks=extra,
                                                   ignore_batch_size=case == "loader-ignores-batch-size")
    start = [p.detach().clone() for p in module.parameters()]
    loader = DataLoader(regression(), batch_size=48) if case == "given-loader" else None
    with pytest.raises(ValueError, match=match):
        trainer.fit(module, train_dataloaders=loader)
    assert (module.batch_size, trainer.accumulate_grad_batches) == (48, 1)
    assert all(torch.equal(a, b) for a, b in zip(start, module.parameters()))  # no step trained


@pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated")
def test_lightning_plans_a_training_step_that_reads_its_trainer_and_quantifies_the_epoch_tail(tmp_path):
    """100 samples at 16 x 3: the epoch ends with one micro-batch of 4 samples, which Lightning divides by 3."""
    module, _, trainer, callback = lightning_parts(tmp_path, reads_trainer=True, samples=100)
    trainer.fit(module)
    s = callback.settings
    assert (s.micro_batch, s.accumulation_steps) == (16, 3), str(s)
    assert any("ends with a step of 4 samples (1 of 3 micro-batches per device) that Lightning still divides by 3: "
               "its gradient is 1/3 = 0.333 of their mean" in n for n in s.notes), s.notes


@pytest.mark.parametrize("samples, drop_last, says", [
    (100, False, "ends with a step of 4 samples (1 of 3 micro-batches per device)"),
    (120, True, "ends with a step of 16 samples (1 of 3 micro-batches per device)"),
    (92, False, "has a short micro-batch of 12 samples per device"),
], ids=["short-step", "short-step-drop-last", "short-micro-batch"])
def test_the_lightning_epoch_tail_advice_fits_the_loader(samples, drop_last, says):
    # drop_last drops a short micro-batch, never a short step: advised only where it helps, never to a
    # loader that has it already.
    import types

    pytest.importorskip("lightning")
    from autotune.integrations.lightning import _epoch_tail

    loader = types.SimpleNamespace(dataset=list(range(samples)), drop_last=drop_last)
    settings = types.SimpleNamespace(world_size=1, micro_batch=16, accumulation_steps=3)
    note = _epoch_tail(loader, settings, None)
    assert says in note
    assert ("drop_last=True" in note) == (says.startswith("has a short micro-batch"))


# --- Accelerate -----------------------------------------------------------------------------------


def test_an_accelerate_script_trains_the_planned_split_and_the_first_step_is_the_big_batch():
    accelerate = pytest.importorskip("accelerate")
    from autotune.integrations.accelerate import plan_accumulation

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1)).double()
    start = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    accelerator = accelerate.Accelerator(cpu=True)
    data = regression()

    def loss_fn(m, batch):
        x, y = batch
        return F.mse_loss(m(x).squeeze(-1), y)

    settings = plan_accumulation(accelerator, model, DataLoader(data, batch_size=16), target_batch=48, optimizer=optimizer,
                                 loss_fn=loss_fn, memory_limit="40KiB", headroom=0)
    assert settings.effective_batch == 48 and settings.accumulation_steps > 1
    assert accelerator.gradient_accumulation_steps == settings.accumulation_steps
    loader = DataLoader(data, batch_size=settings.micro_batch, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, current, first = [], 0, None
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model, batch))
            current += len(batch[0])
            if accelerator.sync_gradients:
                if first is None:
                    first = [p.grad.clone() for p in model.parameters()]
                steps.append(current)
                current = 0
            optimizer.step()
            optimizer.zero_grad()
    assert steps and set(steps) == {48}
    x, y = data[:48]
    ref = copy.deepcopy(start)
    F.mse_loss(ref(x).squeeze(-1), y).backward()
    assert max((g - p.grad).abs().max().item() for g, p in zip(first, ref.parameters())) <= 1e-12


def accelerate_token_steps(accelerate, *, weighted):
    """A token mean over padded sequences under Accelerate (44 samples, steps of 24 and 20) at a learning
    rate of 0: each step's gradient, taken after the optimizer stepped."""
    from helpers import TokenData, items, pad_tokens, token_lm, token_mean

    from autotune.integrations.accelerate import ItemWeights, plan_accumulation

    model = token_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    accelerator = accelerate.Accelerator(cpu=True)
    settings = plan_accumulation(accelerator, model, DataLoader(TokenData(), batch_size=24, collate_fn=pad_tokens), target_batch=24,
                                 optimizer=optimizer, loss_fn=token_mean, memory_limit="150KiB", headroom=0)
    weigh = ItemWeights(accelerator, optimizer, count=items) if weighted else (lambda batch: 1.0)
    loader = DataLoader(TokenData(), batch_size=settings.micro_batch, collate_fn=pad_tokens)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    grads = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(weigh(batch) * token_mean(model, batch))
            optimizer.step()
            if accelerator.sync_gradients:
                grads.append([p.grad.clone() for p in model.parameters()])
            optimizer.zero_grad()
    if weighted:
        weigh.remove()
    return settings, grads


@pytest.mark.parametrize("weighted", [True, False], ids=["item-weights", "plain"])
def test_accelerate_with_a_token_mean_over_padding_is_exact_with_item_weights(weighted):
    """With ItemWeights every step is the big batch's token mean (the short last one too), to 1e-12;
    without, Accelerate's equal weights are off, as the note says."""
    accelerate = pytest.importorskip("accelerate")
    from helpers import TokenData, pad_tokens, token_lm, token_mean

    settings, grads = accelerate_token_steps(accelerate, weighted=weighted)
    assert settings.accumulation_steps > 1 and len(grads) == 2
    data, worst = TokenData(), 0.0
    for step, got in enumerate(grads):
        ref = token_lm()
        token_mean(ref, pad_tokens(data.items[24 * step:24 * step + 24])).backward()
        worst = max(worst, max(((g - p.grad).abs().max() / p.grad.abs().max()).item() for g, p in zip(got, ref.parameters())))
    assert (worst <= 1e-12) if weighted else (worst > 1e-3), worst
    assert any("ItemWeights weights each micro-batch by its items" in n for n in settings.notes)


def test_plan_accumulation_refuses_a_non_bool_apply_and_says_which_optimizer_it_assumed():
    accelerate = pytest.importorskip("accelerate")
    from autotune.integrations.accelerate import plan_accumulation

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    accelerator = accelerate.Accelerator(cpu=True)
    data = DataLoader(regression(), batch_size=16)
    steps = accelerator.gradient_accumulation_steps

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]).squeeze(-1), batch[1])

    with pytest.raises(TypeError, match="Invalid apply 'no'"):
        plan_accumulation(accelerator, model, data, target_batch=48, loss_fn=loss_fn, memory_limit="1GiB", apply="no")
    assert accelerator.gradient_accumulation_steps == steps  # 'no' was not taken for a yes
    settings = plan_accumulation(accelerator, model, data, target_batch=48, loss_fn=loss_fn, memory_limit="1GiB", apply=False)
    assert accelerator.gradient_accumulation_steps == steps
    assert any("no optimizer= given: planned with AdamW(lr=1e-3)" in n for n in settings.notes), settings.notes
    given = plan_accumulation(accelerator, model, data, target_batch=48, loss_fn=loss_fn, memory_limit="1GiB", apply=False,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not any("no optimizer= given" in n for n in given.notes)


def test_the_integrations_are_not_imported_by_autotune():
    import subprocess
    import sys

    code = "import sys, autotune; print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'accelerate') or m.startswith('autotune.integrations')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated")  # Lightning's pytree on dict batches
@pytest.mark.parametrize("count", [True, False], ids=["count", "no-count"])
def test_lightning_with_a_token_mean_over_padding_is_exact_with_count(tmp_path, count):
    """A token mean over padded sequences (44 samples: steps of 24 and 20, the last one short): with
    count= every step's gradient is the big batch's token mean, to 1e-12; without it Lightning's equal
    weights are off, as the note says."""
    L = pytest.importorskip("lightning.pytorch")
    from helpers import TokenData, items, pad_tokens, token_lm, token_mean

    from autotune.integrations.lightning import AutotuneCallback

    net, grads = token_lm(), []

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self.batch_size = net, 24

        def training_step(self, batch, batch_idx):
            return token_mean(self.net, batch)

        def on_before_optimizer_step(self, optimizer):
            grads.append([p.grad.clone() for p in self.net.parameters()])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return DataLoader(TokenData(), batch_size=self.batch_size, collate_fn=pad_tokens)

    callback = AutotuneCallback(target_batch=24, memory_limit="150KiB", headroom=0, count=items if count else None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback], default_root_dir=str(tmp_path), precision="64-true")
    trainer.fit(Module())
    s = callback.settings
    assert s.accumulation_steps > 1 and len(grads) == 2, str(s)
    data = TokenData()
    worst = 0.0
    for step, got in enumerate(grads):
        ref = token_lm()
        token_mean(ref, pad_tokens(data.items[24 * step:24 * step + 24])).backward()
        worst = max(worst, max(((g - p.grad).abs().max() / p.grad.abs().max()).item() for g, p in zip(got, ref.parameters())))
    if count:
        assert worst <= 1e-12 and any(n.startswith("exact for a loss that is the mean over the items") for n in s.notes)
    else:
        assert worst > 1e-3 and any("not for token losses with padding" in n for n in s.notes)
    assert "training_step" not in trainer.lightning_module.__dict__  # put back
