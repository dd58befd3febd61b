"""The work a trace counts: each operation's FLOPs and bytes read and written, by phase, dtype and kind.

References, never the estimate's own output: ``torch.utils.flop_counter.FlopCounterMode`` on the same real step on
the CPU (forward and backward; the optimizer step has no FLOPs in torch's counter, nor in ours), a real forward's
per-module counts for the blocks a checkpointed backward recomputes, and the quantized weights' elements and a
linear layer's bytes counted by hand from the shapes.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from autotune.memory.work import Work
from autotune.probe.estimate import Estimator
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402

aten = torch.ops.aten
LENGTH, VOCAB = 32, 500

# torch's counter has no formula for the CPU's fused attention kernel (it counts it as nothing): the one of CUDA's
# flash kernel, whose arguments are the same, is given to it for the CPU's (torch's own formulas).
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}


def text_batch(b, *, padded=True):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (b, LENGTH), generator=g)
    mask = torch.ones(b, LENGTH, dtype=torch.long)
    if padded:
        mask[: b // 2, LENGTH // 2:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def own_loss(model, batch):
    return model(**batch).loss


def estimator(model, batch, *, checkpointing=False, optimizer=torch.optim.AdamW):
    trainable = [p for p in model.parameters() if p.requires_grad]
    work = Workload(model=model, optimizer=optimizer(trainable, lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cpu"), checkpointing=checkpointing)
    return Estimator(work)


def counted(model, batch, *, backward=True):
    """torch's count of a real step on a copy of ``model`` (forward, and backward unless not asked)."""
    model = copy.deepcopy(model)
    model.train()
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter:
        if backward:
            own_loss(model, batch).backward()
        else:
            with torch.no_grad():
                own_loss(model, batch)
    return counter


# --- FLOPs as torch counts them ----------------------------------------------------------------------------


@pytest.mark.parametrize("name, attention", [("gpt2", "sdpa"), ("llama", "sdpa"), ("gpt2", "eager"), ("llama", "eager")])
def test_a_trace_counts_the_flops_torch_counts_for_the_same_real_step(name, attention):
    """Forward and backward: the trace's FLOPs equal FlopCounterMode's count of the real step (with eager attention,
    torch's counter as it is, nothing mapped). The optimizer step has none in either."""
    model = getattr(hf_models, name)()
    model.set_attn_implementation(attention)
    batch = text_batch(4)
    work = estimator(model, batch).work(4)

    assert work.of(phase=("forward", "backward")).flops == counted(model, batch).get_total_flops() > 0
    assert work.of(phase="forward").flops == counted(model, batch, backward=False).get_total_flops()
    assert work.of(phase="step").flops == 0 and work.of(phase="step").bytes > 0  # memory-bound: bytes only
    real = copy.deepcopy(model)
    own_loss(real, batch).backward()
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3)
    with FlopCounterMode(display=False) as counter:
        opt.step()
    assert counter.get_total_flops() == 0
    kinds = work.by("kind")
    assert kinds["matmul"][0] > 0 and kinds["memory"][0] == 0 and kinds["memory"][1] > 0
    assert ("attention" in kinds) == (attention == "sdpa")
    assert work.by("dtype")["float32"][0] == work.flops  # fp32 training: every FLOP in fp32


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_cuda_target_under_bf16_counts_the_same_flops_in_bf16_with_cudas_attention_kernel(name):
    """A CUDA target runs CUDA's flash kernel and bf16 autocast: the same FLOPs as the real fp32 step on the CPU, every
    one of them in bf16; the matmuls read and write half the bytes of an fp32 target's."""
    model = getattr(hf_models, name)()
    batch = text_batch(4, padded=False)
    made = {}
    for precision in ("bf16", "fp32"):
        work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                        device=torch.device("cuda"), precision=precision)
        est = Estimator(work)
        made[precision] = est.work(4)
        assert est.backends == ["flash" if precision == "bf16" else "efficient"] * model.config.num_hidden_layers
    bf16 = made["bf16"]
    assert bf16.of(phase=("forward", "backward")).flops == counted(model, batch).get_total_flops()
    assert bf16.by("dtype")["bfloat16"][0] == bf16.flops > 0
    assert 2 * bf16.of(kind="matmul").bytes == made["fp32"].of(kind="matmul").bytes


def test_the_bytes_of_a_linear_layer_are_its_inputs_and_outputs_counted_by_hand():
    """A linear layer's forward, by hand: ``addmm`` reads the bias, the input and the weight and writes the output; the
    sum reads the output and writes a scalar; the backward's seed writes a scalar. Views (the weight's transpose, the
    loss detached) move nothing."""
    b, n_in, n_out = 6, 10, 7
    model = nn.Linear(n_in, n_out)
    x = torch.randn(b, n_in)
    work = Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lambda m, x: m(x).sum(),
                    batch=x, device=torch.device("cpu"))
    forward = Estimator(work).work(b).of(phase="forward")
    addmm = 4 * (n_out + b * n_in + n_in * n_out + b * n_out)
    assert forward.flops == 2 * b * n_in * n_out
    assert forward.bytes == addmm + 4 * (b * n_out + 1) + 4
    assert forward.of(kind="matmul").bytes == addmm


# --- a checkpointed step recomputes its blocks' forward -------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_checkpointed_step_counts_its_blocks_forward_once_more(name):
    """With torch's early stop off, the backward of a checkpointed step holds the blocks' whole forward again: it grows
    by the blocks' forward FLOPs exactly, as a real forward's per-module counts give them. With it on (torch's default),
    a block's forward is recomputed up to its last saved tensor: the trace counts what the real checkpointed step does."""
    model = getattr(hf_models, name)()
    batch = text_batch(4)
    plain = estimator(model, batch).work(4)
    with set_checkpoint_early_stop(False):
        whole = estimator(model, batch, checkpointing=True).work(4)
    early = estimator(model, batch, checkpointing=True).work(4)

    per_module = counted(model, batch, backward=False).get_flop_counts()
    prefix = type(model).__name__ + (".transformer.h." if name == "gpt2" else ".model.layers.")
    blocks = sum(sum(per_module[f"{prefix}{k}"].values()) for k in range(model.config.num_hidden_layers))
    assert blocks > 0
    assert whole.of(phase="forward").flops == plain.of(phase="forward").flops
    assert whole.of(phase="backward").flops - plain.of(phase="backward").flops == blocks
    assert whole.of(phase="step") == plain.of(phase="step")

    real = copy.deepcopy(model)
    real.activation_checkpointing_enable()
    assert early.of(phase=("forward", "backward")).flops == counted(real, batch).get_total_flops()
    assert plain.of(phase="backward").flops < early.of(phase="backward").flops <= whole.of(phase="backward").flops


# --- a 4-bit model dequantizes its weights ---------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [False, True], ids=["nf4", "nf4, double quantization"])
def test_a_4bit_model_counts_its_dequantization(double_quant):
    """Each 4-bit weight is dequantized once in the forward (inside bitsandbytes' fused matmul) and once in the backward
    (for its input's gradient): one operation per element, and per element of its absmax with double quantization
    (blocks of 64 weights, bitsandbytes' default). The forward's matmuls are those of the unquantized model."""
    pytest.importorskip("bitsandbytes")
    from autotune.memory.quantized import Quantization, quantize

    dim, mlp, layers, kv = 64, 128, 2, 2 * 16  # hf_models.llama: 4 heads of 16, 2 of them for keys and values
    weights = layers * (dim * dim + 2 * dim * kv + dim * dim + 3 * dim * mlp)  # q, k, v, o; gate, up, down
    per_pass = weights + (weights // 64 if double_quant else 0)
    model = hf_models.llama()
    batch = text_batch(4)
    unquantized = counted(model, batch, backward=False).get_total_flops()
    quantize(model, Quantization("nf4", double_quant=double_quant, compute_dtype=torch.float32))

    work = estimator(model, batch).work(4)
    assert work.of(kind="dequantize", phase="forward").flops == per_pass
    assert work.of(kind="dequantize", phase="backward").flops == per_pass
    assert work.of(kind="dequantize").by("dtype").keys() == {"float32"}
    assert work.of(phase="forward", kind=("matmul", "attention")).flops == unquantized


# --- the work of a step against its micro-batch ---------------------------------------------------------------


def test_the_work_of_a_step_grows_linearly_in_the_micro_batch_its_fixed_part_the_optimizers():
    """Every sample adds the same work: the FLOPs at 2, 4 and 6 samples lie on a line through zero (the optimizer step
    has none), the bytes on a line whose fixed part holds the optimizer step's, the same at every size."""
    model = hf_models.gpt2()
    est = estimator(model, text_batch(2, padded=False))
    at = {b: est.work(b) for b in (2, 4, 6)}
    flops = {b: w.flops for b, w in at.items()}
    nbytes = {b: w.bytes for b, w in at.items()}
    assert flops[6] - flops[4] == flops[4] - flops[2] > 0
    assert 2 * flops[2] - flops[4] == 0
    assert nbytes[6] - nbytes[4] == nbytes[4] - nbytes[2] > 0
    fixed = 2 * nbytes[2] - nbytes[4]
    step = at[2].of(phase="step")
    assert step == at[4].of(phase="step") == at[6].of(phase="step")
    assert fixed >= step.bytes > 0


def test_another_optimizer_keeps_the_forward_and_backward_and_counts_its_own_step():
    """A what-if's estimator (another optimizer, traced from the workload's): the same forward and backward, its own
    optimizer step (plain SGD reads and writes less than AdamW)."""
    model = hf_models.gpt2()
    est = estimator(model, text_batch(4))
    work = Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=own_loss, batch=text_batch(4),
                    device=torch.device("cpu"))
    sgd = est.derived(work, lambda groups: torch.optim.SGD(groups, lr=0.1))
    adam, plain = est.work(4), sgd.work(4)
    assert plain.of(phase=("forward", "backward")) == adam.of(phase=("forward", "backward"))
    assert 0 < plain.of(phase="step").bytes < adam.of(phase="step").bytes


# --- the record ---------------------------------------------------------------------------------------------


def test_work_adds_filters_and_breaks_down():
    a = Work((("forward", "bfloat16", "matmul", 100, 10), ("backward", "float32", "memory", 0, 7)))
    b = Work((("forward", "bfloat16", "matmul", 5, 1), ("step", "float32", "memory", 0, 30)))
    total = a + b
    assert (total.flops, total.bytes) == (105, 48)
    assert total.of(phase="forward").parts == (("forward", "bfloat16", "matmul", 105, 11),)
    assert total.of(dtype="float32", kind="memory").bytes == 37
    assert total.by("phase") == {"forward": (105, 11), "backward": (0, 7), "step": (0, 30)}
    assert total.to_dict()["by_kind"] == {"matmul": {"flops": 105, "bytes": 11}, "memory": {"flops": 0, "bytes": 37}}
    assert Work().flops == 0 and "0.000 GFLOP" in Work().describe()


def test_a_deep_model_traced_with_few_blocks_counts_the_work_of_all_of_them():
    """A stack of ten blocks is traced with two, three and four of them (:mod:`autotune.probe.depth`): the work extended
    to ten blocks equals torch's count of the real ten-block step, and the whole model's trace, bytes and all."""
    from autotune.probe.depth import DepthEstimator
    from autotune.probe.estimate import estimator_for

    model = hf_models.llama(layers=10)
    batch = text_batch(4)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cpu"))
    est = estimator_for(work)
    assert isinstance(est, DepthEstimator)
    extended = est.work(4)
    assert est._whole is None  # extended, not traced whole
    assert extended.of(phase=("forward", "backward")).flops == counted(model, batch).get_total_flops()
    assert extended.of(phase="step").flops == 0 and extended.of(phase="step").bytes > 0
    whole = Estimator(work).work(4)  # the ten blocks traced: the same bytes too, part by part
    assert sorted(extended.parts) == sorted(whole.parts)
