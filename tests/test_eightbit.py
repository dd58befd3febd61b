"""8-bit optimizer states counted at 8-bit size wherever they are estimated: one device, the depth extension (a
stack cut to a few blocks, then extended), the what-if rows made from another optimizer's traces, FSDP2's shards.

The reference is bitsandbytes' rule, by hand from the parameters' shapes: a tensor of ``n >= 4096`` values holds two
``uint8`` states and a ``float32`` absmax per 256 values (``2n + 8 ceil(n / 256)`` bytes), a smaller one two
``float32`` states (``8n``), and the two quantile maps (256 ``float32`` each) are shared by every tensor."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

QUANTILE_MAPS = 2 * 256 * 4


def eight_bit_state(shapes: list[tuple[int, ...]]) -> int:
    """Bytes of bitsandbytes' 8-bit AdamW state for parameters of ``shapes``, by hand (see the module docstring)."""
    sizes = [math.prod(s) for s in shapes]
    return sum(2 * n + 8 * -(-n // 256) if n >= 4096 else 8 * n for n in sizes) + (QUANTILE_MAPS if any(n >= 4096 for n in sizes) else 0)


def llama_shapes(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int) -> list[tuple[int, ...]]:
    """Every parameter's shape of a Llama causal LM (untied embeddings), by hand."""
    kv = hidden // heads * kv_heads
    block = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
             (intermediate, hidden), (intermediate, hidden), (hidden, intermediate), (hidden,), (hidden,)]
    return [(vocab, hidden), *block * layers, (hidden,), (vocab, hidden)]


def lora_shapes(*, hidden: int, layers: int, heads: int, kv_heads: int, rank: int) -> list[tuple[int, ...]]:
    """The shapes of LoRA's A and B on q_proj, k_proj, v_proj and o_proj of a Llama, by hand."""
    kv = hidden // heads * kv_heads
    return [(rank, hidden), (hidden, rank), (rank, hidden), (kv, rank), (rank, hidden), (kv, rank), (rank, hidden), (hidden, rank)] * layers


TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_hidden_layers": 12, "num_key_value_heads": 2, "vocab_size": 500,
        "max_position_embeddings": 256, "torch_dtype": "float32", "tie_word_embeddings": False}
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
LLAMA_3_70B = {**LLAMA_3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80}


def shapes_of(config: dict) -> list[tuple[int, ...]]:
    return llama_shapes(hidden=config["hidden_size"], intermediate=config["intermediate_size"], layers=config["num_hidden_layers"],
                        heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"], vocab=config["vocab_size"])


def report(capsys, monkeypatch, tmp_path, config: dict, *argv: str) -> tuple[int, dict, str]:
    """``autotune report --hf-config ... --json`` in-process: its exit code, its JSON and its stderr."""
    from autotune.cli.main import main

    path = tmp_path / f"config{len(list(tmp_path.glob('config*.json')))}.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = main(["report", "--hf-config", str(path), "--target-batch", "32", *argv, "--json", "--no-cache"])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Warning" not in err, err
    return code, json.loads(out) if out.strip() else {}, err


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_a_stack_extended_from_a_few_blocks_holds_8_bit_states(optimizer, capsys, monkeypatch, tmp_path):
    """12 small layers, traced as 2, 3 and 4 and extended: the optimizer state is bitsandbytes' 8-bit state of every
    parameter, to the byte (its norms, below 4096 values, in 32 bits)."""
    code, data, err = report(capsys, monkeypatch, tmp_path, TINY, "--device", "cpu", "--memory-limit", "1GiB", "--tokens", "64",
                             "--optimizer", optimizer)
    assert code == 0, err
    assert "extended the bytes each block adds" in " ".join(data["plan"]["notes"])  # the depth extension, not the whole model
    assert data["memory"]["optimizer_state"] == eight_bit_state(shapes_of(TINY))


def test_the_what_if_row_of_an_8_bit_optimizer_made_from_fused_adamws_traces_holds_8_bit_states():
    """The what-if row that changes only the optimizer is made from the given optimizer's traces (``Estimator.derived``),
    on the copies of the depth extension: its state is the 8-bit one by hand, the given one's torch's two fp32 states."""
    from autotune.memory.optimizers import make_optimizer
    from autotune.probe.estimate import estimator_for
    from autotune.probe.trial import Workload

    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "torch_dtype")})
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    work = Workload(model=model, optimizer=make_optimizer("adamw_torch_fused", model.parameters(), 1e-3),
                    loss_fn=lambda m, b: m(**b).loss, batch={"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                    precision="fp32", checkpointing=False)
    own = estimator_for(work)
    derived = estimator_for(work, optimizer=("AdamW 8-bit", lambda groups: make_optimizer("adamw_8bit", groups, 1e-3)))
    assert type(own).__name__ == "DepthEstimator"
    shapes = shapes_of(TINY)
    assert own.optimizer_state_bytes() == 2 * 4 * sum(math.prod(s) for s in shapes)
    assert derived.optimizer_state_bytes() == eight_bit_state(shapes)


@pytest.mark.slow  # 6-8 s each (30 s on a loaded machine): the 8B shape's QLoRA
@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_qlora_on_the_llama_3_8b_shape_holds_2_bytes_of_8_bit_state_a_trained_parameter(optimizer, capsys, monkeypatch, tmp_path):
    code, data, err = report(capsys, monkeypatch, tmp_path, LLAMA_3_8B, "--device", "cuda", "--memory-limit", "80GiB",
                             "--precision", "bf16", "--tokens", "2048", "--quantize", "nf4", "--lora", "16",
                             "--lora-modules", "q_proj,k_proj,v_proj,o_proj", "--optimizer", optimizer)
    assert code == 0, err
    shapes = lora_shapes(hidden=4096, layers=32, heads=32, kv_heads=8, rank=16)
    trained = sum(math.prod(s) for s in shapes)
    state = data["memory"]["optimizer_state"]
    assert abs(state / trained - 2) < 0.2, state / trained
    assert state == eight_bit_state(shapes)


@pytest.mark.slow  # 9 s (30 s on a loaded machine): the 8B shape's full fine-tune on one device, then sharded over 8
def test_a_full_fine_tune_of_the_llama_3_8b_shape_holds_2_bytes_of_8_bit_state_a_parameter_on_one_device_and_sharded(
        capsys, monkeypatch, tmp_path):
    common = ("--device", "cuda", "--precision", "bf16", "--tokens", "2048", "--optimizer", "adamw_8bit")
    shapes = shapes_of(LLAMA_3_8B)
    params, by_hand = sum(math.prod(s) for s in shapes), eight_bit_state(shapes)
    code, data, err = report(capsys, monkeypatch, tmp_path, LLAMA_3_8B, *common, "--memory-limit", "1TiB")
    assert code == 0, err
    assert abs(data["memory"]["optimizer_state"] / params - 2) < 0.2
    assert data["memory"]["optimizer_state"] == by_hand
    code, data, err = report(capsys, monkeypatch, tmp_path, LLAMA_3_8B, *common, "--memory-limit", "80GiB", "--shard", "8")
    assert code == 0, err
    per_rank = data["fsdp2"]["parts"]["optimizer_state"]
    assert abs(per_rank / (params / 8) - 2) < 0.2
    assert per_rank == -(-by_hand // 8)


@pytest.mark.slow  # 9 s (35 s on a loaded machine): the 70B shape's fewest devices with each optimizer
def test_the_llama_3_70b_shape_needs_no_more_devices_with_an_8_bit_optimizer_than_with_fused_adamw(capsys, monkeypatch, tmp_path):
    rows = {}
    for optimizer in ("adamw_torch_fused", "paged_adamw_8bit"):
        code, data, err = report(capsys, monkeypatch, tmp_path, LLAMA_3_70B, "--device", "cuda", "--memory-limit", "80GiB",
                                 "--precision", "bf16", "--tokens", "2048", "--checkpointing", "--shard", "auto", "--optimizer", optimizer)
        assert code == 0, err
        rows[optimizer] = data["fsdp2"]
    fused, eight = rows["adamw_torch_fused"], rows["paged_adamw_8bit"]
    assert fused["fits"] and eight["fits"]
    assert eight["ranks"] <= fused["ranks"]
    params = sum(math.prod(s) for s in shapes_of(LLAMA_3_70B))
    assert abs(eight["parts"]["optimizer_state"] / (params / eight["ranks"]) - 2) < 0.2  # 2 bytes, where bf16 AdamW holds 4
    assert abs(fused["parts"]["optimizer_state"] / (params / fused["ranks"]) - 4) < 0.01


# --- what the CLI's --hf-config builds: the adapters' default modules, the shape, what stays unquantized ------------

TINY_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
                "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 100, "num_local_experts": 8,
                "num_experts_per_tok": 2, "max_position_embeddings": 256, "torch_dtype": "float32"}
CPU = ("--device", "cpu", "--memory-limit", "1GiB", "--tokens", "32")


def test_lora_on_mixtral_without_lora_modules_adapts_peft_s_default_for_it(capsys, monkeypatch, tmp_path):
    """PEFT's default for Mixtral (q_proj and v_proj), which PEFT itself loses for Transformers 5's fused experts."""
    pytest.importorskip("peft")
    code, data, err = report(capsys, monkeypatch, tmp_path, TINY_MIXTRAL, *CPU, "--lora", "4")
    assert code == 0, err
    setting = data["plan"]["setting"]
    assert setting["adapters"] == "LoRA rank 4, alpha 8, on q_proj, v_proj"
    per_layer = (4 * 64 + 64 * 4) + (4 * 64 + 32 * 4)  # q_proj 64 -> 64, v_proj 64 -> 32 (2 key-value heads of 16)
    assert setting["parameters"].endswith(f", {2 * per_layer:,} trained")


@pytest.mark.parametrize("config, argv, message", [
    ({**TINY_MIXTRAL, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 4, "moe_intermediate_size": 32,
      "shared_expert_intermediate_size": 64},
     ("--lora", "4"),
     r"Invalid --lora 4 without --lora-modules: PEFT has no default modules for 'qwen2_moe' models; name the modules to adapt "
     r"with --lora-modules \(e\.g\. --lora-modules all-linear, or some of its linear layers: q_proj,k_proj,v_proj,o_proj,"),
    ({k: v for k, v in TINY.items() if k not in ("hidden_size", "num_hidden_layers")}, (),
     r"Invalid --hf-config '.*config0\.json': it has no hidden_size, num_hidden_layers \(the model's shape; LlamaConfig would fill "
     r"in its defaults, hidden_size=4096, num_hidden_layers=32, and estimate another model\); give the model's own config\.json, "
     r"or add these fields"),
    ({"model_type": "gpt2", "n_layer": 2, "n_head": 4, "vocab_size": 500, "n_positions": 256}, (),
     r"it has no n_embd \(the model's shape; GPT2Config would fill in its defaults, n_embd=768.*or add this field"),
], ids=["lora-without-a-default", "llama-without-its-shape", "gpt2-without-its-width"])
def test_a_config_the_cli_cannot_build_as_asked_is_refused_naming_the_value_and_the_fix(config, argv, message, capsys, monkeypatch, tmp_path):
    if "--lora" in argv:
        pytest.importorskip("peft")
    code, _, err = report(capsys, monkeypatch, tmp_path, config, *CPU, *argv)
    assert code == 2 and re.search(message, err), err


def test_qlora_on_mixtral_says_its_fused_experts_stay_unquantized_with_their_bytes(capsys, monkeypatch, tmp_path):
    """bitsandbytes quantizes linear layers; Mixtral's experts are parameters (8 experts' gate_up_proj and down_proj a layer),
    so they stay fp32 here (bf16 in a bf16 config), said on the setting's quantization line with their bytes by hand."""
    pytest.importorskip("peft")
    code, data, err = report(capsys, monkeypatch, tmp_path, TINY_MIXTRAL, *CPU, "--quantize", "nf4", "--lora", "4")
    assert code == 0, err
    line = data["plan"]["setting"]["quantization"]
    experts = 2 * 8 * (2 * 128 * 64 + 64 * 128)  # 2 layers of 8 experts: gate_up_proj 256 x 64, down_proj 64 x 128
    rest = 2 * 100 * 64 + 5 * 64 + 2 * 8 * 64  # embed_tokens and lm_head, the 5 norms, the 2 routers' weights
    assert line.startswith("bitsandbytes nf4") and f"left unquantized: {experts + rest:,} parameters" in line, line
    assert "of fp32 weights: experts.gate_up_proj (x2) 1.00 MiB, experts.down_proj (x2) 512.00 KiB" in line, line


# --- what the shard answer says of its figures --------------------------------------------------------------------


def test_a_sharded_bitsandbytes_optimizer_counts_its_8_bit_shard_and_says_bitsandbytes_does_not_step_on_fsdp2(
        capsys, monkeypatch, tmp_path):
    code, data, err = report(capsys, monkeypatch, tmp_path, TINY, "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64",
                             "--optimizer", "adamw_8bit", "--shard", "2")
    assert code == 0, err
    assert data["fsdp2"]["parts"]["optimizer_state"] == -(-eight_bit_state(shapes_of(TINY)) // 2)
    assert any(n.startswith("bitsandbytes' optimizers do not step on FSDP2's sharded (DTensor) parameters") and "2.03 bytes" in n
               for n in data["fsdp2"]["notes"]), data["fsdp2"]["notes"]
    code, data, err = report(capsys, monkeypatch, tmp_path, TINY, "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64",
                             "--shard", "2")
    assert code == 0 and data["fsdp2"]["notes"] == [], err


@pytest.mark.slow  # 4 s (15 s on a loaded machine): the 70B shape's fewest devices
def test_the_llama_3_70b_shape_with_fp32_master_weights_fits_no_count_of_devices_because_each_holds_autocasts_copies(
        capsys, monkeypatch, tmp_path):
    """Every rank runs the whole forward under bf16 autocast, whose cast cache keeps a bf16 copy of each fp32 weight of a
    linear layer until the forward ends: 69.5B weights (the 80 blocks' projections and the head), 129.46 GiB, on every rank
    whatever their count, more than an 80 GiB device. The rest of a rank's activations at one sample with checkpointing is
    small: the 80 blocks' fp32 inputs (5 GiB) and the loss."""
    code, data, err = report(capsys, monkeypatch, tmp_path, LLAMA_3_70B, "--device", "cuda", "--memory-limit", "80GiB", "--tokens", "2048",
                             "--master-weights", "fp32", "--checkpointing", "--shard", "auto")
    assert code == 1 and not data["fsdp2"]["fits"] and data["fsdp2"]["ranks"] == 1024, err
    h = 8192
    linear = [(h, h), (h // 8, h), (h // 8, h), (h, h), (28672, h), (28672, h), (h, 28672)]  # q, k, v, o (8 key-value heads), MLP
    copies = 2 * (80 * sum(math.prod(s) for s in linear) + 128256 * h)
    activations = data["fsdp2"]["parts"]["activations"]
    inputs = 80 * 2048 * h * 4
    assert copies + inputs < activations < copies + inputs + 4 * 2**30
    assert any(f"copies of the fp32 weights of the linear layers ({copies / 2**30:.2f} GiB)" in n for n in data["fsdp2"]["notes"])
