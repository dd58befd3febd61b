"""The CUDA estimate follows CUDA's own rules, on a machine without a GPU.

Each operation's dtype under autocast is compared with what CUDA's autocast kernels give on fake CUDA
tensors (:mod:`cuda_reference`), for models nobody here wrote; the attention kernel with the rule
torch documents, after autocast has cast its inputs; activations per layer with a count written out
by hand from GPT-2's code and CUDA's autocast lists.
"""

from __future__ import annotations

import pytest
import torch
from cuda_reference import cuda_forward, estimated_forward, forward_bytes

import autotune
from autotune.probe.cuda import CudaAutocast, cuda_rule
from autotune.probe.estimate import Estimator
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def gpt2(layers=2, dim=64, dropout=0.1, vocab=500, positions=256):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=dim, n_head=4, vocab_size=vocab, n_positions=positions,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def bert(layers=2):
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                                     vocab_size=500, max_position_embeddings=256, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def t5(layers=2):
    torch.manual_seed(0)
    config = transformers.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=64, d_kv=16, num_heads=4, d_ff=128,
                                   vocab_size=500, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def llama(layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=128, vocab_size=500, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


def lm_batch(b=2, length=32):
    ids = torch.randint(0, 500, (b, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def padded_cls_batch(b=2, length=32):
    ids = torch.randint(1, 500, (b, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(b, length, dtype=torch.long)
    mask[1, length // 2:] = 0  # dynamic padding: the second sample is half as long
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 2])}


def s2s_batch(b=2, length=32):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(1, 500, (b, length), generator=g), "labels": torch.randint(1, 500, (b, length // 2), generator=g)}


CASES = {
    "gpt2": (gpt2, lm_batch),
    "bert": (bert, padded_cls_batch),
    "t5": (t5, s2s_batch),
    "llama": (llama, lm_batch),
}


def hf_loss(model, batch):
    return model(**batch).loss


def estimator(model, batch, precision, device="cuda"):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work = Workload(model=model, optimizer=opt, loss_fn=hf_loss, batch=batch, device=torch.device(device), precision=precision)
    return Estimator(work)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_operation_takes_the_dtype_cudas_autocast_gives_it(name, precision):
    make, batch_of = CASES[name]
    model, batch = make(), batch_of()
    reference = cuda_forward(model, batch, DTYPES[precision])
    est = estimator(model, batch, precision)
    trace = est.trace(2)
    assert len(reference) > 40
    assert estimated_forward(trace, len(reference)) == reference
    assert est.unlearned == {}


LAYERED = {"gpt2": lambda n: gpt2(layers=n), "bert": bert, "t5": t5, "llama": llama}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_the_activations_a_layer_makes_are_cudas(name, precision):
    # Every operation's output, in dtype and size, for one more layer (T5: one more in the encoder and
    # the decoder): the bytes a layer's forward allocates, by CUDA's kernels and by the estimate.
    _, batch_of = CASES[name]
    batch = batch_of()
    made = {}
    for n in (1, 2):
        model = LAYERED[name](n)
        reference = cuda_forward(model, batch, DTYPES[precision])
        estimate = estimated_forward(estimator(model, batch, precision).trace(2), len(reference))
        made[n] = (forward_bytes(reference), forward_bytes(estimate))
    per_layer_cuda, per_layer_estimate = made[2][0] - made[1][0], made[2][1] - made[1][1]
    assert per_layer_cuda > 0 and per_layer_estimate == per_layer_cuda


def test_the_cpus_autocast_rules_would_fail_that_comparison():
    # The comparison can fail: the CPU's own autocast keeps GPT-2's pow, layer norms and softmax in
    # bf16 where CUDA's runs them in fp32.
    model, batch = gpt2(), lm_batch()
    reference = cuda_forward(model, batch, torch.bfloat16)
    on_cpu = estimator(model, batch, "bf16", device="cpu").trace(2)
    assert estimated_forward(on_cpu, len(reference)) != reference


@pytest.mark.parametrize("name, backend", [("gpt2", "flash"), ("llama", "flash"), ("bert", "efficient"), ("t5", "efficient")])
def test_attention_takes_the_kernel_cuda_picks_after_autocast(name, backend):
    # Llama's rotary embedding leaves q and k in fp32 until autocast casts them for the kernel: CUDA
    # runs flash attention on the bf16 inputs. BERT's padding mask and T5's position bias rule flash out.
    make, batch_of = CASES[name]
    est = estimator(make(), batch_of(), "bf16")
    est.trace(2)
    assert est.backends and set(est.backends) == {backend}


def saved_before_backward(layers, *, precision="bf16", dropout=0.0, b=4, s=256, h=256):
    """Bytes live when the backward starts, and what the steady state holds (parameters, gradients, state)."""
    model = gpt2(layers=layers, dim=h, dropout=dropout, vocab=512, positions=s)
    batch = lm_batch(b, s)
    batch["input_ids"] %= 512
    batch["labels"] = batch["input_ids"]
    est = estimator(model, batch, precision)
    trace = est.trace(b)
    start = [str(op) for op in trace.ops].index("aten.ones_like.default")  # backward's first gradient
    return trace.live[start], est.resident()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpt2_activations_per_layer_are_what_cudas_rules_keep(precision, dropout):
    b, s, h = 4, 256, 256
    one, held_one = saved_before_backward(1, precision=precision, dropout=dropout, b=b, s=s, h=h)
    two, held_two = saved_before_backward(2, precision=precision, dropout=dropout, b=b, s=s, h=h)
    weights = 12 * h * h * 2  # the 16-bit copies of a block's four weights that the matmuls keep for backward
    per_layer = (two - one) - (held_two - held_one) - weights
    # Saved for backward by one GPT-2 block under CUDA's autocast, in bytes per token per hidden unit
    # (read from transformers' GPT2Block and torch's CUDA autocast lists):
    # ln_1's fp32 input 4; c_attn's input cast to 16 bits 2 and its output 6 (q is a view of it); the
    # key and value copies the KV cache concatenates 2 + 2; attention's output 2; ln_2's fp32 input 4;
    # c_fc's input cast 2; gelu_new with pow in fp32 (CUDA's list): pow's fp32 input 16, tanh's fp32
    # output 16, 0.5 * x in 16 bits 8, 1 + tanh in fp32 16; the MLP projection's input cast 8.
    # Per token: each layer norm's mean and rstd (2 x 4 bytes, twice) and attention's fp32 log-sum-exp
    # per head (4 heads x 4 bytes); with dropout, a 1-byte mask after the attention and after the MLP.
    by_hand = (4 + 2 + 6 + 2 + 2 + 2 + 4 + 2 + 16 + 16 + 8 + 16 + 8 + (2 if dropout else 0)) * b * s * h
    by_hand += (2 * 8 + 4 * 4) * b * s
    assert per_layer == pytest.approx(by_hand, rel=1e-3)


def test_gpt2_small_estimate_only_plan_fits_cudas_rules():
    # GPT-2 small (124M parameters, dropout 0.1), 1024 tokens, AdamW, bf16, an 80 GiB card, no GPU here.
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (2, 1024), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "labels": ids}]
    plan = autotune.plan(model, loader, target_batch=512, optimizer=opt, device="cuda", memory_limit="80GiB",
                         verify=False, precision="bf16", progress=False)
    s, h, vocab, layers = 1024, 768, 50257, 12
    states = 16 * sum(p.numel() for p in model.parameters())  # fp32 weights and gradients, AdamW's two moments
    # A lower bound on a sample's bytes at the loss's backward under CUDA's rules: every block's saved
    # activations (88 bytes per token per hidden unit, counted in the test above) and, alive together
    # in log_softmax's backward, its saved fp32 output, the incoming gradient and the one it makes.
    per_sample = layers * 88 * s * h + 12 * s * vocab
    fits_by_cuda_rules = (plan.budget - states) // per_sample
    assert fits_by_cuda_rules == 51  # the CPU's autocast rules planned 58 here, which would not fit
    assert 40 <= plan.micro_batch <= fits_by_cuda_rules
    assert any("reserved" in n and "allocated" in n for n in plan.notes)
    sizes = [t.batch_size for t in plan.trials]
    assert len(sizes) == len(set(sizes))  # the allocator's replay reads the curve's traces again: not new trials


def test_a_cuda_estimates_trials_say_the_allocators_reserved_bytes_and_verdict(monkeypatch):
    """For a CUDA target a size fits where the caching allocator's replay serves it, and what it reserves can be far
    above its tensors' peak (cuBLAS's workspace, segments rounded up): each estimate trial gives those reserved bytes and
    that verdict, the plan's own, so that no trial of more samples than the micro-batch planned reads "fits" (a small
    GPT-2 under a 40 MiB card: its tensors fit 26 samples, the allocator 2)."""
    monkeypatch.setenv("AUTOTUNE_CUDA_CONTEXT", "1MiB")
    model = gpt2()
    ids = torch.randint(0, 500, (8, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    plan = autotune.plan(model, [batch], target_batch=64, device="cuda", memory_limit="40MiB", headroom=0, verify=False,
                         progress=False)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=autotune.step.default_loss,
                    batch=batch, device=torch.device("cuda"), precision="fp32")
    tensors = Estimator(work)  # the tensors' peak alone, traced apart
    larger = [t for t in plan.trials if t.batch_size > plan.micro_batch]
    assert any(tensors(t.batch_size) <= plan.budget for t in larger)  # the shape the test needs
    assert plan.trials and all(t.estimate for t in plan.trials)
    for t in plan.trials:
        assert t.fits == (t.batch_size <= plan.micro_batch) == (t.peak_memory <= plan.budget), t
        assert t.peak_memory >= tensors(t.batch_size) + 32 * 2**20, t  # at least the tensors and cuBLAS's workspace
        if t.batch_size == plan.micro_batch:
            assert t.peak_memory == plan.peak_memory


@pytest.mark.parametrize("target", [1, 4])
def test_a_cuda_estimate_lists_each_trace_it_used_once(target):
    """The search traces a size, and the allocator's replay reads that same trace again: one trial for each size traced
    (at a target of one sample the search's only size; it was listed twice)."""
    model = gpt2()
    ids = torch.randint(0, 500, (8, 64), generator=torch.Generator().manual_seed(0))
    plan = autotune.plan(model, [{"input_ids": ids, "labels": ids}], target_batch=target, device="cuda", memory_limit="2GiB",
                         verify=False, progress=False)
    sizes = [t.batch_size for t in plan.trials]
    assert target in sizes and len(sizes) == len(set(sizes)), plan.trials


def test_rules_are_cudas_kernels_for_reductions_norms_and_powers():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 8, dtype=torch.bfloat16)
    aten = torch.ops.aten
    assert cuda_rule(aten.layer_norm.default, (x, [8]), {}, torch.bfloat16).casts == ((0, torch.float32),)
    assert cuda_rule(aten.pow.Tensor_Scalar, (x, 3.0), {}, torch.bfloat16).casts == ((0, torch.float32),)
    assert cuda_rule(aten.softmax.int, (x, -1), {}, torch.bfloat16).args == ((2, torch.float32),)
    assert cuda_rule(aten.sum.default, (x,), {}, torch.bfloat16).kwargs == (("dtype", torch.float32),)
    assert cuda_rule(aten.gelu.default, (x,), {}, torch.bfloat16).autocast is False
    with FakeTensorMode():
        w = torch.empty(8, 8)
    assert set(cuda_rule(aten.mm.default, (w, w), {}, torch.float16).casts) == {(0, torch.float16), (1, torch.float16)}


def test_a_cuda_estimate_leaves_the_cpus_autocast_as_it_was():
    x = torch.randn(8, 8)

    def cpu_dtypes():
        with torch.autocast("cpu", torch.bfloat16):
            return torch.mm(x, x).dtype, torch.nn.functional.layer_norm(x.bfloat16(), (8,)).dtype, torch.pow(x.bfloat16(), 2).dtype

    before = cpu_dtypes()
    with CudaAutocast():
        with torch.autocast("cpu", torch.bfloat16):
            assert torch.pow(x.bfloat16(), 2).dtype == torch.float32  # CUDA's rule while the context is open
    estimator(gpt2(), lm_batch(), "bf16").trace(2)
    assert cpu_dtypes() == before == (torch.bfloat16, torch.bfloat16, torch.bfloat16)


def test_an_operation_cudas_autocast_refuses_is_refused_by_the_estimate():
    model = torch.nn.Linear(8, 1)
    batch = (torch.randn(4, 8), torch.rand(4, 1))

    def bce(m, b):
        return torch.nn.functional.binary_cross_entropy(torch.sigmoid(m(b[0])), b[1])

    work = Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=bce, batch=batch,
                    device=torch.device("cuda"), precision="bf16")
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        Estimator(work).trace(2)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_cuda_estimate_with_activation_checkpointing_recomputes_with_cudas_kernels(precision):
    # The backward's recomputation runs outside the estimate's modes: it must take the same kernels
    # (else the checkpoint sees other tensors saved than in the forward, and refuses).
    model, batch = gpt2(layers=4, dim=128), lm_batch(4, 128)
    plain = estimator(model, batch, precision)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    work = Workload(model=model, optimizer=opt, loss_fn=hf_loss, batch=batch, device=torch.device("cuda"), precision=precision)
    checkpointed = Estimator(work, checkpointing=True)
    assert checkpointed(4) < plain(4)
