"""The fine-tuning settings' inputs: quantization, the fused loss, a CUDA estimate's limit, what the answer offers.

Every bad input is refused before anything changes (the model's state dict compared bitwise, its layers' types
too), naming the value and the fix; the answer's setting says what a quantized model without adapters trains; a
row that cannot fit is never offered.
"""

import json
import warnings

import pytest
import torch
from torch import nn

import autotune
from autotune.cli.main import main
from autotune.memory.quantized import Quantization, quantize

bnb = pytest.importorskip("bitsandbytes")


def snapshot(model):
    """The model as it is: every tensor of its state dict (cloned, compared bitwise later) and its modules' types."""
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, [type(m) for m in model.modules()])


def same(model, before):
    tensors, types = before
    now = model.state_dict()
    return (set(now) == set(tensors) and all(now[k].dtype == v.dtype and torch.equal(now[k], v) for k, v in tensors.items())
            and [type(m) for m in model.modules()] == types)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def quantized(kind):
    model = mlp()
    quantize(model, kind)
    return model


# (id, the model, the call, the error, what its message must say: the value and the fix)
QUANTIZE = [
    ("quantize(model, 4)", mlp, lambda m: quantize(m, 4), TypeError, r"Invalid quantization 4 \(int\): give 'nf4', 'fp4' or 'int8'"),
    ("quantize(model, None)", mlp, lambda m: quantize(m, None), TypeError, r"Invalid quantization None \(NoneType\): give 'nf4', 'fp4' or 'int8'"),
    ("quantize(model, 'int4')", mlp, lambda m: quantize(m, "int4"), ValueError, r"Invalid quantization 'int4': use one of nf4, fp4, int8"),
    ("quantize(model, {'kind': 'nf4'})", mlp, lambda m: quantize(m, {"kind": "nf4"}), TypeError,
     r"Invalid quantization \{'kind': 'nf4'\} \(dict\): give 'nf4', 'fp4' or 'int8', or an autotune.memory.quantized.Quantization"),
    ("quantize(model, Quantization(4))", mlp, lambda m: quantize(m, Quantization(4)), TypeError, r"Invalid quantization 4 \(int\)"),
    ("an nf4 model quantized to int8", lambda: quantized("nf4"), lambda m: quantize(m, "int8"), ValueError,
     r"Invalid quantization 'int8' for Sequential: its linear layers are quantized already \(bitsandbytes nf4.*quantize the "
     r"unquantized model \(built or loaded again\) with 'int8', or keep nf4"),
    ("an int8 model quantized to fp4", lambda: quantized("int8"), lambda m: quantize(m, "fp4"), ValueError,
     r"Invalid quantization 'fp4' for Sequential: its linear layers are quantized already \(bitsandbytes int8.*or keep int8"),
    ("a model with no linear layer", lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), lambda m: quantize(m, "nf4"), ValueError,
     r"Invalid model Sequential for quantize: it has no linear layer \(torch.nn.Linear, or Transformers' Conv1D\), the only "
     r"layers quantize replaces .*give a model with linear layers, or plan this one unquantized"),
    ("a model whose linear layers are all skipped", mlp, lambda m: quantize(m, Quantization("nf4", skip=("0", "2"))), ValueError,
     r"Invalid quantization for Sequential: its linear layers \(0, 2\) are all skipped \(the output head, quantization.skip\), so "
     r"nothing would change; skip fewer, or plan it unquantized"),
    ("compute_dtype='bfloat'", mlp, lambda m: quantize(m, Quantization("nf4", compute_dtype="bfloat")), ValueError,
     r"Invalid compute_dtype 'bfloat': give torch.bfloat16, torch.float16 or torch.float32 \(or the names 'bfloat16', 'bf16'"),
    ("compute_dtype=torch.int8", mlp, lambda m: quantize(m, Quantization.named("nf4", compute_dtype=torch.int8)), ValueError,
     r"Invalid compute_dtype torch.int8: not a floating-point dtype; give torch.bfloat16"),
    ("compute_dtype=16", mlp, lambda m: quantize(m, Quantization("fp4", compute_dtype=16)), TypeError,
     r"Invalid compute_dtype 16 \(int\): give torch.bfloat16"),
    ("skip='lm_head'", mlp, lambda m: quantize(m, Quantization("nf4", skip="lm_head")), TypeError,
     r"Invalid skip 'lm_head': give the names of the linear layers to leave unquantized, e.g. \('lm_head',\)"),
    ("double_quant='yes'", mlp, lambda m: quantize(m, Quantization("nf4", double_quant="yes")), TypeError,
     r"Invalid double_quant 'yes' \(str\): give True or False"),
    ("threshold=-1", mlp, lambda m: quantize(m, Quantization("int8", threshold=-1)), ValueError,
     r"Invalid threshold -1: give LLM.int8\(\)'s outlier threshold, a number >= 0 \(6.0 by default"),
    ("quantize('model', 'nf4')", lambda: None, lambda m: quantize("model", "nf4"), TypeError,
     r"Invalid model of type str: give the torch.nn.Module whose linear layers to quantize"),
]


@pytest.mark.parametrize("what, build, call, error, match", QUANTIZE, ids=[c[0] for c in QUANTIZE])
def test_a_bad_quantize_argument_is_refused_naming_it_and_changes_nothing(what, build, call, error, match):
    model = build() or mlp()
    before = snapshot(model)
    with pytest.raises(error, match=match):
        call(model)
    assert same(model, before), f"{what}: the model changed before the error"


def test_a_layer_built_with_bitsandbytes_default_threshold_is_read_back():
    # bitsandbytes' own Linear8bitLt defaults to threshold 0.0 (no outlier decomposition): a setting, not an error.
    from autotune.memory.quantized import quantization_of

    model = quantize(mlp(), Quantization("int8", threshold=0.0))
    assert quantization_of(model) == Quantization("int8", threshold=0.0)


def test_the_docs_table_lists_every_case():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text().split("## Fine-tuning settings", 1)[1]
    for what, *_ in QUANTIZE:
        assert what in text, what


def test_a_model_quantized_in_the_same_scheme_again_is_left_as_it_is():
    model = quantized("nf4")
    before = snapshot(model)
    assert quantize(model, "nf4") is model
    assert same(model, before)


@pytest.mark.parametrize("name, dtype", [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("torch.float16", torch.float16),
                                         ("fp32", torch.float32), (torch.bfloat16, torch.bfloat16), (None, None)])
def test_the_usual_spellings_of_a_compute_dtype_are_accepted(name, dtype):
    assert Quantization("nf4", compute_dtype=name).compute_dtype is dtype
    layer = quantize(mlp(), Quantization.named("nf4", compute_dtype=name))[0]
    assert layer.compute_dtype is dtype


def test_quantize_has_one_public_spelling():
    import autotune.memory.quantized

    assert "quantize" in autotune.__all__
    assert autotune.quantize is autotune.memory.quantized.quantize
    model = autotune.quantize(mlp(), "nf4")  # the docstring's example, as printed
    assert [type(m).__name__ for m in model] == ["Linear4bit", "ReLU", "Linear4bit"]


def test_gpt2s_conv1d_layers_are_quantized_transposed_as_transformers_quantizes_them():
    from hf_models import gpt2

    model = gpt2()
    conv = model.transformer.h[0].attn.c_attn  # Conv1D: x @ weight + bias, its weight in x out (64 x 192)
    x = torch.randn(3, 64)
    reference = torch.addmm(conv.bias, x, conv.weight).detach()
    quantize(model, "int8")
    layer = model.transformer.h[0].attn.c_attn
    assert type(layer) is bnb.nn.Linear8bitLt and (layer.in_features, layer.out_features) == (64, 192)
    assert ((layer(x) - reference).abs().max() / reference.abs().max()).item() < 0.02  # int8's rounding, not a transposed weight
    assert type(model.lm_head) is nn.Linear  # the output head left as it is


# --- a quantization_config Transformers refuses -----------------------------------------------------------------------


def test_a_quantization_config_with_both_load_in_flags_is_refused_as_transformers_refuses_it():
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError):  # the reference: Transformers itself
        BitsAndBytesConfig(load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ValueError, match=r"Invalid quantization_config: it asks for both load_in_4bit and load_in_8bit, which "
                                         r"Transformers refuses .*; set one of them to false"):
        Quantization.from_config({"load_in_4bit": True, "load_in_8bit": True, "bnb_4bit_quant_type": "nf4"})


def test_a_config_with_both_load_in_flags_is_refused_on_the_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = {**TINY, "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": True}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(["report", "--hf-config", str(tmp_path / "config.json"), "--memory-limit", "1GiB", "--target-batch", "8", "--tokens", "16"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "both load_in_4bit and load_in_8bit" in err and "set one of them to false" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_quantize_on_the_command_line_for_a_model_with_nothing_to_quantize(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "convs.py").write_text("from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())\n")
    code = main(["report", f"{tmp_path / 'convs.py'}:build", "--input-shape", "3,8,8", "--target-batch", "8", "--quantize", "nf4",
                 "--memory-limit", "1GiB", "--regression"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--quantize nf4: Invalid model Sequential for quantize: it has no linear layer" in err and "plan this one unquantized" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- the fused loss ---------------------------------------------------------------------------------------------------


def llama():
    from hf_models import llama as build

    return build(layers=1, dim=32, vocab=50, heads=2, kv_heads=1, mlp=64)


def test_the_fused_loss_refuses_labels_of_another_shape_before_the_model_runs():
    from autotune.losses import fused_causal_lm_loss

    model = llama()
    ran = []
    model.get_decoder().register_forward_pre_hook(lambda module, args: ran.append(1))
    ids = torch.randint(0, 50, (2, 8))
    fused_causal_lm_loss(model, {"input_ids": ids, "labels": ids}).backward()  # the control: right shapes run the decoder
    assert ran == [1]
    model.zero_grad(set_to_none=True)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Invalid labels of shape \(2, 7\) for input_ids of shape \(2, 8\): the loss takes one "
                                         r"label per token .*give labels shaped like input_ids, -100 where no loss"):
        fused_causal_lm_loss(model, {"input_ids": ids, "labels": ids[:, 1:]})
    with pytest.raises(TypeError, match=r"Invalid labels of dtype torch.float32: give token ids \(torch.long\)"):
        fused_causal_lm_loss(model, {"input_ids": ids, "labels": ids.float()})
    assert ran == [1] and same(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_the_fused_function_refuses_targets_that_are_not_one_per_token():
    from autotune.losses import FusedLinearCrossEntropy

    hidden, weight = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"Invalid targets of shape \(2, 3\) for hidden states of shape \(6, 4\): give one target "
                                         r"per token, a 1-d tensor of 6 token ids .*\.reshape\(-1\)"):
        FusedLinearCrossEntropy.apply(hidden, weight, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Invalid shapes: hidden \(6, 4\) and weight \(10, 5\)"):
        FusedLinearCrossEntropy.apply(hidden, torch.randn(10, 5), torch.zeros(6, dtype=torch.long))


# --- the setting of a quantized model without adapters ---------------------------------------------------------------


def test_the_setting_of_a_quantized_model_without_adapters_says_the_quantized_layers_are_frozen_and_what_trains():
    from autotune.planning.setting import describe

    model = quantize(llama(), "nf4")
    setting = dict(describe(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), device=torch.device("cpu"),
                            precision="fp32", checkpointing=False))
    # By hand: the embedding and the untied head (50 x 32 each) and the norms (two per layer and the last, 32 each) train.
    trained = 50 * 32 * 2 + 3 * 32
    assert setting["quantization"].startswith("bitsandbytes nf4, double quantization, compute bfloat16; ")
    assert (f"the quantized layers' weights frozen (no adapters): what trains is the rest, {trained:,} parameters in embed_tokens, "
            "input_layernorm, post_attention_layernorm, norm, lm_head") in setting["quantization"]
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trained


@pytest.mark.parametrize("kind, start", [("nf4", "bitsandbytes nf4, double quantization, compute bfloat16"),
                                         ("int8", "bitsandbytes int8 (LLM.int8(), outlier threshold 6)")])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_setting_of_qlora_says_no_more_than_the_quantization(kind, start, device):
    """On the meta device (a model built from a config) an int8 layer's weight stays unquantized until the estimate's
    copy quantizes it: it was said to be "left unquantized", every linear layer of the model with it."""
    peft = pytest.importorskip("peft")
    from autotune.planning.setting import describe

    with torch.device(device):
        base = llama()
    with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(quantize(base, kind), peft.LoraConfig(r=4, target_modules="all-linear"))
    setting = dict(describe(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]), device=torch.device("cpu"),
                            precision="fp32", checkpointing=False))
    quantization = setting["quantization"]  # with adapters, nothing of what a base without them trains
    assert quantization.startswith(start) and "what trains" not in quantization
    # what bitsandbytes left as it was (the embeddings, the head, the norms) is said, with its bytes
    base = llama()  # by hand: every weight but the decoder's linear layers (the head is left as it is)
    kept = sum(p.numel() for n, p in base.named_parameters() if not any(k in n for k in ("_proj.",)))
    assert f"left unquantized: {kept:,} parameters" in quantization and "embed_tokens" in quantization
    assert setting["adapters"].startswith("LoRA rank 4")


# --- a CUDA estimate's limit below what is set aside --------------------------------------------------------------------


@pytest.fixture
def measured_context(monkeypatch):
    """The CUDA context's measured allowance (no variable choosing another)."""
    monkeypatch.delenv("AUTOTUNE_CUDA_CONTEXT", raising=False)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)


def test_a_cuda_estimate_below_the_context_is_refused_before_any_trace(measured_context):
    model = mlp()
    ran = []
    model.register_forward_pre_hook(lambda module, args: ran.append(1))  # copies made for an estimate keep the hook
    batches = [(torch.randn(4, 64), torch.randn(4, 64))] * 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = dict(target_batch=8, optimizer=optimizer, loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), device="cuda",
              verify=False, progress=False)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"Invalid memory_limit 1.00 KiB for a CUDA estimate: it is not above the 781.00 MiB set "
                                         r"aside for the CUDA context .*give the device's memory, e.g. memory_limit='80GiB'"):
        autotune.plan(model, batches, memory_limit="1KiB", **kw)
    with pytest.raises(ValueError, match=r"Invalid memory_limit 781.00 MiB for a CUDA estimate"):  # at the allowance: none left
        autotune.plan(model, batches, memory_limit=781 * 2**20, **kw)
    assert ran == [] and same(model, before)
    autotune.plan(model, batches, memory_limit="1GiB", **kw)  # the control: a limit above it is estimated (the hook runs)
    assert ran


def test_a_cuda_estimate_below_the_context_is_refused_on_the_command_line(measured_context, tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda runs on it")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = main(["report", "--demo", "--device", "cuda", "--memory-limit", "1KiB"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("Invalid --memory-limit 1KiB for a CUDA estimate: it is not above the 781.00 MiB set aside for the CUDA context" in err
            and "give the device's memory, e.g. --memory-limit 80GiB (or set a smaller context with --cuda-context)" in err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "cache").exists()  # refused before any plan was made (or cached)


# --- a row that cannot fit is never offered --------------------------------------------------------------------------

# A Llama of 210,240 parameters (by hand: embedding and head 1000 x 64 each, per layer q, k, v, o 64 x 64, the MLP
# three 64 x 128, two norms of 64; the last norm 64).
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512, "dtype": "bfloat16"}
TINY_PARAMETERS = 2 * 1000 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def nothing_fits_at(limit, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    code = main(["report", "--hf-config", str(tmp_path / "config.json"), "--master-weights", "fp32", "--memory-limit", limit,
                 "--target-batch", "8", "--tokens", "64"])
    err = capsys.readouterr().err
    assert code == 1, err
    return err.strip().splitlines()[-1] if "what would fit" not in err else err


def test_shorter_samples_are_not_offered_when_the_held_state_alone_passes_the_budget(tmp_path, monkeypatch, capsys):
    # fp32 master weights with AdamW: weights, gradients and two states, 16 bytes a parameter, whatever the sample's length.
    held = 16 * TINY_PARAMETERS
    budget = int(2 * 2**20 * 0.95)  # --memory-limit 2MiB less the CPU's 5% headroom
    assert held > budget
    err = nothing_fits_at("2MiB", tmp_path, monkeypatch, capsys)
    assert "--tokens max" not in err and "shorter samples than 64 tokens (--tokens max" not in err
    assert "the weights, gradients and optimizer state alone exceed the budget, so shorter samples than 64 tokens cannot fit either" in err


def test_shorter_samples_are_offered_when_the_held_state_leaves_room(tmp_path, monkeypatch, capsys):
    # The control: at 4MiB the held state (3.21 MiB) is within the budget (3.80 MiB), and shorter samples could fit.
    assert 16 * TINY_PARAMETERS < int(4 * 2**20 * 0.95)
    err = nothing_fits_at("4MiB", tmp_path, monkeypatch, capsys)
    assert "--tokens max" in err
