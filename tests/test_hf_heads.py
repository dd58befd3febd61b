"""The Hugging Face Trainer, prepared, over the heads people fine-tune: at 3 accumulation steps of dynamic
padding, the first optimizer step's gradient is one big batch's (the model's own loss over all the
step's samples, in float64, computed here without the Trainer or autotune), and the logged loss is the
big batch's mean. The Trainer alone gets most of these wrong (k times the gradient: transformers
#47688); the first test shows the reference catches that."""

import copy

import pytest
import torch

import autotune

pytestmark = pytest.mark.usefixtures("float64")
transformers = pytest.importorskip("transformers")

from hf_heads import HEADS, Samples, big_batch_gradients, collate, worst_relative  # noqa: E402

TARGET, MICRO = 24, 8


def trainer_for(tmp_path, model, data, *, per_device=TARGET, accumulation=1, **extra):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=1,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", use_cpu=True, report_to=[], save_strategy="no",
        logging_strategy="steps", logging_steps=1, seed=0, dataloader_drop_last=True, max_grad_norm=0.0, disable_tqdm=True, **extra,
    )
    first = {}

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not first:
                first.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Record()])
    return trainer, first


def limit_for(trainer, micro):
    """A memory limit between the planned peaks at ``micro`` and ``micro + 1`` samples (the plan's own
    curve, from a first prepare that is then restored)."""
    from autotune.integrations import hf
    from autotune.memory.curve import MemoryCurve

    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit="1GiB", headroom=0, progress=False)
    plan = prepared.settings.plan
    prepared.restore()
    curve = plan.memory_curve
    if curve is None:  # no estimate (a loss with host ops, such as TRL's metrics): the line through two real trials
        (b1, p1), (b2, p2) = sorted({(t.batch_size, t.peak_memory) for t in plan.trials if not t.estimate})[:2]
        curve = MemoryCurve.through(b1, p1, b2, p2)
    return (curve(micro) + curve(micro + 1)) // 2


def micro_batches(model):
    sizes = []

    def hook(module, args, kwargs, output):
        if module.training and not autotune.is_planning():
            sizes.append(len(next(v for v in kwargs.values() if torch.is_tensor(v))))

    model.register_forward_hook(hook, with_kwargs=True)
    return sizes


def test_the_trainer_alone_steps_k_times_the_big_batch_for_a_head_that_ignores_the_count(tmp_path):
    """What prepare corrects, and proof that the reference below can fail: BERT sequence classification
    at 8 x 3 under the Trainer's own rule."""
    head = HEADS["bert-sequence-classification-padded"]
    model, data = head.make(), Samples(head, 48)
    start = copy.deepcopy(model)
    trainer, first = trainer_for(tmp_path, model, data, per_device=MICRO, accumulation=3)
    trainer.train()
    loss, want = big_batch_gradients(start, [data.items[i] for i in data.accessed[:TARGET]])
    ratio = first["classifier.weight"].norm() / want["classifier.weight"].norm()
    assert 2.5 < ratio < 3.5
    assert trainer.state.log_history[0]["loss"] == pytest.approx(3 * loss, rel=0.2)


@pytest.mark.parametrize("name", list(HEADS))
def test_every_head_prepared_steps_the_big_batch_and_logs_its_mean(tmp_path, name):
    from autotune.integrations import hf

    head = HEADS[name]
    model, data = head.make(), Samples(head, 48)
    start = copy.deepcopy(model)
    trainer, first = trainer_for(tmp_path, model, data)
    own = trainer.compute_loss, trainer.model_accepts_loss_kwargs, trainer._loss_shifts_labels
    limit = limit_for(trainer, MICRO)
    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit=limit, headroom=0, progress=False)
    s = prepared.settings
    assert (s.micro_batch, s.accumulation_steps) == (MICRO, 3), str(prepared)
    exactness = [n for n in s.notes if "exact" in n]
    assert exactness and exactness[0].startswith("exact"), exactness  # never "not exact" or "not checked"
    sizes = micro_batches(model)
    data.accessed.clear()
    trainer.train()
    assert sizes == [MICRO] * 3
    loss, want = big_batch_gradients(start, [data.items[i] for i in data.accessed[:TARGET]])
    bound = 1e-6 if head.float32_loss else 1e-12
    assert worst_relative(first, want) <= bound
    assert trainer.state.log_history[0]["loss"] == pytest.approx(loss, rel=bound)
    prepared.restore()
    assert (trainer.compute_loss, trainer.model_accepts_loss_kwargs, trainer._loss_shifts_labels) == own
    assert trainer.args.per_device_train_batch_size == TARGET and "loss_is_scaled_for_ga" not in trainer.__dict__


def test_the_loss_check_tells_the_rules_apart():
    """What prepare measures, head by head: the count used or ignored, and what the mean is over."""
    from autotune.integrations.hf import check_loss

    def check(name):
        head = HEADS[name]
        args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
        trainer = transformers.Trainer(model=head.make(), args=args, data_collator=collate)
        return check_loss(trainer, collate(Samples(head, 4).items))

    bert = check("bert-sequence-classification-padded")
    assert bert.uses_count is False and bert.mean_over_samples and bert.counted == 4
    tokens = check("bert-token-classification")
    assert tokens.uses_count is False and tokens.mean_over_items and not tokens.mean_over_samples
    gpt2 = check("gpt2-causal-lm")  # no loss_type: the Trainer counts unshifted labels, the loss shifts them
    assert gpt2.uses_count and gpt2.own_items == pytest.approx(gpt2.shifted) and gpt2.shifted == gpt2.counted - 4
    vit = check("vit-image-classification")
    assert vit.uses_count and vit.own_items == pytest.approx(vit.counted)


def test_a_head_that_ignores_the_count_is_exact_for_uneven_micro_batches_too():
    """The correction weights by items, not by micro-batch: two micro-batches of 1 and 5 token
    classification samples give the big batch's loss (the Trainer's division by k would not)."""
    from autotune.integrations.loss_rules import weighted

    head = HEADS["bert-token-classification"]
    model = head.make().train()
    samples = Samples(head, 6).items
    args = transformers.TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, data_collator=collate)
    from autotune.integrations.rows import ONE_ROW

    parts = [collate(samples[:1]), collate(samples[1:])]
    total = sum(int(p["labels"].ne(-100).sum()) for p in parts)
    loss = weighted(trainer, trainer.compute_loss, "items", ONE_ROW, {"samples": 6, "items": total})
    got = sum(loss(model, dict(p), num_items_in_batch=torch.tensor(total)) for p in parts)
    assert float(got.detach()) == pytest.approx(float(model(**collate(samples)).loss.detach()), rel=1e-12)


def word_tokenizer(words):
    """A word-level tokenizer from a word list (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = ["<pad>", "<unk>", "<eos>", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # inside TRL's SFTConfig
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("packing", [False, True], ids=["unpacked", "packed"])
def test_trl_sft_trainer_trains_the_target_per_step(tmp_path, packing):
    """SFTTrainer (a Trainer subclass with its own compute_loss, a token loss) trains 8 x 3 sequences a
    step; packed, its padding-free collator flattens each micro-batch into one row, and planning sees
    the packed sequences padded instead."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from autotune.integrations import hf

    words = [f"w{i}" for i in range(60)]
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, 60, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g))
             for _ in range(160)]
    tokenizer = word_tokenizer(words)
    model = HEADS["gpt2-causal-lm"].make()
    model.resize_token_embeddings(len(tokenizer))
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=TARGET, max_steps=1, use_cpu=True, report_to=[],
                         save_strategy="no", packing=packing, max_length=32, learning_rate=0.1, optim="sgd", disable_tqdm=True,
                         logging_strategy="no", dataset_num_proc=None)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tokenizer)
    limit = limit_for(trainer, MICRO)
    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit=limit, headroom=0, progress=False)
    s = prepared.settings
    assert s.accumulation_steps >= 2 and s.micro_batch * s.accumulation_steps == TARGET, str(prepared)
    assert any(n.startswith("exact") for n in s.notes) and any("padding-free" in n for n in s.notes) is packing
    shapes = []
    model.register_forward_hook(lambda m, a, kw, o: shapes.append(tuple(kw["input_ids"].shape))
                                if m.training and not autotune.is_planning() else None, with_kwargs=True)
    trainer.train()
    assert len(shapes) == s.accumulation_steps and trainer.args.per_device_train_batch_size * len(shapes) == TARGET
    if not packing:
        assert [rows for rows, _ in shapes] == [s.micro_batch] * s.accumulation_steps  # 24 sequences in the step
    else:
        assert all(rows == 1 for rows, _ in shapes)  # each micro-batch: its packed sequences in one flattened row


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # inside PEFT
def test_a_peft_lora_model_steps_the_big_batch(tmp_path):
    """A LoRA adapter on BERT sequence classification (frozen base): the Trainer sees a PeftModel; the
    head ignores the count, and the adapters' first-step gradient is one big batch's."""
    peft = pytest.importorskip("peft")
    from autotune.integrations import hf

    head = HEADS["bert-sequence-classification-padded"]
    config = peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0)
    model = peft.get_peft_model(head.make(), config)
    start, data = copy.deepcopy(model), Samples(head, 48)
    trainer, first = trainer_for(tmp_path, model, data)
    limit = limit_for(trainer, MICRO)
    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit=limit, headroom=0, progress=False)
    assert (prepared.settings.micro_batch, prepared.settings.accumulation_steps) == (MICRO, 3), str(prepared)
    data.accessed.clear()
    trainer.train()
    loss, want = big_batch_gradients(start, [data.items[i] for i in data.accessed[:TARGET]])
    assert set(first) == set(want) and all("lora" in n or "classifier" in n for n in want)  # the base is frozen
    assert worst_relative(first, want) <= 1e-12
    assert trainer.state.log_history[0]["loss"] == pytest.approx(loss, rel=1e-12)
