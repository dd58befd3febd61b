"""A model's own loss is weighted by what it averages over, without being told (autotune.items).

Every reference here is one big batch computed by hand in float64 from the model's logits: the sum of
the per-token (or per-sample) losses over the whole window, divided by their number, backpropagated
once. ``fit`` trains one step with SGD at a learning rate of 1, so the step is the gradient.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

import autotune

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

VOCAB, CLASSES = 40, 3


def _causal_loss_in_float64(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, **kwargs):
    """Transformers' ForCausalLMLoss without its ``logits.float()``: the same shift, ignore index and mean,
    in the model's float64 (the stock one computes a float64 model's loss in float32)."""
    shift = F.pad(labels, (0, 1), value=ignore_index)[..., 1:].reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift, ignore_index=ignore_index,
                           reduction="mean" if num_items_in_batch is None else "sum")
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _llama(float64_loss=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=2,
                                         intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=64)).double()
    if float64_loss:
        model.loss_function = _causal_loss_in_float64
    return model


def _bert(head):
    from transformers import BertConfig, BertForSequenceClassification, BertForTokenClassification

    torch.manual_seed(0)
    config = BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
                        max_position_embeddings=64, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return (BertForSequenceClassification if head == "sequence" else BertForTokenClassification)(config).double()


def _batches(kind, *, n_batches=4, size=3, seed=1):
    """Right-padded batches of very different lengths, labels -100 on the padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        lengths = torch.randint(2, 14, (size,), generator=g)
        width = int(lengths.max())
        ids = torch.randint(1, VOCAB, (size, width), generator=g)
        mask = (torch.arange(width)[None] < lengths[:, None]).long()
        ids = ids * mask
        if kind == "causal":
            labels = ids.masked_fill(mask == 0, -100)
        elif kind == "token":
            labels = torch.randint(0, CLASSES, (size, width), generator=g).masked_fill(mask == 0, -100)
        else:
            labels = torch.randint(0, CLASSES, (size,), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _per_item_losses(model, batch, kind):
    """Each loss item's loss, from the logits, by hand (not the model's loss function)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if kind == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    if kind == "sequence":
        return F.cross_entropy(logits, labels, reduction="none")
    keep = labels != -100
    return F.cross_entropy(logits[keep], labels[keep], reduction="none")


def _gradient(model, batches, kind, *, weights="items"):
    """The big batch's gradient (``weights="items"``: the mean over all items of all batches), or each
    batch's mean weighted by its samples (``"samples"``: what count=None used to do)."""
    model.zero_grad(set_to_none=True)
    per_batch = [_per_item_losses(model, b, kind) for b in batches]
    if weights == "items":
        loss = torch.cat(per_batch).sum() / sum(len(p) for p in per_batch)
    else:
        n = sum(len(b["labels"]) for b in batches)
        loss = sum(p.mean() * len(b["labels"]) / n for p, b in zip(per_batch, batches))
    loss.backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return grad


def _fit_step(model, batches, **kwargs):
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    result = autotune.fit(model, batches, target_batch=sum(len(b["labels"]) for b in batches), optimizer=opt, lr_rule="none",
                          max_steps=1, noise_scale=False, progress=False, bn=None, **kwargs)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return before - after, result


def _relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("kind", "make", "words"), [
    ("causal", _llama, "label tokens shifted by one position"),
    ("token", lambda: _bert("token"), "label tokens (labels != -100)"),
    ("sequence", lambda: _bert("sequence"), "mean over samples"),
], ids=["causal-lm", "token-classifier", "sequence-classifier"])
def test_fit_weights_the_models_own_loss_by_its_items(float64, kind, make, words):
    model = make()
    batches = _batches(kind)
    reference = _gradient(model, batches, kind)
    if kind != "sequence":  # the test can fail: weighting by samples is measurably not the big batch
        assert _relative(_gradient(model, batches, kind, weights="samples"), reference) > 1e-3
    step, result = _fit_step(model, batches)
    assert result.plan.accumulation_steps > 1 or len(batches) > 1  # several micro-batches made the step
    assert _relative(step, reference) < 1e-12
    assert any(words in note for note in result.plan.notes), result.plan.notes
    assert result.plan.items == {"causal": "shifted labels", "token": "labels", "sequence": "samples"}[kind]


def test_values_a_collator_left_beside_the_tensors_are_not_passed_to_a_model_that_does_not_name_them(float64):
    """Document ids and a source string beside the tensors (a collator that keeps a dataset's text columns): the
    model's own loss is taken without them, as the Trainer drops the columns its model does not take, and the step is
    the big batch's. They used to reach the model's ``**kwargs`` and its loss function ("fixed_cross_entropy() got
    multiple values for argument 'source'")."""
    model = _llama(float64_loss=False)  # the stock loss, whose cross-entropy names its logits "source"
    batches = _batches("causal")
    reference = _gradient(model, batches, "causal")
    kept = [{**b, "id": [f"doc{i}-{j}" for j in range(len(b["labels"]))], "source": "web"} for i, b in enumerate(batches)]
    step, result = _fit_step(model, kept)
    assert _relative(step, reference) < 1e-6 and result.plan.items == "shifted labels"  # float32 rounding, as the stock loss's


def test_the_stock_causal_lm_loss_is_weighted_by_its_tokens_to_float32_rounding(float64):
    """Transformers computes the loss of a float64 causal LM in float32 (``logits.float()``): the step is
    the big batch's to that rounding, where weighting by samples is a hundred thousand times further off."""
    model = _llama(float64_loss=False)
    batches = _batches("causal")
    reference = _gradient(model, batches, "causal")
    by_samples = _relative(_gradient(model, batches, "causal", weights="samples"), reference)
    step, result = _fit_step(model, batches)
    assert _relative(step, reference) < 1e-6 < 1e-3 < by_samples
    assert result.plan.items == "shifted labels"


def test_the_causal_lm_note_names_the_count_and_the_measurement(float64):
    model = _llama()
    batches = _batches("causal")
    plan = autotune.plan(model, batches, target_batch=12, progress=False)
    note = next(n for n in plan.notes if "shifted by one position" in n)
    first = int(batches[0]["labels"][:, 1:].ne(-100).sum())
    assert f"{first:,} in the first batch" in note and "measured" in note and "ForCausalLM" in note
    assert plan.items == "shifted labels"
    assert autotune.Plan.from_dict(plan.to_dict()).items == "shifted labels"


def test_a_plan_made_elsewhere_is_told_the_items_too(float64):
    model = _llama()
    batches = _batches("causal")
    reference = _gradient(model, batches, "causal")
    plan = autotune.plan(model, batches, target_batch=12, progress=False, lr_rule="none")
    samples_plan = autotune.Plan.from_dict({**plan.to_dict(), "items": "samples", "notes": []})
    step, result = _fit_step(model, batches, plan=samples_plan)
    assert _relative(step, reference) < 1e-12
    assert result.plan.items == "shifted labels"
    assert any("shifted by one position" in n for n in result.plan.notes)


def test_accumulate_weights_by_the_plans_items(float64):
    model = _llama()
    batches = _batches("causal")
    reference = _gradient(model, batches, "causal")
    plan = autotune.plan(model, batches, target_batch=12, progress=False)
    windows = list(autotune.accumulate(batches, plan))
    assert len(windows) == 1
    model.zero_grad(set_to_none=True)
    for micro in windows[0]:
        (model(**micro.batch).loss * micro.weight).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _relative(got, reference) < 1e-12


def test_a_token_mean_loss_fn_without_count_gets_the_measured_note(float64):
    model = _llama()
    batches = _batches("causal")

    def token_mean(m, b):  # the user's own loss: a mean over tokens, not over samples
        return _per_item_losses(m, b, "causal").mean()

    plan = autotune.plan(model, batches, target_batch=12, loss_fn=token_mean, progress=False)
    assert plan.items == "samples"  # the user's loss is not reweighted behind their back
    note = next(n for n in plan.notes if n.startswith("loss_fn is the mean over"))
    assert "count=autotune.shifted_label_tokens" in note and "% off" in note
    # the figure it names is the measured one: the two samples' losses weighted by samples over their joint loss
    ratio = float(note.split("they give ")[1].split(" times")[0])
    assert abs(ratio - 1) > 1e-4
    # and the count it names makes fit exact
    reference = _gradient(model, batches, "causal")
    step, _ = _fit_step(model, batches, loss_fn=token_mean, count=autotune.shifted_label_tokens)
    assert _relative(step, reference) < 1e-12


def test_a_sample_mean_loss_fn_gets_no_note(float64):
    model = _bert("sequence")
    batches = _batches("sequence")
    plan = autotune.plan(model, batches, target_batch=12, progress=False,
                         loss_fn=lambda m, b: F.cross_entropy(m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                                              b["labels"]))
    assert not any("loss_fn" in n for n in plan.notes)
    assert plan.items == "samples"


def test_the_counts_refuse_a_batch_without_labels():
    with pytest.raises(TypeError, match="no integer labels.*count=lambda"):
        autotune.shifted_label_tokens({"input_ids": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(TypeError, match="no integer labels"):
        autotune.label_tokens((torch.zeros(2, 3), torch.zeros(2, 3)))
    labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert autotune.label_tokens({"labels": labels}) == 3
    assert autotune.shifted_label_tokens({"labels": labels}) == 1


def _packed_batches(use_cache):
    """One row of two sequences (position_ids restart at 0), as padding-free collators make them."""
    g = torch.Generator().manual_seed(3)
    first, second = torch.randint(1, VOCAB, (5,), generator=g), torch.randint(1, VOCAB, (7,), generator=g)
    ids = torch.cat([first, second])[None]
    labels = ids.clone()
    labels[0, 5] = -100  # the second sequence's first token predicts nothing from the first's
    positions = torch.cat([torch.arange(5), torch.arange(7)])[None]
    return [{"input_ids": ids, "position_ids": positions, "labels": labels} for _ in range(2)]


def test_packed_rows_the_model_attends_across_are_refused_by_fit(float64):
    model = _llama()
    model.config.use_cache = True
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"position_ids restart inside row 0, at position 5.*attends across.*use_cache = False"):
        autotune.fit(model, _packed_batches(True), target_batch=2, progress=False)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    plan = autotune.plan(model, _packed_batches(True), target_batch=2, progress=False)
    assert any("attends across" in n for n in plan.notes)


def test_packed_rows_kept_apart_train(float64):
    model = _llama()
    model.config.use_cache = False  # the fix the refusal names: the restarts are read as boundaries
    result = autotune.fit(model, _packed_batches(False), target_batch=2, progress=False, max_steps=1)
    assert not any("attends across" in n for n in result.plan.notes)


def _llava():
    """A small LLaVA (a vision-language model: its loss_type ForConditionalGeneration, its loss a causal LM's)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    text = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2, num_key_value_heads=2, intermediate_size=32,
                       vocab_size=VOCAB, max_position_embeddings=64)
    tower = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14)
    return LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=tower, image_token_index=VOCAB - 1)).double()


def _with_images(batches):
    """Each sample with an image after its first text token (4 placeholder tokens: (28 / 14)^2), its labels -100 there."""
    g = torch.Generator().manual_seed(2)
    out = []
    for b in batches:
        text = b["input_ids"].masked_fill(b["input_ids"] == VOCAB - 1, 1)  # the placeholder marks images alone
        ids = torch.cat([text[:, :1], torch.full((len(text), 4), VOCAB - 1), text[:, 1:]], dim=1)
        mask = torch.cat([torch.ones(len(ids), 5, dtype=torch.long), b["attention_mask"][:, 1:]], dim=1)
        labels = torch.cat([b["labels"][:, :1], torch.full((len(ids), 4), -100), b["labels"][:, 1:]], dim=1)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels,
                    "pixel_values": torch.randn(len(ids), 3, 28, 28, generator=g, dtype=torch.float64)})
    return out


def test_a_vision_language_model_and_an_encoder_decoder_are_told_apart_where_nothing_is_measured(float64):
    """Both have the loss_type ForConditionalGeneration: a vision-language model's own loss is its causal LM's, over shifted
    labels; T5's the mean over its decoder's labels, unshifted. Where nothing runs (ranks that run every forward together,
    an estimate) the kind decides, and it decides what the measurement finds; it used to fall to samples for both."""
    from autotune.items import loss_items

    t5 = _t5()
    cases = [(_llava(), _with_images(_batches("causal")), "shifted labels"), (t5, _seq2seq_batches(), "labels")]
    for model, batches, rule in cases:
        assert model.loss_type == "ForConditionalGeneration"
        measured = loss_items(model, None, batches, device=torch.device("cpu"))
        assert measured.rule == rule and "measured" in measured.note, measured
        told = loss_items(model, None, batches, device=torch.device("cpu"), measure=False)
        assert told.rule == rule and "by the model's kind, ForConditionalGeneration: not measured" in told.note, told


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
                                               num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)).double()


def _seq2seq_batches():
    """Target lengths that differ from sample to sample (labels -100 past each)."""
    out = []
    for b in _batches("causal", seed=3):
        lengths = b["attention_mask"].sum(1)
        labels = b["input_ids"].masked_fill(torch.arange(b["input_ids"].shape[1])[None] >= (lengths[:, None] + 1) // 2, -100)
        out.append({**b, "labels": labels})
    return out
