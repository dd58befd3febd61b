"""Estimates against real CPU peaks: transformers models with attention masks, attention kernels at
several lengths, foreach and fused optimizers, bf16 autocast, and the search when nothing fits.

The reference is a real training step on the CPU, its peak counted by a TensorLedger in the test
(the same micro-step, optimizer step, micro-step the probe runs), never the estimator's own output.
"""

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotune
from autotune.memory.ledger import TensorLedger
from autotune.probe.estimate import (
    Estimator,
    cuda_attention_backend,
    optimizer_for_device,
)
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402


def real_peak(model, optimizer, loss_fn, batch, precision=None):
    """The real CPU peak of micro-step, optimizer step, micro-step on copies (written apart from autotune)."""
    model = copy.deepcopy(model)
    model.train()
    accepted = inspect.signature(type(optimizer).__init__).parameters
    opt = type(optimizer)(model.parameters(), **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    ledger = TensorLedger("cpu")
    ledger.track([*model.parameters(), *model.buffers()])
    ledger.track(t for t in (batch.values() if isinstance(batch, dict) else batch) if isinstance(t, torch.Tensor))
    with ledger:
        for i in range(2):
            with torch.autocast("cpu", dtype=precision, enabled=precision is not None):
                loss = loss_fn(model, batch)
            loss.backward()  # a micro-batch of weight 1, as the trial step runs it
            del loss
            if i == 0:
                opt.step()
    return ledger.peak


def estimated(model, optimizer, loss_fn, batch, b, precision="fp32", device="cpu"):
    work = Workload(model=model, optimizer=optimizer, loss_fn=loss_fn, batch=batch, device=torch.device(device), precision=precision)
    estimator = Estimator(work)
    return estimator(b), estimator


# --- transformers models with attention masks ----------------------------------------------


def text_batch(b, length, *, labels="lm", vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, length), generator=g)
    mask = torch.ones(b, length, dtype=torch.long)
    mask[: b // 2, length // 2 :] = 0  # half the sequences padded: the masks are read
    lab = ids.clone() if labels == "lm" else torch.randint(0, 3, (b,), generator=g)
    if labels == "lm":
        lab[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def own_loss(model, batch):
    return model(**batch).loss


@pytest.mark.parametrize("name, labels", [("gpt2", "lm"), ("bert", "cls")])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_transformers_models_with_masks_estimate_exactly(name, labels, checkpointing):
    model = getattr(hf_models, name)()
    if checkpointing:  # transformers 5 names it activation_checkpointing_enable (the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = text_batch(8, 64, labels=labels)
    peak, _ = estimated(model, opt, own_loss, batch, 8)
    assert peak == pytest.approx(real_peak(model, opt, own_loss, batch), rel=0.05)


@pytest.mark.parametrize("name, labels", [("gpt2", "lm"), ("bert", "cls")])
def test_transformers_plan_takes_one_real_trial_and_estimate_only_plans_work(name, labels):
    model = getattr(hf_models, name)()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = [text_batch(8, 64, labels=labels, seed=s) for s in range(3)]
    plan = autotune.plan(model, loader, target_batch=512, optimizer=opt, memory_limit="40MiB", headroom=0)
    assert not any("estimate unavailable" in n for n in plan.notes)
    assert sum(not t.estimate for t in plan.trials) == 1
    assert 1 < plan.micro_batch < 512
    guess = autotune.plan(model, loader, target_batch=512, optimizer=opt, memory_limit="40MiB", headroom=0, verify=False)
    assert not guess.verified and guess.micro_batch == plan.micro_batch
    cuda = autotune.plan(model, loader, target_batch=4096, optimizer=opt, device="cuda", memory_limit="80GiB", verify=False)
    assert cuda.micro_batch > 64 and cuda.device.startswith("cuda")


# --- attention ------------------------------------------------------------------------------


class CausalLM(nn.Module):
    """One causal attention block over token embeddings: F.scaled_dot_product_attention, 4 heads of 64."""

    def __init__(self, dim=256, heads=4, vocab=100):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        b, length, dim = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, dim)
        return self.head(x + self.out(y))


class EncoderLM(nn.Module):
    """nn.TransformerEncoderLayer (which calls scaled_dot_product_attention) with a causal mask."""

    def __init__(self, dim=128, vocab=100):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens), is_causal=True, src_mask=nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])))


def lm_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def tokens(b, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (b, length), generator=g), torch.randint(0, 100, (b, length), generator=g)


@pytest.mark.parametrize("length, b", [(256, 4), (1024, 2), (4096, 1)])
def test_attention_estimate_matches_the_cpu_kernel(length, b):
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tokens(b, length)
    peak, _ = estimated(model, opt, lm_loss, batch, b)
    real = real_peak(model, opt, lm_loss, batch)
    assert peak == pytest.approx(real, rel=0.05)
    scores = b * 4 * length * length * 4  # what a materialised B x H x L x L would take
    assert real < scores or length < 1024  # the kernel never materialises them at long lengths


def test_transformer_encoder_layer_attention_estimate():
    model = EncoderLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = tokens(2, 1024)
    peak, _ = estimated(model, opt, lm_loss, batch, 2)
    assert peak == pytest.approx(real_peak(model, opt, lm_loss, batch), rel=0.05)


def test_cuda_attention_backend_rule():
    assert cuda_attention_backend(torch.bfloat16, 64, 64, has_mask=False) == "flash"
    assert cuda_attention_backend(torch.float16, 128, 128, has_mask=False) == "flash"
    assert cuda_attention_backend(torch.bfloat16, 64, 64, has_mask=True) == "efficient"
    assert cuda_attention_backend(torch.float32, 64, 64, has_mask=False) == "efficient"
    assert cuda_attention_backend(torch.bfloat16, 320, 320, has_mask=False) == "efficient"
    assert cuda_attention_backend(torch.float64, 64, 64, has_mask=False) == "math"
    assert cuda_attention_backend(torch.float32, 1024, 1024, has_mask=False) == "math"
    # torch's check_head_dim_size_flash: flash takes a query, key and value of one head size; the memory-efficient kernel
    # a value of its own (DeepSeek-V3's multi-head latent attention: 192 and 128)
    assert cuda_attention_backend(torch.bfloat16, 192, 128, has_mask=False) == "efficient"


def test_a_cuda_estimate_of_attention_whose_value_heads_are_narrower_runs_the_efficient_kernel():
    """A DeepSeek-V3 shape in bf16 (query and key heads of 48, value heads of 32, no padding): its attention is not
    flash's on CUDA, and the estimate stopped on the output flash's stand-in made, shaped as the query (the output
    projection took 8 x 48 where it has 8 x 32)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=500, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                              first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                              num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                              qk_rope_head_dim=16, v_head_dim=32, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 500, (2, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak, est = estimated(model, opt, lambda m, b: m(**b).loss, batch, 2, precision="bf16", device="cuda")
    assert set(est.backends) == {"efficient"} and peak > 0


def test_a_cuda_target_models_the_fused_kernels_and_the_math_path():
    model = CausalLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = tokens(2, 1024)
    fused, est = estimated(model, opt, lm_loss, batch, 2, precision="bf16", device="cuda")
    assert set(est.backends) == {"flash"}
    fp32, est32 = estimated(model, opt, lm_loss, batch, 2, device="cuda")
    assert set(est32.backends) == {"efficient"}
    cpu_bf16 = real_peak(model, opt, lm_loss, batch, precision=torch.bfloat16)
    assert fused == pytest.approx(cpu_bf16, rel=0.10)  # both fused: output and log-sum-exp only
    math_path, est64 = estimated(model.double(), torch.optim.AdamW(model.parameters()), lm_loss, batch, 2, device="cuda")
    assert set(est64.backends) == {"math"}
    scores = 2 * 4 * 1024 * 1024 * 8
    assert math_path - fp32 * 2 > scores  # fp64 doubles everything, and the scores are materialised


# --- optimizers: the implementation the device takes ---------------------------------------


@pytest.mark.parametrize("impl", [dict(foreach=True), dict(fused=True), dict(foreach=False)], ids=["foreach", "fused", "single"])
@pytest.mark.parametrize("opt_class", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD], ids=["AdamW", "Adam", "SGD"])
def test_optimizer_implementations_estimate_exactly(impl, opt_class):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))
    kwargs = dict(lr=0.01, **impl)
    if opt_class is torch.optim.SGD:
        kwargs["momentum"] = 0.9
    opt = opt_class(model.parameters(), **kwargs)
    batch = (torch.randn(4, 512), torch.randint(0, 10, (4,)))
    peak, est = estimated(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch, 4)
    assert peak == real_peak(model, opt, lambda m, b: F.cross_entropy(m(b[0]), b[1]), batch)
    group = est.optimizer.param_groups[0]
    assert group.get("foreach") == impl.get("foreach") and bool(group.get("fused")) == bool(impl.get("fused"))


def test_a_cuda_target_defaults_optimizers_to_foreach():
    model = nn.Linear(8, 8)
    assert optimizer_for_device(torch.optim.AdamW(model.parameters()), "cuda")[0]["foreach"] is True
    assert optimizer_for_device(torch.optim.AdamW(model.parameters()), "cpu")[0]["foreach"] is None
    assert optimizer_for_device(torch.optim.AdamW(model.parameters(), foreach=False), "cuda")[0]["foreach"] is False
    assert optimizer_for_device(torch.optim.AdamW(model.parameters(), fused=True), "cuda")[0]["foreach"] is None
    assert optimizer_for_device(torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True), "cuda")[0]["foreach"] is None


def test_existing_optimizer_state_is_estimated_from_its_step():
    """Mid-training: Adam's state and step count exist; the estimate reads the count and does not crash."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.randn(16, 64), torch.randint(0, 10, (16,)))
    loss = lambda m, b: F.cross_entropy(m(b[0]), b[1])  # noqa: E731
    loss(model, batch).backward()
    opt.step()
    opt.zero_grad()
    peak, _ = estimated(model, opt, loss, batch, 16)
    # reference: the same step on a copy that keeps the state
    ref = copy.deepcopy(model)
    ref_opt = copy.deepcopy(opt)
    ref_opt.param_groups[0]["params"] = list(ref.parameters())
    ref_opt.state = {p: s for p, s in zip(ref.parameters(), opt.state.values())}
    ledger = TensorLedger("cpu")
    ledger.track([*ref.parameters(), *batch, *(v for s in opt.state.values() for v in s.values())])
    with ledger:
        loss(ref, batch).backward()
        ref_opt.step()
        loss(ref, batch).backward()
    assert peak == ledger.peak


# --- autocast -------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["causal-lm", "gpt2"])
def test_bf16_autocast_estimate_matches_the_real_bf16_peak(which):
    if which == "gpt2":
        model, loss, batch = hf_models.gpt2(), own_loss, text_batch(8, 64)
    else:
        model, loss, batch = CausalLM(), lm_loss, tokens(4, 256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bf16, _ = estimated(model, opt, loss, batch, next(iter(batch.values())).shape[0] if isinstance(batch, dict) else batch[0].shape[0], precision="bf16")
    real16 = real_peak(model, opt, loss, batch, precision=torch.bfloat16)
    real32 = real_peak(model, opt, loss, batch)
    assert bf16 == pytest.approx(real16, rel=0.05)
    assert real16 < 0.95 * real32  # the difference the estimate used to miss


# --- the search when nothing fits -----------------------------------------------------------


class FixedCost(nn.Module):
    """A real step holds a large fixed scratch buffer the estimate cannot see: nothing fits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 4)

    def forward(self, x):
        from helpers import estimating

        if not estimating(x):
            scratch = torch.ones(4 * 2**20 // 4)  # 4 MiB, whatever the batch
            x = x + scratch[:1] * 0
        return self.lin(x)


def test_the_smallest_size_gets_a_real_trial_before_nothing_fits():
    model = FixedCost()
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]
    with pytest.raises(autotune.NothingFits) as excinfo:
        autotune.plan(model, data, target_batch=256, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      memory_limit="2MiB", headroom=0)
    err = excinfo.value
    assert err.measured and err.micro_batch == 1
    assert err.needed > err.budget
    assert "needs at least" in str(err) and "measured in a real step" in str(err)


def test_nothing_fits_is_said_after_at_most_three_real_trials():
    model = FixedCost()
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]
    seen = []
    with pytest.raises(autotune.NothingFits):
        autotune.plan(model, data, target_batch=256, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      memory_limit="2MiB", headroom=0, on_trial=seen.append)
    real = [t.batch_size for t in seen if not t.estimate]
    assert real[-1] == 1 and len(real) <= 3  # the estimate's size, a back-off, then the smallest


# --- resident memory beyond the tensor count (the CPU's physical memory as the limit) ----------


class Untracked(nn.Module):
    """Uses memory no tensor count sees (numpy scratch, freed after the forward), growing with the batch."""

    def __init__(self, per_sample):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 4)
        self.per_sample = per_sample

    def forward(self, x):
        np = pytest.importorskip("numpy")
        scratch = np.ones(x.shape[0] * self.per_sample, dtype=np.uint8)  # touched: resident
        out = self.lin(x) + float(scratch[:1].sum()) * 0
        del scratch
        return out


def test_a_default_cpu_plan_budgets_the_resident_growth(monkeypatch):
    import autotune.planning.planner

    monkeypatch.setattr(autotune.planning.planner, "default_limit", lambda device, held: 256 * 2**20)  # "the machine's RAM"
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))]
    model = Untracked(2 * 2**20)  # 2 MiB per sample the tensor count cannot see
    plan = autotune.plan(model, data, target_batch=256, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # 256 samples would hold 512 MiB: the real trial's resident growth rules it out
    assert plan.micro_batch < 128
    assert any(not t.estimate and not t.fits for t in plan.trials)
    assert plan.peak_memory >= plan.micro_batch * 2 * 2**20 * 0.9
    assert plan.peak_memory <= plan.budget


# --- estimates that cannot run -------------------------------------------------------------


class HostOp(nn.Module):
    """Reads its activations on the host (``.numpy()``), as models calling scipy or numpy do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        h = self.body[0](x)
        scale = float(abs(h.detach().numpy()).mean() > -1.0)  # 1.0, known only from the values
        return self.body[2](self.body[1](h) * scale)


def test_a_model_with_a_host_op_plans_with_real_trials_and_one_line_why(capfd):
    from helpers import OPTIMIZERS, data_for, true_max

    model = HostOp()
    data = data_for("mlp")
    limit = 1_300_000
    truth = true_max(model, OPTIMIZERS["sgd"], data[0], limit, 256)
    plan = autotune.plan(model, data, target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), memory_limit=limit,
                         headroom=0, progress=False)
    assert all(not t.estimate for t in plan.trials)
    why = [n for n in plan.notes if "estimate unavailable" in n]
    assert len(why) == 1 and "numpy" in why[0] and "\n" not in why[0]
    assert plan.micro_batch == truth
    assert capfd.readouterr().err == ""  # nothing from torch's logger while planning
