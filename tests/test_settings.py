"""The settings fine-tuners train with, estimated: bitsandbytes 4-bit and 8-bit base weights (QLoRA), the Trainer's
optimizers, fp32 master weights, the attention kernel, Liger's fused linear cross-entropy, packing, and
mixtures of experts. References are independent of the estimate: bitsandbytes' own quantization of a layer, real
CPU steps counted by a ledger in the test, cross-entropy on the logits in float64."""

import copy
import json
import re
import warnings

import pytest
import torch

import autotune
from autotune.memory.ledger import TensorLedger
from autotune.probe.estimate import Estimator, estimator_for
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
import hf_models  # noqa: E402
from test_estimate import text_batch  # noqa: E402
from test_meta import report, write_config  # noqa: E402

from autotune.memory.optimizers import describe, make_optimizer  # noqa: E402
from autotune.memory.quantized import Quantization, quantize  # noqa: E402


def own_loss(model, batch):
    return model(**batch).loss


def lora(model, r=8, modules="all-linear"):
    with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, peft.LoraConfig(r=r, target_modules=modules))


def state_tensors(model):
    """A quantized layer's tensors outside its parameters, found here from bitsandbytes' own attributes."""
    for m in model.modules():
        state = getattr(getattr(m, "weight", None), "quant_state", None)
        while state is not None:
            yield from (t for t in (state.absmax, state.code, state.offset) if isinstance(t, torch.Tensor))
            state = state.state2
        scb = getattr(getattr(m, "state", None), "SCB", None)
        if scb is None:
            scb = getattr(getattr(m, "weight", None), "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb


def real_peak(model, make_opt, loss_fn, batch, precision=None):
    """Micro-step, optimizer step, micro-step on a copy, every tensor it holds counted (written apart from autotune)."""
    model = copy.deepcopy(model)
    model.train()
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    ledger = TensorLedger("cpu")
    ledger.track([*model.parameters(), *model.buffers(), *state_tensors(model), *batch.values()])
    step = {}
    with ledger, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        for i in range(2):
            with torch.autocast("cpu", dtype=precision, enabled=precision is not None):
                loss = loss_fn(model, batch)
            loss.backward()
            del loss
            if i == 0:
                ledger.peak = ledger.live  # the step's own peak above what it leaves
                opt.step()
                step = {"transient": ledger.peak - ledger.live}
                ledger.peak = max(ledger.peak, ledger.live)
    return ledger.peak, step["transient"]


# --- quantized base weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_small_quantized_model_with_lora_estimates_its_real_cpu_step_to_the_byte(kind, precision):
    model = lora(quantize(hf_models.llama(layers=2, dim=128, mlp=256), kind))
    assert sum(1 for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")) == 14
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    batch = text_batch(4, 32)
    real, _ = real_peak(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), own_loss, batch,
                        None if precision == "fp32" else torch.bfloat16)
    work = Workload(model=model, optimizer=opt, loss_fn=own_loss, batch=batch, device=torch.device("cpu"), precision=precision)
    assert Estimator(work)(4) == real
    held = sum(t.untyped_storage().nbytes() for t in state_tensors(model))
    assert held > 0  # the quantization state is counted on both sides, and it is not nothing


def bitsandbytes_bytes(out_features, in_features, kind):
    """What bitsandbytes holds for one quantized layer of this shape: its own quantization of a real weight."""
    layer = quantize(torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.float16)), Quantization.named(kind))[0]
    tensors = [layer.weight, *state_tensors(torch.nn.Sequential(layer))]
    return sum(t.untyped_storage().nbytes() for t in {id(t.untyped_storage()): t for t in tensors}.values())


LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32000,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
NF4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
       "bnb_4bit_compute_dtype": "bfloat16"}


def llama_2_7b_on_meta(quantization):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in LLAMA_2_7B.items() if k not in ("architectures", "torch_dtype")})
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.float16)
    return lora(quantize(model, quantization) if quantization else model, r=16)


def llama_2_7b_work(quantization):
    """The quantized Llama-2-7B shape with LoRA, one sample of 2048 tokens, AdamW over the adapters, for a bf16 CUDA step."""
    model = llama_2_7b_on_meta(quantization)
    ids = torch.randint(0, 32000, (1, 2048), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, Workload(model=model, optimizer=opt, loss_fn=own_loss, batch=batch, device=torch.device("cuda"), precision="bf16")


def expected_held(model, kind):
    """Parameters as held: each quantized layer as bitsandbytes holds one of its shape, the rest as they are."""
    total, shapes = 0, {}
    for name, m in model.named_modules():
        if type(m).__name__ in ("Linear4bit", "Linear8bitLt"):
            shape = (m.out_features, m.in_features)
            shapes[shape] = shapes.get(shape) or bitsandbytes_bytes(*shape, kind)
            total += shapes[shape]
    quantized = {id(m.weight) for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt")}
    return total + sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in quantized)


@pytest.mark.slow  # bitsandbytes quantizes three 4096-wide layers for the reference; the 32 layers are estimated
def test_llama_2_7b_shape_in_4_bit_holds_what_bitsandbytes_packs_and_plans_otherwise_than_in_16_bit(capsys, monkeypatch, tmp_path):
    model, work = llama_2_7b_work(Quantization.from_config(NF4))
    held, expected = estimator_for(work).parameter_bytes(), expected_held(model, "nf4")
    assert abs(held - expected) <= 0.02 * expected, (held, expected)
    assert 3.4e9 < held < 4.4e9  # 6.5B parameters at about half a byte, 0.26B embedding and head at two
    # From a config.json with its quantization_config, through the command line: the same weights, and another plan
    path = write_config(tmp_path, {**LLAMA_2_7B, "quantization_config": NF4})
    common = ("--target-batch", "32", "--device", "cuda", "--memory-limit", "24GiB", "--precision", "bf16", "--tokens", "2048",
              "--lora", "16", "--lora-modules", "all-linear", "--checkpointing")
    code, four, err = report(capsys, monkeypatch, tmp_path, "--hf-config", path, *common)
    assert code == 0, err
    assert abs(four["memory"]["parameters"] - expected) <= 0.02 * expected
    assert "bitsandbytes nf4, double quantization, compute bfloat16" in four["plan"]["setting"]["quantization"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(LLAMA_2_7B))
    code, sixteen, err = report(capsys, monkeypatch, tmp_path, "--hf-config", str(plain), *common)
    assert code == 0, err
    assert "quantization" not in sixteen["plan"]["setting"]
    assert four["plan"]["micro_batch"] > sixteen["plan"]["micro_batch"] >= 1
    assert sixteen["memory"]["parameters"] > 3 * four["memory"]["parameters"]


def test_other_quantization_methods_are_refused_by_name():
    for method in ("gptq", "awq", "hqq", "torchao"):
        with pytest.raises(ValueError, match=f"quant_method='{method}'.*only bitsandbytes"):
            Quantization.from_config({"quant_method": method, "bits": 4})
    with pytest.raises(ValueError, match="neither load_in_4bit nor load_in_8bit"):
        Quantization.from_config({"quant_method": "bitsandbytes"})
    assert Quantization.from_config({"load_in_8bit": True}).kind == "int8"


def test_a_config_with_gptq_weights_is_refused_on_the_command_line(capsys, monkeypatch, tmp_path):
    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
              "vocab_size": 500, "max_position_embeddings": 256, "quantization_config": {"quant_method": "gptq", "bits": 4}}
    code, _, err = report(capsys, monkeypatch, tmp_path, "--hf-config", write_config(tmp_path, config), "--target-batch", "8",
                          "--device", "cpu", "--memory-limit", "1GiB", "--tokens", "32")
    assert code == 2 and "quant_method='gptq'" in err and "Traceback" not in err


# --- the optimizers ---------------------------------------------------------------------------------------

TRAINER_NAMES = ["adamw_torch_fused", "adamw_torch", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "adafactor",
                 "lion_32bit", "lion_8bit", "sgd"]


@pytest.mark.parametrize("name", TRAINER_NAMES)
def test_each_optimizer_is_estimated_as_its_real_cpu_step_allocates(name):
    model = hf_models.gpt2(layers=2, dim=128)
    batch = text_batch(4, 32)
    opt = make_optimizer(name, model.parameters(), 1e-3)
    work = Workload(model=model, optimizer=opt, loss_fn=own_loss, batch=batch, device=torch.device("cpu"), precision="fp32")
    estimator = Estimator(work)
    real, transient = real_peak(model, lambda ps: make_optimizer(name, ps, 1e-3), own_loss, batch)
    assert abs(estimator.step_transient() - transient) <= max(64 * 1024, 0.02 * transient)
    assert abs(estimator(4) - real) <= max(64 * 1024, 0.02 * real)
    if name == "adamw_torch_fused":
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        assert estimator.step_transient() < largest  # no parameter-sized temporary: one kernel per group
    if "8bit" in name:  # a byte a state value: less than half the 32-bit state
        full = Estimator(Workload(model=model, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=own_loss, batch=batch,
                                  device=torch.device("cpu"), precision="fp32"))
        assert estimator.optimizer_state_bytes() < 0.5 * full.optimizer_state_bytes()


@pytest.mark.parametrize("cls", ["Adam8bit", "AdamW8bit", "PagedAdamW8bit"])
def test_a_bitsandbytes_8_bit_optimizer_made_by_hand_is_estimated_as_its_real_cpu_step_allocates(cls):
    # These classes are always 8-bit and refuse the optim_bits their generic parents take (Transformers' single-GPU
    # page trains BERT-large with bnb.optim.Adam8bit): rebuilding one for the estimate must not pass it.
    model = hf_models.gpt2(layers=2, dim=128)
    batch = text_batch(4, 32)

    def make(params):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
            return getattr(bnb.optim, cls)(params, lr=1e-3)

    estimator = Estimator(Workload(model=model, optimizer=make(model.parameters()), loss_fn=own_loss, batch=batch,
                                   device=torch.device("cpu"), precision="fp32"))
    real, transient = real_peak(model, make, own_loss, batch)
    assert abs(estimator(4) - real) <= max(64 * 1024, 0.02 * real)
    assert abs(estimator.step_transient() - transient) <= max(64 * 1024, 0.02 * transient)


def test_the_optimizer_names_make_the_trainers_own_optimizers():
    from transformers import Trainer, TrainingArguments

    params = [torch.nn.Parameter(torch.zeros(4096, 2))]
    for name in TRAINER_NAMES:
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(output_dir="/nonexistent", optim=name, report_to=[]))
        ours = make_optimizer(name, params, 1e-3)
        assert type(ours) is cls, name
        for key, value in kwargs.items():
            if key in ("lr",):
                continue
            found = getattr(ours.args, key, None) if hasattr(ours, "args") and key in ("optim_bits",) else ours.defaults.get(key, getattr(ours, key, None))
            assert found == value or (isinstance(value, tuple) and tuple(found) == value), (name, key, found, value)
    assert "paged" in describe(make_optimizer("paged_adamw_8bit", params, 1e-3), "cuda")
    assert describe(make_optimizer("adamw_torch", params, 1e-3), "cuda") == "AdamW (torch, foreach)"
    assert describe(make_optimizer("adamw_torch_fused", params, 1e-3), "cuda") == "AdamW (torch, fused)"


@pytest.mark.slow  # the 8B shape with checkpointing, estimated twice
def test_llama_3_8b_full_fine_tune_with_fused_adamw_fits_where_the_foreach_temporary_did_not():
    from test_meta import EIGHTY, llama3_8b, tokens

    model = llama3_8b()
    fused = autotune.plan(model, [tokens()], target_batch=32, optimizer=make_optimizer("adamw_torch_fused", model.parameters(), 1e-5),
                          checkpointing=True, **EIGHTY)
    assert fused.micro_batch >= 1 and dict(fused.setting)["optimizer"] == "AdamW (torch, fused)"
    foreach = make_optimizer("adamw_torch", model.parameters(), 1e-5)
    work = Workload(model=model, optimizer=foreach, loss_fn=autotune.step.default_loss, batch=tokens(), device=torch.device("cuda"),
                    precision="bf16", checkpointing=True)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert estimator_for(work).step_transient() >= params  # the foreach step's copy of the parameters: 14.96 GiB
    with pytest.raises(autotune.NothingFits):
        autotune.plan(model, [tokens()], target_batch=32, optimizer=foreach, checkpointing=True, **EIGHTY)


# --- the weights policy -------------------------------------------------------------------------------------

SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 500,
               "max_position_embeddings": 256, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("master, per_parameter, policy", [
    (True, 16, "fp32 master weights under bf16 autocast"),
    (False, 8, "pure bf16: trained weights and their gradients in bf16"),
], ids=["fp32-master", "pure-bf16"])
def test_the_weights_policy_sets_the_bytes_a_parameter_and_is_said(master, per_parameter, policy, capsys, monkeypatch, tmp_path):
    argv = ["--hf-config", write_config(tmp_path, SMALL_LLAMA), "--target-batch", "8", "--device", "cuda", "--memory-limit", "1GiB",
            "--tokens", "64", "--optimizer", "adamw_torch_fused", *(["--master-weights", "fp32"] if master else ["--precision", "bf16"])]
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv)
    assert code == 0, err
    from transformers import LlamaConfig, LlamaForCausalLM

    count = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**{k: v for k, v in SMALL_LLAMA.items() if k not in ("architectures", "torch_dtype")})).parameters())
    memory = data["memory"]
    held = memory["parameters"] + memory["gradients"] + memory["optimizer_state"]
    assert abs(held - per_parameter * count) <= 512 * 3 * 30  # 512-byte blocks of a CUDA target, per tensor
    assert data["plan"]["setting"]["weights"].startswith(policy) and data["plan"]["precision"] == "bf16"


# --- the attention kernel, the fused loss, packing ----------------------------------------------------------

def llama_shape(attention):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=16, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024,
                         vocab_size=32000, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = attention
    return model


SMALL_GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 500,
                "max_position_embeddings": 256, "sliding_window": 32, "torch_dtype": "bfloat16"}
SMALL_ARGS = ("--target-batch", "8", "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "128", "--no-cache")


def test_a_config_is_built_with_its_models_own_attention_and_a_kernel_it_lacks_is_refused_with_those_it_has(capsys, monkeypatch, tmp_path):
    """Gemma-2 has no SDPA path in Transformers (its scores are soft-capped): left to itself the command line builds it
    with eager attention, as ``from_pretrained`` would, where it used to force SDPA and stop on Transformers' error;
    ``--attention sdpa`` is refused in one line naming the kernels it has, and FlashAttention-2, which it has, plans."""
    assert transformers.Gemma2ForCausalLM._supports_sdpa is False  # what the test is about
    common = ("--hf-config", write_config(tmp_path, SMALL_GEMMA2), *SMALL_ARGS)
    code, default, err = report(capsys, monkeypatch, tmp_path, *common)
    assert code == 0, err
    code, eager, err = report(capsys, monkeypatch, tmp_path, *common, "--attention", "eager")
    assert code == 0, err
    assert default["plan"]["setting"]["attention"] == eager["plan"]["setting"]["attention"] == "eager"
    assert default["plan"]["peak_memory"] == eager["plan"]["peak_memory"]
    code, _, err = report(capsys, monkeypatch, tmp_path, *common, "--attention", "sdpa")
    assert code == 2 and err.count("\n") == 1, err
    assert "Invalid --attention sdpa" in err and "Gemma2ForCausalLM" in err and "give --attention flash_attention_2 or flex_attention or eager" in err
    code, flash, err = report(capsys, monkeypatch, tmp_path, *common, "--attention", "flash_attention_2", "--precision", "bf16")
    assert code == 0, err
    assert flash["plan"]["setting"]["attention"] == "flash_attention_2"
    assert any("attention flash_attention_2: estimated as SDPA's flash kernel" in n for n in flash["plan"]["notes"])


def test_a_config_without_architectures_is_built_as_its_causal_lm_with_its_attention_or_refused_with_a_class_to_name(capsys, monkeypatch, tmp_path):
    """No ``architectures``: the config's causal LM is built (Gemma-2, with its eager attention, the plan of the config
    that names the class); a config with no causal LM (T5) is refused in one line that names a class it has."""
    named = tmp_path / "named"
    named.mkdir()
    code, with_class, err = report(capsys, monkeypatch, named, "--hf-config", write_config(named, SMALL_GEMMA2), *SMALL_ARGS)
    assert code == 0, err
    bare = tmp_path / "bare"
    bare.mkdir()
    unnamed = {k: v for k, v in SMALL_GEMMA2.items() if k != "architectures"}
    code, without, err = report(capsys, monkeypatch, bare, "--hf-config", write_config(bare, unnamed), *SMALL_ARGS)
    assert code == 0, err
    assert without["plan"]["setting"]["model"] == "Gemma2ForCausalLM" and without["plan"]["setting"]["attention"] == "eager"
    assert (without["plan"]["micro_batch"], without["plan"]["peak_memory"]) == (with_class["plan"]["micro_batch"], with_class["plan"]["peak_memory"])
    t5 = tmp_path / "t5"
    t5.mkdir()
    config = {"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "d_kv": 16, "vocab_size": 500}
    code, _, err = report(capsys, monkeypatch, t5, "--hf-config", write_config(t5, config), *SMALL_ARGS)
    assert code == 2 and err.count("\n") == 1, err
    assert 'it names no "architectures" and T5Config has no causal LM' in err and '"architectures": ["T5ForConditionalGeneration"]' in err


def gemma2_shape(attention, layers=4):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(num_hidden_layers=layers, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, vocab_size=4096, max_position_embeddings=4096, sliding_window=4096)
    config._attn_implementation = "eager"  # Gemma-2's own in Transformers (it has no SDPA path)
    with torch.device("meta"):
        model = Gemma2ForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = attention  # as --attention builds it (the estimate stands in for FlashAttention-2)
    return model


def test_an_eager_models_what_if_offers_the_kernel_its_class_has_as_a_model_built_with_it_plans():
    """Eager attention holds each layer's scores. A Gemma-2 shape (eager: its own in Transformers) planned for CUDA in
    bf16 gets a row with FlashAttention-2, which its class has: the micro-batch and bytes of the plan of the same model
    built with it, more than eager's; the command line's flag for it. A model already on SDPA gets no such row."""
    from autotune.cli.render import _flags

    ids = torch.randint(0, 4096, (1, 1024), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}]
    common = dict(target_batch=64, device="cuda", memory_limit="6GiB", verify=False, progress=False)

    def optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    eager = gemma2_shape("eager")
    table = autotune.what_if(eager, loader, optimizer=optimizer(eager), **common)
    rows = [r for r in table.rows if r.attention]
    assert [r.attention for r in rows] == ["flash_attention_2"] and rows[0].changes == 1, str(table)
    flash = gemma2_shape("flash_attention_2")
    built = autotune.plan(flash, loader, optimizer=optimizer(flash), **common)
    own = next(r for r in table.rows if r.changes == 0)
    assert rows[0].micro_batch == built.micro_batch > own.micro_batch >= 1, str(table)
    assert rows[0].per_sample < own.per_sample and rows[0].fixed == pytest.approx(own.fixed, rel=1e-3)
    assert _flags(rows[0], own) == ["--attention flash_attention_2"] and "attention flash_attention_2" in rows[0].describe()
    adapted = lora(gemma2_shape("eager"))  # fp32 adapters over the bf16 base, no autocast: the attention still runs in bf16
    table = autotune.what_if(adapted, loader, optimizer=torch.optim.AdamW([p for p in adapted.parameters() if p.requires_grad],
                                                                          lr=1e-4, fused=True), **common)
    assert [r.attention for r in table.rows if r.attention] == ["flash_attention_2"], str(table)
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        sdpa = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)).to(torch.bfloat16)
    assert sdpa.config._attn_implementation == "sdpa"
    table = autotune.what_if(sdpa, loader, optimizer=optimizer(sdpa), **common)
    assert not any(r.attention for r in table.rows)
    sdpa.config._attn_implementation = "eager"  # a model given eager where its class has SDPA: on the CPU, an SDPA row
    table = autotune.what_if(sdpa, loader, optimizer=optimizer(sdpa), **{**common, "device": "cpu", "memory_limit": "2GiB"})
    assert [r.attention for r in table.rows if r.attention] == ["sdpa"], str(table)


def test_flash_attention_2_plans_as_sdpa_where_sdpa_runs_its_flash_kernel_and_eager_holds_the_scores():
    ids = torch.randint(0, 32000, (1, 1024), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}  # no padding: SDPA runs flash
    plans = {a: autotune.plan(llama_shape(a), [batch], target_batch=64, loss_fn=own_loss, device="cuda", memory_limit="8GiB",
                              precision="bf16", verify=False, progress=False) for a in ("sdpa", "flash_attention_2", "eager")}
    flash, sdpa, eager = plans["flash_attention_2"], plans["sdpa"], plans["eager"]
    assert (flash.micro_batch, flash.peak_memory) == (sdpa.micro_batch, sdpa.peak_memory)
    assert any("attention flash_attention_2: estimated as SDPA's flash kernel" in n for n in flash.notes)
    assert eager.micro_batch < sdpa.micro_batch  # the B x H x L x L scores
    assert dict(flash.setting)["attention"] == "flash_attention_2"


def test_fused_linear_cross_entropy_is_cross_entropy_in_float64():
    from autotune.losses import FusedLinearCrossEntropy

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(1000, 16, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 1000, (300,), generator=g)
    targets[:40] = -100
    fused = FusedLinearCrossEntropy.apply(hidden, weight, targets)
    (3 * fused).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    reference = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets)
    (3 * reference).backward()
    assert torch.allclose(fused, reference, rtol=1e-12, atol=0)
    assert torch.allclose(grads[0], hidden.grad, rtol=1e-10, atol=1e-14) and torch.allclose(grads[1], weight.grad, rtol=1e-10, atol=1e-14)


QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936,
            "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"}


def test_a_fused_cross_entropy_plan_of_qwen2_5_0_5b_holds_no_logits(capsys, monkeypatch, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from autotune.losses import fused_causal_lm_loss

    config = Qwen2Config(**{**{k: v for k, v in QWEN_05B.items() if k not in ("architectures", "torch_dtype")}, "num_hidden_layers": 2})
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, 151936, (1, 1024), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    largest = {}
    for name, loss in (("fused", fused_causal_lm_loss), ("logits", own_loss)):
        work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True), loss_fn=loss, batch=batch,
                        device=torch.device("cuda"), precision="bf16")
        # the largest output of whole rows of logits (not the head's weight or its gradient, held by either loss)
        largest[name] = max(n for out in Estimator(work).trace(1).outputs for _, n in out if n % 151936 == 0 and n != 151936 * 896)
    # all 1024 tokens' logits, against Liger's chunks: 2^ceil(log2(1024 / ceil(151936 / 896))) = 8 tokens' logits at a time
    assert largest["logits"] >= 1024 * 151936 and largest["fused"] == 8 * 151936
    common = ("--hf-config", write_config(tmp_path, QWEN_05B), "--target-batch", "64", "--device", "cuda", "--memory-limit", "24GiB",
              "--tokens", "1024", "--optimizer", "adamw_torch_fused")
    code, fused, err = report(capsys, monkeypatch, tmp_path, *common, "--fused-ce")
    assert code == 0, err
    code, plain, err = report(capsys, monkeypatch, tmp_path, *common)
    assert code == 0, err
    assert fused["plan"]["micro_batch"] > plain["plan"]["micro_batch"]
    assert "fused linear cross-entropy" in fused["plan"]["setting"]["loss"]


def test_a_packed_plan_counts_its_micro_batch_in_tokens(capsys, monkeypatch, tmp_path):
    config = {**SMALL_LLAMA, "num_hidden_layers": 4, "max_position_embeddings": 4096}
    common = ("--hf-config", write_config(tmp_path, config), "--target-batch", "64", "--device", "cuda", "--memory-limit", "2GiB",
              "--tokens", "512", "--precision", "bf16", "--attention", "flash_attention_2")
    code, packed, err = report(capsys, monkeypatch, tmp_path, *common, "--packing")
    assert code == 0, err
    code, rows, err = report(capsys, monkeypatch, tmp_path, *common)
    assert code == 0, err
    micro = packed["plan"]["micro_batch"]
    assert packed["tokens"] == {"per_sample": 512, "per_micro_batch": 512 * micro, "per_step": 512 * 64}
    assert "padding-free packing" in packed["plan"]["setting"]["loss"]
    assert abs(micro - rows["plan"]["micro_batch"]) <= 1  # a varlen kernel over one row holds what it holds over rows
    code, _, err = report(capsys, monkeypatch, tmp_path, *common[:-2], "--packing")
    assert code == 2 and "give --attention flash_attention_2" in err


# --- mixtures of experts ----------------------------------------------------------------------------------


def mixtral(layers=12):
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=500, max_position_embeddings=256))


def qwen2_moe(layers=12):
    torch.manual_seed(0)
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=500, max_position_embeddings=256))


def deepseek_v3_style():
    """DeepSeek-V3's layout at a small size: two dense layers first, then experts (shared and routed, grouped routing)."""
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        num_hidden_layers=12, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=2, n_group=2,
        topk_group=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, vocab_size=500,
        max_position_embeddings=256))


@pytest.mark.parametrize("make", [mixtral, qwen2_moe, deepseek_v3_style], ids=["mixtral", "qwen2-moe", "deepseek-v3-style"])
def test_mixtures_of_experts_estimate_their_real_cpu_step_and_say_the_routing_assumed(make):
    model = make()
    batch = text_batch(4, 32)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-3)  # noqa: E731
    work = Workload(model=model, optimizer=make_opt(model.parameters()), loss_fn=own_loss, batch=batch, device=torch.device("cpu"),
                    precision="fp32")
    real, _ = real_peak(model, make_opt, own_loss, batch)
    kept = estimator_for(work)
    assert Estimator(work)(4) == kept(4) == real
    assert any("every token reaches its experts" in n for n in kept.assumed)
    assert kept.note and ("extended" in kept.note or "traced the whole model" in kept.note)


@pytest.mark.parametrize("make", [mixtral, qwen2_moe], ids=["mixtral", "qwen2-moe"])
def test_mixtures_of_experts_for_cuda_extend_as_the_whole_model_replays(make):
    batch = text_batch(4, 32)

    def work_of(model):
        return Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), fused=True), loss_fn=own_loss, batch=batch,
                        device=torch.device("cuda"), precision="bf16")

    # 12 blocks are too few to extend for a CUDA target (its copies trace 12): the whole model is traced, and that is said
    assert "traced the whole model: the 12 blocks of model.layers are too few to extend" in estimator_for(work_of(make().to(torch.bfloat16))).note
    model = make(layers=16).to(torch.bfloat16)
    work = work_of(model)
    kept, whole = estimator_for(work), Estimator(work)
    assert "extended" in kept.note
    for b in (2, 5):
        a, w = kept.allocator(b), whole.allocator(b)
        assert (a.allocated, a.reserved) == (w.allocated, w.reserved)
    plan = autotune.plan(model, [batch], target_batch=64, loss_fn=own_loss, device="cuda", memory_limit="1GiB", precision="bf16",
                         verify=False, progress=False)
    assert plan.micro_batch >= 4 and any("mixture of experts" in n for n in plan.notes)
    assert re.search(r"top-2", " ".join(plan.notes))


@pytest.mark.slow  # bitsandbytes quantizes three 4096-wide layers in 8 bits for the reference
def test_llama_2_7b_shape_in_8_bit_holds_what_bitsandbytes_packs():
    model, work = llama_2_7b_work(Quantization.from_config({"quant_method": "bitsandbytes", "load_in_8bit": True}))
    held, expected = estimator_for(work).parameter_bytes(), expected_held(model, "int8")
    assert abs(held - expected) <= 0.02 * expected, (held, expected)
    assert 6.6e9 < held < 7.2e9  # 6.5B parameters at a byte (and a scale per row), 0.26B embedding and head at two
    plan = autotune.plan(model, [work.batch], target_batch=32, optimizer=work.optimizer, loss_fn=own_loss, device="cuda",
                         memory_limit="24GiB", precision="bf16", checkpointing=True, verify=False, progress=False)
    assert plan.micro_batch >= 1 and dict(plan.setting)["quantization"].startswith("bitsandbytes int8")
