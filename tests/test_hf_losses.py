"""Every loss rule the Hugging Face Trainer can run, prepared: a ``compute_loss_func`` written as the Trainer
documents it, label smoothing, sum reductions, a custom causal LM that shifts its own labels, losses
without labels (question answering), contrastive losses (CLIP), and TRL's preference trainers (DPO,
reward), in float64 at 8 x 3 with padding, and at an epoch's short last step (8 + 8 + 4).

The reference is the same Trainer alone at one micro-batch of the whole step (24 x 1, or 20 x 1 for the
last step): no accumulation, nothing of autotune, so its step is the big batch's by definition, and the
same samples in the same order (sequential sampling). Each prepared run either matches it (gradient and
logged loss, both steps) under a note that says exact, or says "not exact" with the factor it measured,
which is recomputed here from the model's own loss."""

import copy
import re

import pytest
import torch

pytestmark = [
    pytest.mark.usefixtures("float64"),
    # inside TRL's configs and trainers (transformers 5 renamed gradient checkpointing)
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing.*` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]
transformers = pytest.importorskip("transformers")

from hf_heads import HEADS, PAD, VOCAB, Samples, collate, worst_relative  # noqa: E402
from test_hf_heads import limit_for, word_tokenizer  # noqa: E402

TARGET, MICRO, SAMPLES = 24, 8, 44  # two steps an epoch: 24 = 8 + 8 + 8, then 20 = 8 + 8 + 4


def run(tmp_path, model, data, *, prepare, collator=collate, trainer_cls=None, config_cls=None, loss_func=None, **extra):
    """One epoch of ``data`` (sequential) at a learning rate of 0: the gradient of each optimizer step
    (the parameters never move, so every step's reference is the start model's) and its logged loss."""
    config_cls = config_cls or transformers.TrainingArguments
    trainer_cls = trainer_cls or transformers.Trainer
    args = config_cls(output_dir=str(tmp_path / ("prepared" if prepare else "alone")), per_device_train_batch_size=TARGET,
                      num_train_epochs=1, learning_rate=0.0, optim="sgd", lr_scheduler_type="constant", use_cpu=True, report_to=[],
                      save_strategy="no", logging_strategy="steps", logging_steps=1, seed=0, dataloader_drop_last=False, max_grad_norm=0.0,
                      disable_tqdm=True, **extra)
    grads = []

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    kwargs = {"data_collator": collator} if collator is not None else {}
    if loss_func is not None:
        kwargs["compute_loss_func"] = loss_func
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[Record()], **kwargs)
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    prepared = None
    if prepare:
        from autotune.integrations import hf

        limit = limit_for(trainer, MICRO)
        prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit=limit, headroom=0, progress=False)
        assert (prepared.settings.micro_batch, prepared.settings.accumulation_steps) == (MICRO, 3), str(prepared)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return grads, losses, prepared


def exactness(prepared):
    (note,) = [n for n in prepared.settings.notes if "exact" in n or "not checked" in n]
    return note


def assert_exact(tmp_path, make, data, bound=1e-12, **kw):
    """Prepared at 8 x 3 equals the Trainer alone at 24 x 1, both steps (the short last one included),
    gradient and logged loss, under a note that says exact."""
    want, want_losses, _ = run(tmp_path, make(), data, prepare=False, **kw)
    got, got_losses, prepared = run(tmp_path, make(), data, prepare=True, **kw)
    note = exactness(prepared)
    assert note.startswith("exact"), note
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        assert worst_relative(g, w) <= bound
    assert got_losses == pytest.approx(want_losses, rel=bound)
    return prepared


def measured_factor(note):
    return float(re.search(r"the mean of its two halves' losses is ([0-9.e+-]+) times", note).group(1))


def halves_factor(model, samples, collator=collate):
    """The mean of two halves' losses over the whole batch's, from the model's own loss (eval mode), each
    batch collated by itself (padded to its own longest, as micro-batches are)."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        whole, a, b = (float(model(**collator(part)).loss) for part in (samples, samples[:2], samples[2:]))
    return (a + b) / 2 / whole


# ---- a compute_loss_func as the Trainer documents it ----


def token_sum_over_count(outputs, labels, num_items_in_batch):
    """The Trainer's documented shape: the summed token loss over the step's items."""
    logits = outputs.logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss / num_items_in_batch


def test_a_documented_compute_loss_func_plans_and_steps_the_big_batch(tmp_path):
    """It divides by num_items_in_batch, which the planner now passes (it was None, a TypeError)."""
    head = HEADS["bert-token-classification"]
    data = Samples(head, SAMPLES)
    want, want_losses, _ = run(tmp_path, head.make(), data, prepare=False)  # the model's own token mean, without the function
    got, got_losses, prepared = run(tmp_path, head.make(), data, prepare=True, loss_func=token_sum_over_count)
    assert exactness(prepared).startswith("exact")
    for g, w in zip(got, want):
        assert worst_relative(g, w) <= 1e-12
    assert got_losses == pytest.approx(want_losses, rel=1e-12)


def shifted_sum_over_count(outputs, labels, num_items_in_batch):
    """The documented shape for a causal LM: the summed next-token loss over the step's items."""
    logits = outputs.logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100,
                                             reduction="sum") / num_items_in_batch


def labels_of(samples):
    labels = collate(samples)["labels"]
    return int(labels.ne(-100).sum()), int(labels[:, 1:].ne(-100).sum())


def token_mean_gradients(model, samples):
    """The gradient of one big batch's true next-token mean, in float64 with torch's cross entropy (GPT-2's own
    loss computes in float32): neither the Trainer nor autotune."""
    model = copy.deepcopy(model).train()
    batch = collate(samples)
    labels = batch.pop("labels")
    logits = model(**batch).logits[:, :-1]
    torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_a_causal_lm_compute_loss_func_on_gpt2_is_exact_against_the_trainer_and_names_its_count_factor(tmp_path):
    """GPT-2 from a config has no loss_type, so the Trainer counts its labels unshifted while a shifted loss sums one
    fewer per sequence: with or without autotune each step is (tokens - sequences) / tokens of the token mean's (0.90x
    here). The note says exact against the Trainer's big batch and gives that factor; both are checked here, the
    factor from the data and against the gradient of the true token mean, and the fix the note names is checked too."""
    head = HEADS["gpt2-causal-lm"]
    data = Samples(head, SAMPLES)
    got = assert_exact(tmp_path, head.make, data, loss_func=shifted_sum_over_count)  # the Trainer alone at 24 x 1, both steps
    note = exactness(got)
    counted, shifted = labels_of([data.items[i] for i in range(4)])  # the checked batch: the first four samples
    factor = float(re.search(r"with or without autotune: ([0-9.]+) on a checked batch", note).group(1))
    assert factor == pytest.approx(shifted / counted, abs=1e-3) and f"({shifted} of {counted} labels)" in note
    assert "model.loss_type = 'ForCausalLM'" in note
    # each prepared step against the true token mean's big batch (GPT-2's own loss), scaled by that step's own factor
    grads, _, _ = run(tmp_path, head.make(), data, prepare=True, loss_func=shifted_sum_over_count)
    for step, (start, stop) in zip(grads, ((0, TARGET), (TARGET, SAMPLES))):
        samples = [data.items[i] for i in range(start, stop)]
        counted, shifted = labels_of(samples)
        mean = token_mean_gradients(head.make(), samples)
        assert 0.85 < shifted / counted < 0.95
        assert worst_relative(step, {n: g * shifted / counted for n, g in mean.items()}) <= 1e-10
        assert worst_relative(step, mean) > 0.05  # the factor is real, not rounding
    # the fix the note names: the Trainer then counts the shifted labels, and the step is the token mean's
    fixed = HEADS["gpt2-causal-lm-loss-type"]
    grads, _, prepared = run(tmp_path, fixed.make(), data, prepare=True, loss_func=shifted_sum_over_count)
    assert exactness(prepared).startswith("exact: ")
    mean = token_mean_gradients(fixed.make(), [data.items[i] for i in range(TARGET)])
    assert worst_relative(grads[0], mean) <= 1e-10


# ---- label smoothing ----


def smoothed_big_batch(model, samples, *, shift, epsilon=0.1):
    """The label-smoothed loss of one big batch and its gradients, with torch's cross entropy (shifted
    by one position for a causal LM): neither the Trainer nor autotune."""
    model = copy.deepcopy(model).train()
    batch = collate(samples)
    labels = batch.pop("labels")
    logits = model(**batch).logits
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                                             label_smoothing=epsilon)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["bert-token-classification", "gpt2-causal-lm", "bert-sequence-classification-padded"])
def test_label_smoothing_is_exact(tmp_path, name):
    """The Trainer's label smoother (shifted for a causal LM) against torch's smoothed cross entropy of the
    big batch. The Trainer sums it in float32 (so within 1e-6), which the loss check's float64 tolerance
    once took for another rule ("not checked"); for GPT-2 without a loss_type the Trainer alone divides by
    the unshifted count (0.90x), which autotune corrects."""
    head = HEADS[name]
    data = Samples(head, SAMPLES)
    got, losses, prepared = run(tmp_path, head.make(), data, prepare=True, label_smoothing_factor=0.1)
    assert exactness(prepared).startswith("exact")
    for step, (grads, logged) in enumerate(zip(got, losses)):
        loss, want = smoothed_big_batch(head.make(), data.items[step * TARGET:(step + 1) * TARGET], shift=name.startswith("gpt2"))
        assert worst_relative(grads, want) <= 1e-6
        assert logged == pytest.approx(loss, rel=1e-6)


# ---- sums, samples without labels, at an epoch's short last step ----


def _wav2vec2(reduction):
    def make():
        torch.manual_seed(0)
        config = transformers.Wav2Vec2Config(
            vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, conv_dim=(8, 8),
            conv_stride=(4, 4), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
            attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0, layerdrop=0.0,
            mask_time_prob=0.0, ctc_loss_reduction=reduction, pad_token_id=0, do_stable_layer_norm=False)
        return transformers.Wav2Vec2ForCTC(config).double()

    return make


class Listed(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def speech(n):
    g = torch.Generator().manual_seed(0)
    return Listed([{"input_values": torch.randn(400, generator=g, dtype=torch.float64),
                    "labels": torch.randint(1, 12, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)} for _ in range(n)])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_ctc_is_exact_summed_or_averaged_and_at_the_short_last_step(tmp_path, reduction):
    """Wav2Vec2 CTC: a sum over the batch (the Trainer alone is exact; autotune once divided it by 3) and a
    mean over samples (once 9.5e-2 off at 8 + 8 + 4)."""
    prepared = assert_exact(tmp_path, _wav2vec2(reduction), speech(SAMPLES), bound=1e-6)  # the model takes CTC in float32
    assert ("a sum over the batch" in exactness(prepared)) is (reduction == "sum")


def qa(n, *, padded):
    """Question answering samples: start and end positions, no labels tensor; ``padded``: every sequence
    padded to 16 by the tokenizer (``padding="max_length"``, as question answering is usually run), else
    padded by the collator to the longest in the batch."""
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        length = int(torch.randint(4, 16, (1,), generator=g))
        start = int(torch.randint(0, length, (1,), generator=g))
        ids, mask = torch.randint(3, VOCAB, (length,), generator=g), torch.ones(length, dtype=torch.long)
        if padded:
            ids, mask = torch.nn.functional.pad(ids, (0, 16 - length), value=PAD), torch.nn.functional.pad(mask, (0, 16 - length))
        items.append({"input_ids": ids, "attention_mask": mask, "start_positions": torch.tensor(start),
                      "end_positions": torch.tensor(min(length - 1, start + 2))})
    return Listed(items)


def _qa_model():
    from hf_heads import _bert_config

    torch.manual_seed(0)
    return transformers.BertForQuestionAnswering(_bert_config(num_labels=2)).double()


def test_question_answering_without_labels_is_exact_at_the_short_last_step(tmp_path):
    """No labels tensor (start and end positions): the loss is found to be a mean over samples by itself,
    and weighted by samples (the last step was 0.39 off with the accumulation steps' equal weights)."""
    prepared = assert_exact(tmp_path, _qa_model, qa(SAMPLES, padded=True), bound=1e-9)
    assert "mean over samples" in exactness(prepared)


def test_question_answering_padded_per_batch_is_said_not_exact(tmp_path):
    """BERT's span logits run over every position, padding included, so a sample's loss depends on how far
    its batch is padded: micro-batches padded to their own longest cannot give the big batch's loss. The
    loss check collates its halves as micro-batches are collated, sees it, and says so with the factor."""
    data = qa(SAMPLES, padded=False)
    _, _, prepared = run(tmp_path, _qa_model(), data, prepare=True)
    note = exactness(prepared)
    assert note.startswith("not exact"), note
    want = halves_factor(_qa_model(), [data[i] for i in range(4)])
    assert measured_factor(note) == pytest.approx(want, abs=1e-3) and abs(want - 1) > 1e-3


# ---- custom causal LMs ----


class ShiftingLM(torch.nn.Module):
    """A causal LM of its own (not a transformers model) that shifts its labels itself and ignores
    the count it is told; ``ignore`` is the label value its loss skips."""

    def __init__(self, ignore=-100):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head, self.ignore = torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB), ignore

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=self.ignore)
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_a_custom_causal_lm_that_shifts_its_labels_is_exact(tmp_path):
    """Once 0.30 off under "not checked": the check now also weighs the halves by shifted items."""
    prepared = assert_exact(tmp_path, lambda: ShiftingLM().double(), Samples(HEADS["gpt2-causal-lm"], SAMPLES))
    assert "after a shift by one position" in exactness(prepared)


def zero_padded(samples):
    batch = collate(samples)
    batch["labels"] = batch["labels"].masked_fill(batch["labels"] == -100, PAD)
    return batch


def test_labels_padded_with_zero_are_not_exact_and_the_factor_is_measured(tmp_path):
    """Labels padded with 0, which the model's loss skips but the Trainer counts: no weighting the Trainer's
    count allows is exact; the note says so with the factor, recomputed here from the model's own loss."""
    data = Samples(HEADS["gpt2-causal-lm"], SAMPLES)
    _, _, prepared = run(tmp_path, ShiftingLM(ignore=PAD).double(), data, prepare=True, collator=zero_padded)
    note = exactness(prepared)
    assert note.startswith("not exact"), note
    assert measured_factor(note) == pytest.approx(halves_factor(ShiftingLM(ignore=PAD).double(), data.items[:4], zero_padded), abs=1e-3)


# ---- a contrastive loss ----


def clip_samples(n):
    g = torch.Generator().manual_seed(0)
    items = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        items.append({"input_ids": torch.randint(3, VOCAB, (length,), generator=g), "attention_mask": torch.ones(length, dtype=torch.long),
                      "pixel_values": torch.randn(3, 16, 16, generator=g, dtype=torch.float64), "return_loss": True})
    return Listed(items)


def clip_collate(samples):
    batch = collate([{k: v for k, v in s.items() if k != "return_loss"} for s in samples])
    batch["return_loss"] = True
    return batch


def _clip():
    torch.manual_seed(0)
    text = transformers.CLIPTextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       max_position_embeddings=32, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                                           patch_size=8)
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=8)).double()


def test_a_contrastive_loss_is_said_not_exact_with_its_factor(tmp_path):
    """CLIP couples the samples of a batch: no accumulation is the big batch; the note says so, with the
    halves' factor recomputed here, instead of "no labels ... not checked further"."""
    data = clip_samples(SAMPLES)
    _, _, prepared = run(tmp_path, _clip(), data, prepare=True, collator=clip_collate)
    note = exactness(prepared)
    assert note.startswith("not exact") and "couples the samples" in note, note
    want = halves_factor(_clip(), [data[i] for i in range(4)], clip_collate)
    assert measured_factor(note) == pytest.approx(want, rel=1e-3) and abs(want - 1) > 0.01


# ---- TRL's preference trainers ----


def preference_rows(n, *, implicit):
    words = [f"w{i}" for i in range(60)]
    g = torch.Generator().manual_seed(0)

    def text(lo, hi):
        return " ".join(words[int(i)] for i in torch.randint(0, 60, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g))

    rows = [{"prompt": text(2, 6), "chosen": text(1, 5), "rejected": text(1, 5)} for _ in range(n)]
    if implicit:
        rows = [{"chosen": r["prompt"] + " " + r["chosen"], "rejected": r["prompt"] + " " + r["rejected"]} for r in rows]
    return words, rows


@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_trl_preference_trainers_plan_in_pairs_and_step_the_big_batch(tmp_path, kind):
    """The preference collator stacks each pair's chosen and rejected rows (all chosen, then all
    rejected); planning once cut a one-row trial out of it and TRL's chunk(2) failed."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    words, rows = preference_rows(SAMPLES, implicit=kind == "reward")
    tokenizer = word_tokenizer(words)

    def make():
        from hf_heads import _gpt2_config

        torch.manual_seed(0)
        if kind == "dpo":
            model = transformers.GPT2LMHeadModel(_gpt2_config())
        else:
            model = transformers.GPT2ForSequenceClassification(_gpt2_config(num_labels=1))
        model.resize_token_embeddings(len(tokenizer))
        model.config.pad_token_id = tokenizer.pad_token_id
        return model.double()

    class Trainer(trl.DPOTrainer if kind == "dpo" else trl.RewardTrainer):
        def __init__(self, model, **kw):
            extra = {"ref_model": copy.deepcopy(model)} if kind == "dpo" else {}
            super().__init__(model=model, processing_class=tokenizer, **extra, **kw)

    config = trl.DPOConfig if kind == "dpo" else trl.RewardConfig
    # DPO takes its log-probabilities in float32; the reward model's pairs are padded per micro-batch
    prepared = assert_exact(tmp_path, make, datasets.Dataset.from_list(rows), bound=1e-6 if kind == "dpo" else 1e-9, collator=None,
                            trainer_cls=Trainer, config_cls=config, dataset_num_proc=None)
    assert any("2 rows of each sample" in n for n in prepared.settings.notes)
    assert f"{Trainer.__name__} (for " in exactness(prepared)  # the trainer's own loss, not the model's


def test_an_optimizer_given_to_the_trainer_steps_at_the_scaled_learning_rate(tmp_path):
    """With optimizers=(yours, None) the Trainer never reads args.learning_rate: the rule scales your
    optimizer's groups (prepared.settings once said 0.002 while it stepped at 0.001), and restore() puts
    them back."""
    from autotune.integrations import hf

    head = HEADS["bert-sequence-classification-padded"]
    model = head.make()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=12, max_steps=1, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_strategy="steps", logging_steps=1, disable_tqdm=True,
                                          lr_scheduler_type="constant")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Samples(head, 48), data_collator=collate, optimizers=(optimizer, None))
    prepared = hf.prepare(trainer, target_batch=24, lr_rule="linear", memory_limit="1GiB", progress=False)
    assert prepared.settings.learning_rate == pytest.approx(0.002)
    trainer.train()
    assert trainer.state.log_history[0]["learning_rate"] == pytest.approx(0.002)
    prepared.restore()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.001) and optimizer.param_groups[0].get("initial_lr", 0.001) == pytest.approx(0.001)


def small_lm(tokenizer):
    from hf_heads import _gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.double()


def test_trl_kto_is_said_not_exact_once_the_policy_moves(tmp_path):
    """KTO takes every sample's loss against a KL estimate over its micro-batch: at the check (policy =
    reference) that estimate is 0 and the halves agree, but k micro-batches use k estimates later; the
    note says so instead of "exact"."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from autotune.integrations import hf

    words, rows = preference_rows(48, implicit=False)
    tokenizer = word_tokenizer(words)
    unpaired = [{"prompt": r["prompt"], "completion": r["chosen"] if i % 2 else r["rejected"], "label": i % 2 == 1} for i, r in enumerate(rows)]
    model = small_lm(tokenizer)
    args = trl.KTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=TARGET, max_steps=1, use_cpu=True, report_to=[],
                         save_strategy="no", disable_tqdm=True, dataset_num_proc=None)
    trainer = trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=datasets.Dataset.from_list(unpaired),
                             processing_class=tokenizer)
    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit="1GiB", progress=False)
    assert exactness(prepared).startswith("not exact once the policy leaves the reference model"), exactness(prepared)


def test_trl_grpo_is_refused_clearly_and_nothing_changes(tmp_path):
    """GRPO's collator hands the prompts over as they are: its batches are generated in training, which no
    plan of collated batches describes (once: "its batch 0 is not a batch")."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from autotune.integrations import hf

    words, rows = preference_rows(16, implicit=False)
    tokenizer = word_tokenizer(words)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=4, max_steps=1,
                          use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=small_lm(tokenizer), args=args, reward_funcs=lambda completions, **kw: [1.0 for _ in completions],
                              train_dataset=datasets.Dataset.from_list([{"prompt": r["prompt"]} for r in rows]), processing_class=tokenizer)
    own = trainer.args
    with pytest.raises(ValueError, match="GRPOTrainer: its data collator returns no tensors .* generate completions"):
        hf.prepare(trainer, target_batch=16, memory_limit="1GiB", progress=False)
    assert trainer.args is own and "_autotune_prepared" not in trainer.__dict__
