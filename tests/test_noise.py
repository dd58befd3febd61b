"""The gradient noise scale against a problem with a known answer: linear regression with Gaussian
inputs and noise, where |G|^2 and tr(S) at the current parameters have closed forms.

Per-example loss (x^T w - y)^2 with x ~ N(0, I_d), y = x^T w* + sigma * eps, delta = w - w*:
the per-example gradient is g = 2 x (x^T delta - sigma eps), so

    |G|^2 = 4 |delta|^2,    E|g|^2 = 4 ((d + 2) |delta|^2 + sigma^2 d),
    tr(S) = E|g|^2 - |G|^2 = 4 ((d + 1) |delta|^2 + sigma^2 d),
    B_simple = ((d + 1) |delta|^2 + sigma^2 d) / |delta|^2.

The parameters are held fixed (learning rate 0), so the answer does not move while it is measured.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autotune
from autotune.train.noise import NoiseMeter, NoiseScale, advice

pytestmark = pytest.mark.usefixtures("float64")

D, SIGMA = 8, 0.5


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(D, generator=g)
    delta = torch.randn(D, generator=g)
    delta = delta / delta.norm() * math.sqrt(0.05)
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta).unsqueeze(0))
    truth = ((D + 1) * 0.05 + SIGMA**2 * D) / 0.05
    return model, w_star, truth


def samples(w_star, n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    y = x @ w_star + SIGMA * torch.randn(n, generator=g)
    return x, y


def mse(model, batch):
    x, y = batch
    return ((model(x).squeeze(-1) - y) ** 2).mean()


def manual_plan(target, sizes):
    return autotune.Plan(
        micro_batch=max(sizes), accumulation_steps=len(sizes), effective_batch=target, world_size=1, micro_batches=tuple(sizes),
        lr=0.0, base_lr=0.0, lr_scale=1.0, lr_rule="none", base_batch=target, warmup_steps=None, bn_momentum=None,
        memory_limit=2**40, headroom=0.0, peak_memory=0, device="cpu", precision="fp32",
    )


@pytest.mark.parametrize(
    "target, sizes",
    [(64, [8] * 8), (64, [10, 9, 9, 9, 9, 9, 9]), (128, [32] * 4), (96, [48, 48])],
    ids=["8x8", "uneven-10", "32x4", "48x2"],
)
def test_the_estimate_recovers_the_true_noise_scale(target, sizes):
    model, w_star, truth = problem()
    steps = 400
    x, y = samples(w_star, steps * target, seed=1)
    loader = [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    result = autotune.fit(model, loader, plan=manual_plan(target, sizes), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                          loss_fn=mse, progress=False, noise_scale=1)  # every window (True paces it by its cost)
    noise = result.noise_scale
    assert noise is not None and noise.steps > 100
    assert noise.value == pytest.approx(truth, rel=0.15)
    assert abs(noise.value - truth) < 3 * noise.error < 0.75 * truth  # the stated uncertainty covers the miss
    assert result.history[-1].noise_scale == pytest.approx(noise.value)


def test_token_weights_count_items_not_samples():
    """Each sample holds 1 to 4 items (the rest padding); the loss is the mean over real items and
    count() counts them: the noise scale comes out in items."""
    model, w_star, truth = problem()
    steps, target = 300, 32
    g = torch.Generator().manual_seed(2)
    n = steps * target
    x = torch.randn(n, 4, D, generator=g)
    y = (x @ w_star) + SIGMA * torch.randn(n, 4, generator=g)
    real = torch.arange(4).expand(n, 4) < torch.randint(1, 5, (n, 1), generator=g)
    y = torch.where(real, y, torch.nan)

    def item_loss(model, batch):
        xb, yb = batch
        keep = ~torch.isnan(yb)
        return ((model(xb).squeeze(-1)[keep] - yb[keep]) ** 2).mean()

    loader = [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]
    result = autotune.fit(model, loader, plan=manual_plan(target, [8, 8, 8, 8]), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                          loss_fn=item_loss, count=lambda b: int((~torch.isnan(b[1])).sum()), progress=False, noise_scale=1)
    assert result.noise_scale.value == pytest.approx(truth, rel=0.15)


def test_one_micro_batch_per_window_cannot_measure_it_and_says_none():
    model, w_star, _ = problem()
    x, y = samples(w_star, 640, seed=3)
    loader = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 640, 64)]
    result = autotune.fit(model, loader, plan=manual_plan(64, [64]), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                          loss_fn=mse, progress=False, noise_scale=1)
    assert result.noise_scale is None and result.advice() is None


def test_the_default_meter_paces_itself_by_its_cost():
    model, w_star, _ = problem()
    x, y = samples(w_star, 64 * 200, seed=5)
    loader = [(x[i : i + 16], y[i : i + 16]) for i in range(0, len(x), 16)]
    paced = autotune.fit(model, loader, plan=manual_plan(64, [8] * 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                         loss_fn=mse, progress=False)
    every = autotune.fit(model, loader, plan=manual_plan(64, [8] * 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                         loss_fn=mse, progress=False, noise_scale=3)
    assert 2 <= paced.noise_scale.steps <= 200
    n, beta = 200 // 3, 0.99  # the windows measured, and their effective number under the moving average's weights
    assert every.noise_scale.steps == pytest.approx((1 - beta**n) ** 2 * (1 - beta**2) / ((1 - beta) ** 2 * (1 - beta ** (2 * n))), abs=1.5)
    none = autotune.fit(model, loader, plan=manual_plan(64, [8] * 8), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                        loss_fn=mse, progress=False, noise_scale=False, max_steps=5)
    assert none.noise_scale is None and all(r.noise_scale is None for r in none.history)


def test_the_meter_and_the_advice():
    meter = NoiseMeter()
    assert meter.estimate() is None
    # exact inputs: |G|^2 = 1, tr(S) = 100 -> |G_b|^2 = 1 + 100/b
    for _ in range(5):
        meter.add(1 + 100 / 10, 10, 1 + 100 / 80, 80)
    est = meter.estimate()
    assert est.value == pytest.approx(100) and est.error == pytest.approx(0, abs=1e-9) and est.steps == pytest.approx(5, rel=1e-3)
    assert est.low == pytest.approx(100) and est.high == pytest.approx(100)  # no spread: no range
    assert advice(est, 128) is None  # within 2x
    assert "Consider a smaller target" in advice(est, 4096) and "~41.0x the measured noise scale" in advice(est, 4096)
    below = advice(NoiseScale(600, 10, 50, 1, 600, 580, 620), 100)
    assert "below the measured noise scale" in below and "at least ~3.4x the optimizer steps of a target of 580" in below
    assert "~0.59x its samples" in below  # (1 + 100/580) / 2: the range's lower end, the conservative reading
    assert advice(NoiseScale(600, 400, 50, 1, 600, 150, 1400), 100) is None  # its range reaches 2x the target: no advice
    assert "at least ~700" in advice(NoiseScale(math.inf, math.inf, 50, -1, 600, 700, math.inf), 64)


def test_a_window_trace_below_zero_reads_as_no_noise_never_as_a_negative_range_or_advice_to_shrink():
    """|G|^2 told from its noise and tr(S) below zero (the first micro-batches' gradients smaller than their windows'):
    the noise scale was read as infinite, its range ended below zero (-178), and the advice told a target of 64 to
    shrink, "~0.0x the measured noise scale". Now: no noise told from the gradient (0), a range that stays at or above 0."""
    g = torch.Generator().manual_seed(0)
    beyond, within = NoiseMeter(), NoiseMeter()
    for _ in range(30):
        jitter = 0.01 * float(torch.randn((), generator=g))
        beyond.add(0.9 + jitter, 10, 1.0 + jitter, 40)  # |G_b|^2 below |G_B|^2 beyond its error
        within.add(1.0 + 4 * jitter, 10, 1.0, 40)  # about equal: tr(S) about 0, either side
    for est in (beyond.estimate(), within.estimate()):
        assert est.gradient_sq > 0 and 0 <= est.low <= est.high < math.inf and est.value >= 0, est
        said = advice(est, 64)
        assert said is None or ("~0.0x" not in said and "inf" not in said), said
    est = beyond.estimate()
    assert est.trace < 0 and est.value == 0 and est.high == 0 and str(est).startswith("not measured"), est
    from autotune.train.fit import _noise_note

    assert _noise_note(est, SimpleNamespace(par=SimpleNamespace(fsdp=False)), True) == str(est)  # fit's result says so too
    est = within.estimate()
    assert est.high > 0 and (est.value == 0) == (est.trace <= 0)
    said = advice(est, int(4 * est.high) + 1)  # a target far above the whole range: a smaller one is advised, in numbers
    assert said is not None and "Consider a smaller target" in said and "inf" not in said, said


def test_noise_scale_reads_a_loader_that_repeats_itself_once_and_a_shuffled_one_again():
    """A window measured twice is no second measurement: a list of batches gives its windows once (8 here, of 50
    asked), where they were cycled and counted as 50, narrowing the range; a shuffled loader's next pass is new windows."""
    model, w_star, _ = problem()
    x, y = samples(w_star, 64, seed=1)
    listed = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    once = autotune.noise_scale(model, listed, micro_batch=4, micro_batches=2, windows=50, loss_fn=mse)
    assert once.steps == pytest.approx(_steps(8, 50), rel=1e-9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(2))
    again = autotune.noise_scale(model, loader, micro_batch=4, micro_batches=2, windows=50, loss_fn=mse)
    assert again.steps == pytest.approx(_steps(50, 50), rel=1e-9)


def test_noise_scale_counts_a_causal_lms_own_loss_in_its_label_tokens_as_fit_does():
    """The model's own loss of a Transformers causal LM is a mean over its shifted label tokens: without ``count=`` the
    meter counts those, as ``fit`` weighs them (it counted samples, so each window's two gradients were compared in
    the wrong units), and the report states the target in them too."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64))
    g = torch.Generator().manual_seed(0)
    loader = []
    for _ in range(6):
        ids = torch.randint(0, 100, (8, 24), generator=g)
        mask = (torch.arange(24) < torch.randint(3, 25, (8, 1), generator=g)).long()
        loader.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    found = autotune.noise_scale(model, loader, micro_batch=2, micro_batches=4, windows=6)
    tokens = autotune.noise_scale(model, loader, micro_batch=2, micro_batches=4, windows=6, count=autotune.shifted_label_tokens)
    by_samples = autotune.noise_scale(model, loader, micro_batch=2, micro_batches=4, windows=6, count=lambda b: len(b["input_ids"]))
    assert found == tokens and found != by_samples


def _steps(windows, asked):
    """The effective windows of ``windows`` averaged at the meter's decay for ``asked``."""
    beta = 1 - 1 / asked
    weights = [(1 - beta) * beta**k for k in range(windows)]
    return sum(weights) ** 2 / sum(w * w for w in weights)


def test_noise_scale_before_training_measures_and_leaves_no_trace():
    model, w_star, truth = problem()
    x, y = samples(w_star, 4096, seed=4)
    gen = torch.Generator().manual_seed(9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen)
    model.weight.grad = torch.full_like(model.weight, 0.25)  # an accumulated gradient that must survive
    before = (model.weight.detach().clone(), model.weight.grad.clone(), gen.get_state(), torch.get_rng_state())
    noise = autotune.noise_scale(model, loader, micro_batch=8, micro_batches=8, windows=300, loss_fn=mse)
    assert noise.value == pytest.approx(truth, rel=0.15)
    after = (model.weight.detach(), model.weight.grad, gen.get_state(), torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    with pytest.raises(ValueError, match="Invalid micro_batches 1"):
        autotune.noise_scale(model, loader, micro_batch=8, micro_batches=1, loss_fn=mse)


# --- optimizer settings that follow the batch -------------------------------------------------


def test_follow_batch_arithmetic():
    from autotune.planning.scaling import follow_batch

    s = follow_batch(4.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=True, effective_batch=256)
    assert s.betas == pytest.approx((0.6, 0.996)) and s.eps == pytest.approx(5e-9) and s.weight_decay == pytest.approx(0.02)
    assert s.warmup_steps == 500 and s.warmup_samples == 500 * 256  # 2 / (1 - 0.996) steps
    # the same warm-up in samples as 2 / (1 - beta2) steps at the old batch (256 / 4 = 64)
    assert s.warmup_samples == pytest.approx(2 / (1 - 0.999) * 64, rel=1e-9)
    big = follow_batch(16.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, decoupled=False, effective_batch=1024)
    assert big.betas[0] == 0.0 and 0 <= big.betas[1] < 1  # kept in [0, 1)
    assert big.weight_decay is None and any("coupled" in n for n in big.notes)
    assert any("beta1=0.9 at kappa=16" in n for n in big.notes)


def test_follow_batch_shows_in_the_plan_and_every_config():
    import json

    from autotune.planning.report import framework_configs

    torch.set_default_dtype(torch.float32)
    model = nn.Linear(8, 2)
    data = [(torch.randn(16, 8), torch.randint(0, 2, (16,)))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    plan = autotune.plan(model, data, target_batch=64, optimizer=opt, memory_limit="1GiB", base_batch=16, follow_batch=True, progress=False)
    o = plan.optimizer_settings
    assert o.kappa == 4 and plan.lr_scale == 2 and plan.warmup_steps == o.warmup_steps == 500
    assert autotune.Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    configs = framework_configs(plan)
    assert "adam_beta1=0.6," in configs["hf"] and "adam_beta2=0.996," in configs["hf"] and "adam_epsilon=5e-09" in configs["hf"]
    assert "weight_decay=0.02," in configs["hf"] and "warmup_steps=500" in configs["hf"]
    ds = json.loads(configs["deepspeed"])["optimizer"]["params"]
    assert ds["betas"] == [0.6, 0.996] and ds["eps"] == pytest.approx(5e-9) and ds["weight_decay"] == pytest.approx(0.02)
    for name in ("lightning", "accelerate"):
        assert "betas=(0.6, 0.996), eps=5e-09, weight_decay=0.02" in configs[name]
    assert "beta_1=0.6, beta_2=0.996, epsilon=5e-09" in configs["keras"]
    assert "betas (0.6, 0.996)" in str(plan)


def test_fit_applies_the_settings_around_each_step_only():
    torch.set_default_dtype(torch.float32)
    model = nn.Linear(8, 2)
    data = [(torch.randn(16, 8), torch.randint(0, 2, (16,))) for _ in range(8)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    plan = autotune.plan(model, data, target_batch=64, optimizer=opt, memory_limit="1GiB", base_batch=16, follow_batch=True, progress=False)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append({k2: o.param_groups[0][k2] for k2 in ("lr", "betas", "eps", "weight_decay")}))
    autotune.fit(model, data, plan=plan, optimizer=opt, progress=False)
    assert len(seen) == 2
    for applied in seen:
        assert applied["lr"] == pytest.approx(2e-3) and applied["betas"] == pytest.approx((0.6, 0.996))
        assert applied["eps"] == pytest.approx(5e-9) and applied["weight_decay"] == pytest.approx(0.02)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 0.01)


def test_the_stated_range_covers_the_truth_when_the_target_is_far_below_it():
    """Target 64 against a true noise scale of about 1,000 (|G|^2 small against the noise): over 200
    runs of 120 windows, each from its own samples, the stated range covers the closed-form truth in
    at least 90% of the runs (it is two standard errors wide: about 95%). The windows are fed to the
    meter as fit feeds it (the first micro-batch of 8 against the window of 64), computed here in
    closed form for speed; test_the_estimate_recovers_the_true_noise_scale runs fit itself."""
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(D, generator=g)
    delta = torch.randn(D, generator=g)
    delta = delta / delta.norm() * math.sqrt(0.002)
    truth = ((D + 1) * 0.002 + SIGMA**2 * D) / 0.002
    runs, windows, small, big = 200, 120, 8, 64
    covered = open_ended = advised = 0
    for seed in range(runs):
        x, y = samples(w_star, windows * big, seed=100 + seed)
        x, y = x.view(windows, big, D), y.view(windows, big)
        per_example = 2 * x * ((x @ (w_star + delta)) - y).unsqueeze(-1)  # the gradient of (x.w - y)^2 for each sample
        g_small = per_example[:, :small].mean(1).square().sum(-1)
        g_big = per_example.mean(1).square().sum(-1)
        meter = NoiseMeter()
        for gs, gb in zip(g_small.tolist(), g_big.tolist()):
            meter.add(gs, small, gb, big)
        noise = meter.estimate()
        covered += noise.low <= truth <= noise.high
        open_ended += math.isinf(noise.high)
        said = advice(noise, big)
        if said is not None:  # advice only when the range is clearly away from the target, in its direction
            advised += 1
            assert noise.low > 2 * big and "below the measured noise scale" in said
    assert covered >= 0.9 * runs, (covered, open_ended, advised)
