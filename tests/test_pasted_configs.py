"""Every framework's config in the report, pasted as printed, trains the setting that was planned.

Each setting below is asked of ``autotune report --hf-config`` (a small Llama, estimated for a GPU), and each printed
config is parsed as its framework would read it (the Python snippets with ``ast``, DeepSpeed's with ``json``); what it
holds is compared with what the command asked for: the optimizer (built from the pasted class and keywords, stepped,
and compared with the one the Transformers Trainer builds for the same ``optim`` name), the precision, activation
checkpointing, quantization, adapters and attention kernel, or a comment that says the framework cannot take one.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("lightning")

from autotune.cli.main import main  # noqa: E402

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 500,
         "max_position_embeddings": 256}
TARGET, BASE = 8, 32
COMMON = ("--target-batch", str(TARGET), "--base-batch", str(BASE), "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64")
TITLES = {"lightning": "PyTorch Lightning", "accelerate": "Accelerate", "hf": "Transformers TrainingArguments",
          "deepspeed": "DeepSpeed config", "keras": "Keras 3"}

# What each setting asks for: the config's dtype, the flags, and what a pasted config must hold.
SETTINGS = {
    "fp32 adamw": dict(dtype="float32", flags=["--optimizer", "adamw_torch", "--lr", "1e-3"],
                       optim="adamw_torch", precision=None, checkpointing=False, weights="float32"),
    "bf16 checkpointing paged 8-bit": dict(dtype="bfloat16", flags=["--optimizer", "paged_adamw_8bit", "--checkpointing", "--precision", "bf16",
                                                                    "--lr", "2e-4"],
                                           optim="paged_adamw_8bit", precision="bf16", checkpointing=True, weights="bfloat16"),
    "qlora nf4": dict(dtype="bfloat16", flags=["--quantize", "nf4", "--lora", "16", "--optimizer", "paged_adamw_8bit", "--lr", "2e-4"],
                      optim="paged_adamw_8bit", precision=None, checkpointing=False, weights="bfloat16", quantize="nf4", lora=16),
    "fp16 fused adamw": dict(dtype="float32", flags=["--optimizer", "adamw_torch_fused", "--precision", "fp16", "--lr", "1e-3"],
                             optim="adamw_torch_fused", precision="fp16", checkpointing=False, weights="float32"),
}


def report(capsys, monkeypatch, tmp_path, setting, *more):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "torch_dtype": setting["dtype"]}))
    code = main(["report", "--hf-config", str(path), *COMMON, *setting["flags"], "--no-cache", *more])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def sections(text):
    """Each framework's config in the text report, as printed there (indented by two spaces), unindented."""
    lines = text.splitlines()
    found = {}
    for name, title in TITLES.items():
        start = lines.index(f"{title} (--format {name})") + 1
        end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
        found[name] = "\n".join(line[2:] for line in lines[start:end])
    return found


def dotted(node):
    """``a.b.c`` of an attribute chain, or None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def value(node, names=None):
    """A keyword's value as Python reads it: a literal, ``torch.<dtype>``, or a name (``lr``) looked up in ``names``."""
    name = dotted(node)
    if name is not None and name.startswith("torch."):
        return getattr(torch, name.split(".", 1)[1])
    if isinstance(node, ast.Name):
        return (names or {})[node.id]
    return ast.literal_eval(node)


def calls(code):
    """Every call of the snippet: (the called name, its keywords as nodes, its positional nodes)."""
    tree = ast.parse(code)
    return [(dotted(n.func), {k.arg: k.value for k in n.keywords}, n.args) for n in ast.walk(tree) if isinstance(n, ast.Call)]


def call(code, suffix):
    """The one call of the snippet whose name ends with ``suffix``."""
    found = [c for c in calls(code) if c[0] and c[0].endswith(suffix)]
    assert len(found) == 1, (suffix, code)
    return found[0]


def resolve(name):
    """The object a dotted import path names (``bitsandbytes.optim.PagedAdamW8bit``)."""
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def trainer_optimizer(optim, lr):
    """The optimizer class and keywords the Transformers Trainer builds for ``optim`` (its own defaults)."""
    args = transformers.TrainingArguments(output_dir="/nonexistent", optim=optim, learning_rate=lr, report_to=[])
    return transformers.Trainer.get_optimizer_cls_and_kwargs(args)


def stepped(make):
    """A parameter after two steps of the optimizer ``make`` builds over it, from fixed gradients."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 128, generator=g))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")  # paging is CUDA's
        optimizer = make([p])
        for _ in range(2):
            p.grad = torch.randn(64, 128, generator=g)
            optimizer.step()
    return p.detach(), optimizer


def check_optimizer(code, setting, lr):
    """The snippet's ``optimizer = <class>(params, lr=..., ...)`` is the optimizer the Trainer makes for the asked ``optim``
    name: the same class and state, the same parameters after two steps."""
    (assign,) = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assign) and dotted(n.targets[0]) == "optimizer"]
    cls = resolve(dotted(assign.value.func))
    kwargs = {k.arg: value(k.value, {"lr": lr}) for k in assign.value.keywords}
    assert kwargs["lr"] == pytest.approx(lr, rel=1e-5)
    ours, optimizer = stepped(lambda ps: cls(ps, **kwargs))
    ref_cls, ref_kwargs = trainer_optimizer(setting["optim"], kwargs["lr"])
    theirs, reference = stepped(lambda ps: ref_cls(ps, weight_decay=0.0, **ref_kwargs))  # the Trainer's weight decay, 0
    assert torch.equal(ours, theirs), (cls, kwargs, ref_cls, ref_kwargs)
    (state,), (ref_state,) = optimizer.state.values(), reference.state.values()
    assert {k: v.dtype for k, v in state.items() if torch.is_tensor(v)} == {k: v.dtype for k, v in ref_state.items() if torch.is_tensor(v)}
    if "8bit" in setting["optim"]:
        assert state["state1"].dtype == torch.uint8 and "bitsandbytes" in cls.__module__
    if "paged" in setting["optim"]:
        assert optimizer.is_paged
    if setting["optim"] == "adamw_torch_fused":
        assert optimizer.param_groups[0]["fused"] is True
    trained = "[p for p in model.parameters() if p.requires_grad]" if setting.get("lora") else "model.parameters()"
    assert ast.unparse(assign.value.args[0]) == ast.unparse(ast.parse(trained).body[0].value)


def check_model(code, setting, *, checkpointing_here):
    """The snippet builds the planned model: its dtype, attention kernel, quantization and adapters, and activation
    checkpointing where the framework does not turn it on itself."""
    name, kwargs, args = call(code, ".from_pretrained")
    assert name == "transformers.LlamaForCausalLM.from_pretrained"
    assert value(kwargs.get("dtype") or kwargs["torch_dtype"]) == getattr(torch, setting["weights"])
    assert value(kwargs["attn_implementation"]) == "sdpa"  # the command's default kernel
    if setting.get("quantize"):
        assert dotted(kwargs["quantization_config"]) == "bnb_config"
        _, bnb, _ = call(code, "BitsAndBytesConfig")
        config = transformers.BitsAndBytesConfig(**{k: value(v) for k, v in bnb.items()})
        assert config.load_in_4bit and not config.load_in_8bit and config.bnb_4bit_quant_type == setting["quantize"]
        assert config.bnb_4bit_use_double_quant and config.bnb_4bit_compute_dtype == torch.bfloat16
    else:
        assert "quantization_config" not in kwargs and "BitsAndBytesConfig" not in code
    if setting.get("lora"):
        _, lora, _ = call(code, "LoraConfig")
        config = peft.LoraConfig(**{k: value(v) for k, v in lora.items()})
        assert config.r == setting["lora"] and set(config.target_modules) == {"q_proj", "v_proj"}  # PEFT's default for Llama
        assert call(code, "get_peft_model")[0] == "peft.get_peft_model"
    else:
        assert "LoraConfig" not in code
    enables = [c for c in calls(code) if c[0] and c[0].endswith("checkpointing_enable")]
    assert len(enables) == (1 if setting["checkpointing"] and checkpointing_here else 0), code
    for name, kwargs, _ in enables:
        assert hasattr(transformers.LlamaForCausalLM, name.split(".")[-1])
        assert value(next(iter(kwargs.values()))) == {"use_reentrant": False}


def expected_lr(setting):
    given = float(setting["flags"][setting["flags"].index("--lr") + 1])
    return given * math.sqrt(TARGET / BASE)  # the Adam family's square-root rule, from --base-batch to --target-batch


@pytest.mark.parametrize("name", list(SETTINGS))
def test_every_pasted_config_carries_the_setting(name, capsys, monkeypatch, tmp_path):
    setting = SETTINGS[name]
    out, _ = report(capsys, monkeypatch, tmp_path, setting)
    configs = sections(out)
    lr = expected_lr(setting)
    mixed = setting["precision"]

    # Transformers: the TrainingArguments, built as pasted
    hf = configs["hf"]
    _, fields, _ = call(hf, "TrainingArguments")
    kwargs = {k: value(v) for k, v in fields.items()}
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == TARGET
    assert kwargs["optim"] == setting["optim"] and kwargs["learning_rate"] == pytest.approx(lr, rel=1e-5)
    assert kwargs.get("bf16", False) is (mixed == "bf16") and kwargs.get("fp16", False) is (mixed == "fp16")
    assert kwargs.get("gradient_checkpointing", kwargs.get("activation_checkpointing", False)) is setting["checkpointing"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated field would warn where pasted
        args = transformers.TrainingArguments(**kwargs, output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    assert args.optim == setting["optim"] and args.bf16 is (mixed == "bf16") and args.fp16 is (mixed == "fp16")
    assert bool(args.gradient_checkpointing) is setting["checkpointing"]
    assert args.weight_decay == 0.0 and (args.adam_beta1, args.adam_beta2, args.adam_epsilon) == (0.9, 0.999, 1e-8)
    check_model(hf, setting, checkpointing_here=False)  # the Trainer turns it on from its arguments

    # Accelerate: its precision, the model, the optimizer's class
    accelerate = configs["accelerate"]
    _, acc, _ = call(accelerate, "Accelerator")
    assert value(acc["mixed_precision"]) == (mixed or "no")
    _, loader, _ = call(accelerate, "DataLoader")
    assert value(acc["gradient_accumulation_steps"]) * value(loader["batch_size"]) == TARGET
    check_model(accelerate, setting, checkpointing_here=True)
    check_optimizer(accelerate, setting, lr)

    # Lightning: the Trainer's precision (built as pasted), the model, the optimizer
    lightning_code = configs["lightning"]
    _, trainer, _ = call(lightning_code, "lightning.Trainer")
    precision = value(trainer["precision"])
    pure_low = setting["weights"] != "float32" and mixed is None
    assert precision == {"bf16": "bf16-mixed", "fp16": "16-mixed", None: "32-true"}[mixed]
    if pure_low:  # the model keeps the dtype it is loaded in: Lightning's -true precisions would cast the quantized base too
        assert "the model keeps the dtypes it was built with" in lightning_code
    import lightning

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*AMP with fp16 is not supported on CPU")  # built here on the CPU, to be read
        built = lightning.Trainer(precision=precision, accumulate_grad_batches=value(trainer["accumulate_grad_batches"]), accelerator="cpu",
                                  devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert built.accumulate_grad_batches * value(call(lightning_code, "DataLoader")[1]["batch_size"]) == TARGET
    check_model(lightning_code, setting, checkpointing_here=True)
    check_optimizer(lightning_code, setting, lr)

    # DeepSpeed: the JSON (the comment lines above it said apart)
    lines = configs["deepspeed"].splitlines()
    comments = [line for line in lines if line.startswith("#")]
    ds = json.loads("\n".join(line for line in lines if not line.startswith("#")))
    assert ds["train_batch_size"] == TARGET and ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] == TARGET
    low = mixed or ("bf16" if setting["weights"] == "bfloat16" else None)
    assert ds.get("bf16", {}).get("enabled", False) is (low == "bf16") and ds.get("fp16", {}).get("enabled", False) is (low == "fp16")
    if "8bit" in setting["optim"]:
        assert "optimizer" not in ds
        assert any("cannot hold the planned optimizer bitsandbytes.optim.PagedAdamW8bit" in c for c in comments), comments
    else:
        assert ds["optimizer"]["type"] == "AdamW"
        assert ds["optimizer"]["params"]["lr"] == pytest.approx(lr, rel=1e-5) and ds["optimizer"]["params"]["weight_decay"] == 0.0
    assert any("activation checkpointing is the model's" in c for c in comments) is setting["checkpointing"]
    if setting.get("quantize"):
        assert any("the quantized base, the LoRA adapters" in c for c in comments), comments

    # Keras: what it can take, and a comment for what it cannot
    keras_code = configs["keras"]
    keras_calls = {c[0]: c[1] for c in calls(keras_code)}
    policies = [value(c[2][0]) for c in calls(keras_code) if c[0] == "keras.mixed_precision.set_global_policy"]
    wanted = {"bf16": "mixed_bfloat16", "fp16": "mixed_float16"}.get(mixed) or {"bfloat16": "bfloat16"}.get(setting["weights"])
    assert policies == ([wanted] if wanted else [])
    (optimizer_name, optimizer_args), = [(n, k) for n, k in keras_calls.items() if n.startswith("keras.optimizers.")]
    assert optimizer_name == "keras.optimizers.AdamW"
    assert value(optimizer_args["weight_decay"]) == 0.0 and value(optimizer_args["epsilon"]) == 1e-8
    assert value(optimizer_args["gradient_accumulation_steps"]) * value(keras_calls["model.fit"]["batch_size"]) == TARGET
    if "8bit" in setting["optim"]:
        assert "# Keras has no bitsandbytes.optim.PagedAdamW8bit" in keras_code
    unsaid = next((line for line in keras_code.splitlines() if line.startswith("# planned but not set here")), "")
    assert ("activation checkpointing" in unsaid) is setting["checkpointing"]
    assert ("quantization" in unsaid and "LoRA adapters" in unsaid) is bool(setting.get("quantize"))
    assert "attention sdpa" in unsaid


def test_format_deepspeed_prints_a_json_file_and_says_what_it_cannot_hold_on_stderr(capsys, monkeypatch, tmp_path):
    out, err = report(capsys, monkeypatch, tmp_path, SETTINGS["bf16 checkpointing paged 8-bit"], "--format", "deepspeed")
    ds = json.loads(out)  # the whole of stdout
    assert ds["bf16"] == {"enabled": True} and "optimizer" not in ds
    assert "DeepSpeed's JSON cannot hold the planned optimizer bitsandbytes.optim.PagedAdamW8bit" in err
    assert 'TrainingArguments(optim="paged_adamw_8bit", deepspeed=<this config>)' in err
    assert "activation checkpointing is the model's" in err


def test_an_optimizer_the_trainer_has_no_name_for_is_passed_to_it(capsys, monkeypatch, tmp_path):
    setting = {"dtype": "float32", "flags": ["--optimizer", "adam", "--lr", "1e-3"]}
    out, _ = report(capsys, monkeypatch, tmp_path, setting, "--format", "hf")
    assert "# the Trainer has no optim name for torch.optim.Adam: pass Trainer(..., optimizers=(optimizer, None)) with" in out
    _, fields, _ = call(out, "TrainingArguments")
    assert "optim" not in fields
    name, kwargs, _ = call(out, "torch.optim.Adam")
    assert value(kwargs["weight_decay"]) == 0.0  # the planned optimizer's (the Trainer's settings), not torch's default


def test_a_plan_read_back_from_json_or_the_cache_gives_the_same_configs(capsys, monkeypatch, tmp_path):
    import autotune
    from autotune.planning.report import framework_configs

    setting = SETTINGS["qlora nf4"]
    data = json.loads(report(capsys, monkeypatch, tmp_path, setting, "--json")[0])
    recipe = data["plan"]["recipe"]
    assert recipe["optim"] == "paged_adamw_8bit" and recipe["optimizer_class"] == "bitsandbytes.optim.PagedAdamW8bit"
    assert dict(recipe["lora"])["r"] == 16 and dict(recipe["quantization"])["bnb_4bit_quant_type"] == "nf4"
    plan = autotune.Plan.from_dict(json.loads(json.dumps(data["plan"])))
    assert plan.recipe.lora == (("r", 16), ("lora_alpha", 8), ("lora_dropout", 0.0), ("target_modules", ("q_proj", "v_proj")))
    printed = sections(report(capsys, monkeypatch, tmp_path, setting)[0])
    configs = framework_configs(plan)
    assert {name: configs[name] for name in ("hf", "accelerate", "lightning", "keras")} == {
        name: printed[name] for name in ("hf", "accelerate", "lightning", "keras")}

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "shared-cache"))
    path = tmp_path / "config.json"
    for _ in range(2):  # the second answer comes from the cache
        assert main(["report", "--hf-config", str(path), *COMMON, *setting["flags"]]) == 0
        out, _ = capsys.readouterr()
    assert out.startswith("(answered from the cache")
    assert sections(out) == printed
