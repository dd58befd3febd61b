"""FSDP2 estimates from the unsharded model: the parts, NothingFits, ``report --shard``.

The estimate against a real sharded run is in ``test_fsdp`` (two ranks).
"""

import json

import pytest
import torch
from torch import nn

import autotune
from autotune.cli.main import main
from autotune.planning.sharding import (
    ShardParts,
    shard_estimates,
    shard_parts,
    shard_plan,
)


def wide(n=4, width=256):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n)], nn.Linear(width, 10))


def data(rows=8, width=256):
    return [(torch.randn(rows, width), torch.randint(0, 10, (rows,)))]


def test_parts_are_the_models_own_bytes():
    model = wide()
    parts = shard_parts(model, optimizer_state=123)
    layer = (256 * 256 + 256) * 4
    assert parts.parameters == 4 * layer + (256 * 10 + 10) * 4
    assert parts.gradients == parts.parameters and parts.buffers == 0
    assert parts.gathered_units == 2 * layer and parts.outside_units == 0  # the Sequential's children are the units
    held = parts.per_rank(4, accumulating=True)
    assert held["parameters"] == -(-parts.parameters // 4)
    assert held["gradients"] == parts.gradients + -(-parts.gradients // 4)  # unsharded while accumulating, plus the shard
    assert parts.per_rank(4, accumulating=False)["gradients"] == -(-parts.gradients // 4)


def test_the_estimated_optimizer_state_is_adams_two_buffers():
    model = wide()
    rows = shard_plan(model, data(), target_batch=64, ranks=[2], optimizer=torch.optim.AdamW(model.parameters()),
                      device="cpu", memory_limit="64MiB", headroom=0)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert rows[0].parts["optimizer_state"] == -(-2 * params // 2)
    assert all(p.grad is None for p in model.parameters())  # the model was not touched


def test_a_whole_share_without_accumulation_can_fit_where_smaller_micro_batches_cannot():
    """One micro-batch per window never holds the unsharded gradients."""
    parts = ShardParts(parameters=1000, buffers=0, gradients=1000, optimizer_state=2000, gathered_units=200, outside_units=0)
    per_sample = 10
    rows = shard_estimates(parts, lambda b: per_sample * b, ranks=[4], budget=1500, target_batch=40)
    # share 10: 250 + 500 + 250 + 200 + 100 = 1300 fits; any b < 10 adds the whole gradients (1000)
    assert (rows[0].micro_batch, rows[0].accumulation_steps, rows[0].peak) == (10, 1, 1300)
    rows = shard_estimates(parts, lambda b: 20 * b, ranks=[4], budget=2400, target_batch=400)
    # share 100: 1200 + 20 * 100 > 2400 without accumulation; accumulating: 2200 + 20 b <= 2400 -> b = 10
    assert (rows[0].micro_batch, rows[0].accumulation_steps, rows[0].peak) == (10, 10, 2400)


def test_nothing_fits_names_fsdp2_with_per_rank_figures():
    model = wide()
    with pytest.raises(autotune.NothingFits) as caught:
        autotune.plan(model, data(), target_batch=64, memory_limit="3MiB", headroom=0, progress=False)
    err = caught.value
    assert "FSDP2" in str(err) and "fully_shard" in str(err)
    assert [s.ranks for s in err.shards] == [2, 4, 8]
    for s in err.shards:
        assert f"{s.ranks} ranks: {autotune.format_bytes(s.peak)}" in str(err)
    peaks = [s.parts["parameters"] + s.parts["optimizer_state"] for s in err.shards]
    assert peaks[0] > peaks[1] > peaks[2]
    assert err.shards[-1].fits and err.shards[-1].peak <= err.budget


def test_nothing_fits_for_activations_alone_does_not_suggest_sharding():
    model = wide(n=1)
    with pytest.raises(autotune.NothingFits) as caught:
        autotune.plan(model, data(rows=8, width=256), target_batch=64, memory_limit="1100KiB", headroom=0, progress=False)
    assert caught.value.shards == [] and "FSDP2" not in str(caught.value)


def test_on_cuda_every_rank_counts_cublas_workspace_as_one_device_does(monkeypatch):
    """A one-device CUDA estimate counts cuBLAS's workspace (32 MiB on Hopper) beside the tensors; so does every rank of
    an FSDP2 estimate, and the offloaded row's size. With a 16 KiB workspace set (CUBLAS_WORKSPACE_CONFIG) a 4 MiB
    budget fits over 2 and 4 ranks; with the default one the same micro-batches need the budget plus the difference,
    each rank's peak exactly that much more, and at 4 MiB nothing fits. Where the workspace alone passes the budget,
    neither more ranks nor offloading is offered: neither would shrink it."""
    from autotune.memory.allocator import cublas_workspace

    model, context = wide(), 781 * 2**20  # the CUDA context an estimate sets aside

    def ranks(budget):
        return shard_plan(model, data(), target_batch=64, ranks=[2, 4], device="cuda", memory_limit=context + budget, headroom=0)

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:1")
    small = ranks(4 * 2**20)
    assert all(r.fits and r.parts["cublas_workspace"] == 16 * 2**10 for r in small)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    more = cublas_workspace() - 16 * 2**10
    assert cublas_workspace() == 32 * 2**20
    for a, b in zip(small, ranks(4 * 2**20 + more)):
        assert (b.micro_batch, b.peak - a.peak, b.parts["cublas_workspace"]) == (a.micro_batch, more, cublas_workspace())
    assert not any(r.fits for r in ranks(4 * 2**20))
    with pytest.raises(autotune.NothingFits) as caught:  # a budget of 17.1 MiB: the workspace alone is more
        autotune.plan(model, data(), target_batch=64, device="cuda", memory_limit="800MiB", verify=False, progress=False)
    assert caught.value.shards == [] and "FSDP2" not in str(caught.value)
    assert not any(r.offload and r.micro_batch for r in caught.value.what_if.rows)


def test_report_shard_prints_the_per_rank_plan(tmp_path, capsys):
    assert main(["report", "--demo", "--target-batch", "256", "--shard", "4", "--memory-limit", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert "FSDP2 over 4 devices" in out and "micro_batch" in out and "optimizer state" in out
    assert main(["report", "--demo", "--target-batch", "256", "--shard", "4", "--memory-limit", "64MiB", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["fsdp2"]
    assert row["ranks"] == 4 and row["fits"] and row["peak"] <= row["budget"]
    assert row["micro_batch"] * row["accumulation_steps"] >= 64
    assert main(["report", "--demo", "--target-batch", "256", "--shard", "4", "--memory-limit", "1MiB"]) == 1
    assert "does not fit" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--shard", "0"], "Invalid --shard 0"),
    (["--shard", "512"], "Invalid --shard 512"),
    (["--shard", "2", "--what-if"], "drop --what-if"),
])
def test_report_shard_usage_errors(capsys, argv, words):
    assert main(["report", "--demo", "--target-batch", "256", *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_fewest_devices_is_searched_past_the_target_batch():
    from autotune.planning.sharding import fewest_devices

    parts = ShardParts(parameters=1000, buffers=0, gradients=1000, optimizer_state=2000, gathered_units=20, outside_units=0)
    row = fewest_devices(parts, lambda b: 10 * b, budget=300, target_batch=4)
    # per device at n devices and one sample each (no accumulation): its shards of 4000 bytes, 20 gathered, 10 of activations
    expected = next(n for n in range(1, 1000) if -(-1000 // n) * 2 + -(-2000 // n) + 20 + 10 <= 300)
    assert (row.ranks, row.target_batch, row.micro_batch) == (expected, expected, 1) and expected > 4


# --- weights quantized by bitsandbytes: FSDP2 does not keep them --------------------------------------------------------

QUANTIZED_LLAMA = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=8,
                       vocab_size=8000, max_position_embeddings=512, tie_word_embeddings=False)


def quantized_llama():
    """A Llama of 8 small layers on the meta device, its linear layers quantized to nf4 (the head left as it is), so
    that its embedding, norms and head train."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("bitsandbytes")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**QUANTIZED_LLAMA))
    ids = torch.randint(0, QUANTIZED_LLAMA["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(0))
    return autotune.quantize(model, "nf4"), [{"input_ids": ids, "labels": ids}]


def test_a_model_quantized_by_bitsandbytes_is_offered_no_fsdp2_and_the_answer_says_why():
    """FSDP2's fully_shard turns each parameter into a plain sharded tensor: a bitsandbytes weight loses its quantization
    state (bitsandbytes issue 1945). Where nothing fits an H100 limited to 1100 MiB, the quantized Llama's answer offers
    neither FSDP2 counts nor offloading (its step fits 4 and 8 devices, and offloading, by the same estimate that sizes
    them for an unquantized model), and says why, in the error and in the command line's words."""
    from autotune.cli.render import nothing_fits_message

    model, loader = quantized_llama()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    with pytest.raises(autotune.NothingFits) as caught:
        autotune.plan(model, loader, target_batch=16, optimizer=optimizer, memory_limit="1100MiB", gpu="h100", verify=False, progress=False)
    err = caught.value
    assert err.shards == [] and not any(r.offload for r in err.what_if.rows)
    assert "bitsandbytes (nf4)" in err.fsdp2_refused and "quantization state" in err.fsdp2_refused
    assert f"(no --shard or offloading row: {err.fsdp2_refused})" in nothing_fits_message(err)


def test_a_sharded_estimate_of_a_model_quantized_by_bitsandbytes_is_refused_before_anything_runs(capsys, monkeypatch, tmp_path):
    """``shard_plan`` and ``report --shard`` refuse a bitsandbytes-quantized model, naming the quantization and the fix,
    before estimating anything."""
    from autotune.planning import sharding

    model, loader = quantized_llama()
    monkeypatch.setattr(sharding, "estimated", lambda *a, **k: pytest.fail("estimated after all"))
    with pytest.raises(ValueError, match=r"bitsandbytes \(nf4\).*plan the quantized model on one device"):
        shard_plan(model, loader, target_batch=16, ranks=2, memory_limit="80GiB")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **QUANTIZED_LLAMA}))
    capsys.readouterr()
    code = main(["report", "--hf-config", str(config), "--quantize", "nf4", "--lora", "8", "--tokens", "256", "--target-batch", "16",
                 "--gpu", "h100", "--shard", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "Invalid --shard 2: FSDP2 is not planned for weights quantized by bitsandbytes (nf4)" in err
    assert "without --shard" in err and "without --quantize" in err
    factory = tmp_path / "quantized.py"  # a MODEL quantized already, and one quantized by --quantize
    factory.write_text("import autotune, torch\ndef build():\n    return autotune.quantize(torch.nn.Sequential(torch.nn.Linear(64, 64), "
                       "torch.nn.Linear(64, 64)), 'int8')\ndef plain():\n    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))\n")
    for model, flags, kind in ((f"{factory}:build", [], "int8"), (f"{factory}:plain", ["--quantize", "fp4"], "fp4")):
        code = main(["report", model, *flags, "--input-shape", "64", "--target-batch", "16", "--memory-limit", "1GiB", "--shard", "2"])
        err = capsys.readouterr().err
        assert code == 2 and f"Invalid --shard 2: FSDP2 is not planned for weights quantized by bitsandbytes ({kind})" in err, err
