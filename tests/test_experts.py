"""A mixture-of-experts load-balancing loss accumulated: ``router_loss="exact"`` against one big batch
computed by hand, and the default's note against the deviation recomputed by hand (a tiny Mixtral and a
tiny Qwen2-MoE, float64, padded variable-length batches, labels -100 on padding).

The reference is the window as one batch: the model's logits and router logits on all its sequences at
once, a token-mean cross-entropy over the shifted labels and the Switch Transformer's load-balancing
loss (``E * sum_e f_e * P_e`` over every layer's unpadded tokens), both written out here in float64 and
the latter checked against the model's own ``aux_loss``. Transformers' causal-LM loss casts the logits
to float32 (so a float64 model's own cross-entropy holds float32's precision); the models here get a
float64 token-mean cross-entropy as their ``loss_function`` so that the comparison can hold to 1e-12.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import autotune

pytestmark = pytest.mark.usefixtures("float64")
transformers = pytest.importorskip("transformers")

from bad_inputs import manual_plan  # noqa: E402

VOCAB, EXPERTS, TOP_K, COEF = 64, 4, 2, 0.02
TARGET, MICRO, SAMPLES = 12, 4, 24  # two windows of three micro-batches


def _causal_ce(logits, labels, vocab_size, num_items_in_batch=None, **kwargs):
    """Transformers' causal-LM loss in the logits' dtype (float64 here): the sum over the shifted labels
    divided by ``num_items_in_batch`` when it is given (the Trainer's step count), else their mean."""
    flat = logits[:, :-1].reshape(-1, vocab_size), labels[:, 1:].reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(*flat, ignore_index=-100)
    return F.cross_entropy(*flat, ignore_index=-100, reduction="sum") / num_items_in_batch


def mixtral(coef=COEF, **extra):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, output_router_logits=True, router_aux_loss_coef=coef,
        max_position_embeddings=64, pad_token_id=0, experts_implementation="eager", **extra)
    return _routed(transformers.MixtralForCausalLM(config))


def qwen2_moe(coef=COEF, **extra):
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        output_router_logits=True, router_aux_loss_coef=coef, max_position_embeddings=64, pad_token_id=0,
        experts_implementation="eager", **extra)
    return _routed(transformers.Qwen2MoeForCausalLM(config))


def _routed(model):
    """float64, with routers whose top-k is uneven (Qwen2-MoE starts its routers at zero: every expert tied)."""
    model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    model.loss_function = _causal_ce
    return model


MODELS = {"mixtral": mixtral, "qwen2_moe": qwen2_moe}


def sequences(n=SAMPLES, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (int(torch.randint(3, 14, (1,), generator=g)),), generator=g) for _ in range(n)]


def padded(seqs):
    """Right-padded to the longest, the padding masked and labelled -100."""
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def tokens(batch):
    return int(batch["labels"][:, 1:].ne(-100).sum())


def balance_by_hand(router_logits, mask):
    """Switch Transformer's load-balancing loss over every layer's unpadded tokens, and the fractions and
    probabilities it multiplies: written out, independently of autotune."""
    keep = mask.reshape(-1).bool()
    probs = torch.cat([layer.softmax(-1)[keep] for layer in router_logits])
    chosen = F.one_hot(probs.topk(TOP_K, dim=-1).indices, EXPERTS).sum(1).to(probs.dtype)
    return EXPERTS * (chosen.mean(0) * probs.mean(0)).sum()


def big_batch(model, seqs):
    """One big batch of ``seqs``, by hand: its loss (token-mean cross-entropy + coef x load balancing) and gradients."""
    model = copy.deepcopy(model)
    batch = padded(seqs)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    balance = balance_by_hand(out.router_logits, batch["attention_mask"])
    assert float(balance.detach()) == pytest.approx(float(out.aux_loss.detach()), rel=1e-6)  # the formula is transformers' (in float32 there)
    loss = ce + model.config.router_aux_loss_coef * balance
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def relative(got, want):
    return max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want)


def routers(grads):
    return {n: g for n, g in grads.items() if n.endswith("mlp.gate.weight")}


def fitted(model, router_loss=None, lr=0.0, checkpointing=False, **extra):
    """``fit`` at a learning rate of 0 (each step's reference is the start model's on its window), two
    windows of 4 + 4 + 4: each step's gradient as the optimizer sees it, and the result."""
    seqs = sequences()
    loader = [padded(seqs[i : i + MICRO]) for i in range(0, SAMPLES, MICRO)]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    optimizer.register_step_pre_hook(lambda *_: grads.append({n: p.grad.clone() for n, p in model.named_parameters()}))
    plan = manual_plan(micro_batch=MICRO, accumulation_steps=3, effective_batch=TARGET, micro_batches=(MICRO,) * 3, lr=lr, base_lr=lr,
                       checkpointing=checkpointing)
    kwargs = {} if router_loss is None else {"router_loss": router_loss}
    result = autotune.fit(model, loader, optimizer=optimizer, plan=plan, count=tokens, progress=False, noise_scale=False, **kwargs, **extra)
    return seqs, grads, result


@pytest.mark.parametrize("name", MODELS)
def test_exact_mode_is_the_big_batch_router_included(name):
    model = MODELS[name]()
    start = copy.deepcopy(model)
    seqs, grads, result = fitted(model, "exact")
    assert len(grads) == 2
    for step, got in enumerate(grads):
        window = seqs[step * TARGET : (step + 1) * TARGET]
        loss, want = big_batch(start, window)
        assert relative(got, want) <= 1e-12
        assert relative(routers(got), routers(want)) <= 1e-12
        assert result.history[step].loss == pytest.approx(loss, rel=1e-12)
    (note,) = [n for n in result.plan.notes if "router_loss='exact'" in n]
    assert "one extra forward without gradients per window" in note


@pytest.mark.parametrize("name", MODELS)
def test_exact_mode_with_the_first_block_checkpointed_is_the_big_batch(name):
    """A count of blocks checkpointed (what ``checkpointing="auto"`` chooses): the checkpointed block's router runs
    again in its backward, and its logits, read in the forward, are the ones the big batch's loss takes."""
    from autotune.memory.checkpointing import blocks

    model = MODELS[name]()
    start = copy.deepcopy(model)
    runs = [0, 0]
    for i, block in enumerate(blocks(model)):  # a router runs once more in a recomputation
        block.mlp.gate.register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + torch.is_grad_enabled()))
    seqs, grads, result = fitted(model, "exact", checkpointing=1)
    assert result.plan.checkpointing == 1 and runs[0] > runs[1] > 0
    for step, got in enumerate(grads):
        loss, want = big_batch(start, seqs[step * TARGET : (step + 1) * TARGET])
        assert relative(got, want) <= 1e-12
        assert result.history[step].loss == pytest.approx(loss, rel=1e-12)


@pytest.mark.parametrize("name", MODELS)
def test_the_default_says_how_far_the_first_window_is_and_is_that_far(name):
    model = MODELS[name]()
    start = copy.deepcopy(model)
    seqs, grads, result = fitted(model)
    (note,) = [n for n in result.plan.notes if "load-balancing loss per micro-batch" in n]
    assert "router_loss='exact' makes it exact" in note
    # The figures, recomputed by hand: each micro-batch's own loss weighted by its tokens, against the window's;
    # and their gradients with respect to the router logits (autograd), against the window's.
    window = seqs[:TARGET]
    micro = [padded(window[i : i + MICRO]) for i in range(0, TARGET, MICRO)]
    weights = [tokens(b) / sum(map(tokens, micro)) for b in micro]
    with torch.no_grad():  # the loss's own inputs: the router logits, as leaves
        outs = [start(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True) for b in micro]
    logits = [[layer.requires_grad_() for layer in out.router_logits] for out in outs]
    per_micro = sum(w * balance_by_hand(layers, b["attention_mask"]) for w, layers, b in zip(weights, logits, micro))
    whole = balance_by_hand([torch.cat([layers[i] for layers in logits]) for i in range(2)],
                            torch.cat([b["attention_mask"].reshape(-1) for b in micro]))
    logits = [layer for layers in logits for layer in layers]
    off = float(per_micro.detach() / whole.detach() - 1)
    assert f"as the micro-batches add it is {float(per_micro.detach()):.6g} against the window's {float(whole.detach()):.6g} ({off:+.3%}" in note
    mine = torch.autograd.grad(per_micro, logits, retain_graph=True)
    exact = torch.autograd.grad(whole, logits)
    gradient_off = (sum(float((a - b).pow(2).sum()) for a, b in zip(mine, exact)) / sum(float(b.pow(2).sum()) for b in exact)) ** 0.5
    assert f"gradient with respect to the router logits is {gradient_off:.1%} off the window's" in note
    assert gradient_off > 0.1
    # and the default trains what it says: the routers' gradient is not the big batch's, the rest nearly is
    _, want = big_batch(start, window)
    assert relative(routers(grads[0]), routers(want)) > 0.01


def test_exact_mode_routes_its_forward_as_the_training_forwards_under_dropout_and_jitter():
    """With attention dropout and router jitter the window has no big batch to compare with (its random
    draws differ); the reference is then the training forwards themselves: the same micro-batches from
    the same random state, each with gradients, the window's fractions taken from those very forwards.
    A forward without gradients that drew other numbers (not put back) or ran in eval mode would route
    otherwise and fail this."""
    model = mixtral(attention_dropout=0.3, router_jitter_noise=0.2)
    start = copy.deepcopy(model)
    torch.manual_seed(123)
    seqs, grads, _ = fitted(model, "exact")
    torch.manual_seed(123)
    reference = copy.deepcopy(start).train()
    micro = [padded(seqs[i : i + MICRO]) for i in range(0, TARGET, MICRO)]
    outs = [reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True) for b in micro]
    keep = torch.cat([b["attention_mask"].reshape(-1) for b in micro]).bool()
    probs = torch.cat([torch.cat([o.router_logits[layer] for o in outs]).softmax(-1)[keep] for layer in range(2)])
    fractions = F.one_hot(probs.topk(TOP_K, dim=-1).indices, EXPERTS).sum(1).to(probs.dtype).mean(0)
    counted = sum(map(tokens, micro))
    ce = sum(F.cross_entropy(o.logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
             for o, b in zip(outs, micro)) / counted
    (ce + COEF * EXPERTS * (fractions * probs.mean(0)).sum()).backward()
    want = {n: p.grad for n, p in reference.named_parameters()}
    assert relative(grads[0], want) <= 1e-12
    # and the default's gradient with the same draws is not that: the forward changed nothing else
    no_jitter = mixtral(attention_dropout=0.3, router_jitter_noise=0.2)
    torch.manual_seed(123)
    _, plain, _ = fitted(no_jitter)
    assert relative(routers(plain[0]), routers(want)) > 0.01


class OtherBalance(transformers.MixtralForCausalLM):
    """A load-balancing loss of another form: twice Switch's."""

    def forward(self, **kwargs):
        out = super().forward(**kwargs)
        out.aux_loss = out.aux_loss * 2
        return out


def _other_balance():
    torch.manual_seed(0)
    config = mixtral().config
    return _routed(OtherBalance(config))


def test_a_balancing_loss_of_another_form_is_said_unmeasured_by_default_and_refused_exact():
    seqs, _, result = fitted(_other_balance())
    (note,) = [n for n in result.plan.notes if "load-balancing" in n]
    assert "is not the Switch Transformer form" in note and "was not measured" in note
    model = _other_balance()
    with pytest.raises(autotune.AutotuneError, match=r"Invalid router_loss 'exact' for OtherBalance, found at its first window before it trained \(nothing has changed\): the model's load-balancing loss \(output.aux_loss\) is not the Switch"):
        _unchanged(model, lambda: fitted(model, "exact", lr=0.1))


def test_at_no_coefficient_both_modes_are_the_big_batch():
    """A load-balancing loss at coefficient 0 is no loss: nothing is said, nothing replaced."""
    model = mixtral(coef=0.0)
    start = copy.deepcopy(model)
    seqs, grads, result = fitted(model)
    _, want = big_batch(start, seqs[:TARGET])
    assert relative(grads[0], want) <= 1e-12
    assert not [n for n in result.plan.notes if "load-balancing" in n]


def _unchanged(model, call):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    call()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("make", "kwargs", "error", "match"),
    [
        (mixtral, {"router_loss": "global"}, ValueError, r"Invalid router_loss 'global': use 'per_micro_batch'"),
        (mixtral, {"router_loss": "exact", "loss_fn": lambda m, b: m(**b).loss}, ValueError,
         r"Invalid router_loss 'exact' with a loss_fn: .*leave loss_fn out"),
        (lambda: mixtral(coef=0.0), {"router_loss": "exact"}, ValueError,
         r"Invalid router_loss 'exact' for MixtralForCausalLM: it adds no load-balancing loss"),
    ],
    ids=["unknown-mode", "exact-with-loss-fn", "exact-without-a-balancing-loss"],
)
def test_bad_router_loss_is_refused_before_anything_changes(make, kwargs, error, match):
    model = make()
    loader = [padded(sequences(8)[i : i + 4]) for i in (0, 4)]
    with pytest.raises(error, match=match):
        _unchanged(model, lambda: autotune.fit(model, loader, 8, progress=False, **kwargs))


# --- under the Hugging Face Trainer, through hf.prepare ---------------------------------------------------


class Sequences(torch.utils.data.Dataset):
    def __init__(self, seqs):
        self.seqs = seqs

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        s = self.seqs[i]
        return {"input_ids": s, "attention_mask": torch.ones_like(s), "labels": s.clone()}


def collate(samples):
    return padded([s["input_ids"] for s in samples])


def trained(tmp_path, model, *, prepare, router_loss=None):
    """One epoch at a learning rate of 0 (two steps of 12, sequential): each step's gradient and logged
    loss; prepared to micro-batches of 3 or 4 (the limit is set for 4), or the Trainer alone at 12 x 1."""
    seqs = sequences()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / str(prepare)), per_device_train_batch_size=TARGET, num_train_epochs=1, learning_rate=0.0, optim="sgd",
        lr_scheduler_type="constant", use_cpu=True, report_to=[], save_strategy="no", logging_strategy="steps", logging_steps=1, seed=0,
        max_grad_norm=0.0, disable_tqdm=True)
    grads = []

    class Record(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(seqs), data_collator=collate, callbacks=[Record()])
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)
    prepared = None
    if prepare:
        from autotune.integrations import hf

        kwargs = {} if router_loss is None else {"router_loss": router_loss}
        prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit=_limit_for(trainer, MICRO), headroom=0, progress=False, **kwargs)
        assert prepared.accumulation_steps > 1 and prepared.micro_batch * prepared.accumulation_steps == TARGET, str(prepared)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return seqs, grads, losses, prepared, trainer


def _limit_for(trainer, micro):
    """A memory limit between the planned peaks at ``micro`` and ``micro + 1`` samples (from a first prepare, restored)."""
    from autotune.integrations import hf

    prepared = hf.prepare(trainer, target_batch=TARGET, memory_limit="1GiB", headroom=0, progress=False)
    curve = prepared.settings.plan.memory_curve
    prepared.restore()
    return (curve(micro) + curve(micro + 1)) // 2


def _note(prepared):
    (note,) = [n for n in prepared.settings.notes if "load-balancing loss" in n]
    return note


@pytest.mark.parametrize("name", MODELS)
def test_the_trainer_prepared_exact_is_the_big_batch(tmp_path, name):
    model = MODELS[name]()
    start = copy.deepcopy(model)
    seqs, grads, losses, prepared, trainer = trained(tmp_path, model, prepare=True, router_loss="exact")
    note = _note(prepared)
    assert "router_loss='exact'" in note and "one extra forward without gradients per step" in note
    assert len(grads) == len(losses) == 2
    for step in range(2):
        loss, want = big_batch(start, seqs[step * TARGET : (step + 1) * TARGET])
        assert relative(grads[step], want) <= 1e-12
        assert losses[step] == pytest.approx(loss, rel=1e-12)
    prepared.restore()
    assert model.router_aux_loss_coef == COEF and "compute_loss" not in trainer.__dict__


@pytest.mark.parametrize("name", MODELS)
def test_the_trainer_prepared_by_default_adds_one_loss_a_step_and_says_how_far(tmp_path, name):
    """Each micro-batch's own load-balancing loss weighted by its tokens over the step's (the attention
    mask's): one loss's worth a step, not three, against a reference built by hand from the same
    micro-batches; the note's figures recomputed by hand."""
    model = MODELS[name]()
    start = copy.deepcopy(model)
    seqs, grads, losses, prepared, _ = trained(tmp_path, model, prepare=True)
    note = _note(prepared)
    assert "which the Trainer alone does not divide by the accumulation" in note
    assert "router_loss='exact' makes it exact" in note
    for step in range(2):
        window = seqs[step * TARGET : (step + 1) * TARGET]
        reference = copy.deepcopy(start)
        size = prepared.micro_batch
        micro = [padded(window[i : i + size]) for i in range(0, TARGET, size)]
        routed, counted = sum(int(b["attention_mask"].sum()) for b in micro), sum(map(tokens, micro))
        loss = per_micro = 0.0
        for b in micro:  # each micro-batch's summed cross-entropy over the step's tokens, and its own balancing loss weighted
            o = reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True)
            ce = F.cross_entropy(o.logits[:, :-1].reshape(-1, VOCAB), b["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
            own = int(b["attention_mask"].sum()) / routed * balance_by_hand(o.router_logits, b["attention_mask"])
            (ce / counted + COEF * own).backward()
            loss, per_micro = loss + float(ce.detach()) / counted, per_micro + own.detach()
        want = {n: p.grad for n, p in reference.named_parameters()}
        assert relative(grads[step], want) <= 1e-12
        assert losses[step] == pytest.approx(loss + COEF * float(per_micro), rel=1e-12)
        if step == 0:
            layers = zip(*[reference(input_ids=b["input_ids"], attention_mask=b["attention_mask"], output_router_logits=True).router_logits
                           for b in micro])
            exact = balance_by_hand([torch.cat(layer) for layer in layers], torch.cat([b["attention_mask"].reshape(-1) for b in micro]))
            figures = f"{float(per_micro.detach()):.6g} against the step's {float(exact.detach()):.6g}"
            assert figures in note


def test_the_trainer_prepared_exact_is_the_trainers_own_big_step(tmp_path):
    """The same Trainer alone at 12 x 1 (one micro-batch a step: its own big batch, nothing of autotune),
    within the float32 rounding of the load-balancing loss the model adds itself (transformers sums it
    in float32 whatever the model's dtype)."""
    model = mixtral()
    _, want, want_losses, _, _ = trained(tmp_path, copy.deepcopy(model), prepare=False)
    _, got, got_losses, _, _ = trained(tmp_path, copy.deepcopy(model), prepare=True, router_loss="exact")
    assert got_losses == pytest.approx(want_losses, rel=1e-8)
    for g, w in zip(got, want):
        assert relative(g, w) <= 1e-6


def test_prepare_refuses_a_bad_router_loss_before_anything_changes(tmp_path):
    from autotune.integrations import hf

    model = mixtral()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(sequences(8)), data_collator=collate)
    before = trainer.args
    with pytest.raises(ValueError, match=r"Invalid router_loss 'sum': use 'per_micro_batch'"):
        _unchanged(model, lambda: hf.prepare(trainer, target_batch=8, router_loss="sum", progress=False))
    assert trainer.args is before and "compute_loss" not in trainer.__dict__ and model.router_aux_loss_coef == COEF
    plain = transformers.Trainer(model=mixtral(coef=0.0), args=args, train_dataset=Sequences(sequences(8)), data_collator=collate)
    with pytest.raises(ValueError, match=r"Invalid router_loss 'exact' for MixtralForCausalLM: it adds no load-balancing loss"):
        hf.prepare(plain, target_batch=8, router_loss="exact", progress=False)


def test_exact_mode_under_bf16_autocast_is_the_big_batch_within_bf16():
    """Under autocast the router logits are bf16 (the model's softmax rounds its probabilities): the model's
    own load-balancing loss is still recognised, and the step is the float32 big batch's within bf16 rounding."""
    model = mixtral().float()
    start = copy.deepcopy(model)
    seqs = sequences()
    loader = [padded(seqs[i : i + MICRO]) for i in range(0, SAMPLES, MICRO)]
    plan = manual_plan(micro_batch=MICRO, accumulation_steps=3, effective_batch=TARGET, micro_batches=(MICRO,) * 3, lr=0.0, base_lr=0.0,
                       precision="bf16")
    result = autotune.fit(model, loader, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), plan=plan, count=tokens,
                          router_loss="exact", progress=False, noise_scale=False, max_steps=1)
    assert [n for n in result.plan.notes if n.startswith("router_loss='exact'")]
    loss, _ = big_batch(start, seqs[:TARGET])
    assert result.history[0].loss == pytest.approx(loss, rel=2e-2)
