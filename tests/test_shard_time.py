"""The time of a sharded step: FSDP2's ring collectives by hand, the overlap rule, a Llama shape over 2, 4 and 8
devices of an H100, and the report's text and --json with the basis."""

from __future__ import annotations

import json

import pytest
import torch

import autotune
from autotune.cli.main import main
from autotune.memory.gpus import gpu_named
from autotune.memory.work import Work
from autotune.planning.collectives import NCCL_BUS, ring_seconds, shard_step_time, traffic

transformers = pytest.importorskip("transformers")


def test_a_ring_collective_takes_its_bytes_times_n_minus_1_over_n_at_the_links_bus_bandwidth():
    # H100 SXM: NVLink 4, 900 GB/s both directions (the datasheet), 450 GB/s one way; L4: PCIe 4.0 x16, 32 GB/s one way.
    assert ring_seconds(3 * 10**9, 4, gpu_named("h100-sxm")) == pytest.approx(3e9 * 3 / 4 / (450e9 * NCCL_BUS.nvlink))
    assert ring_seconds(10**9, 8, gpu_named("l4")) == pytest.approx(1e9 * 7 / 8 / (32e9 * NCCL_BUS.pcie))
    assert ring_seconds(10**9, 1, gpu_named("h100-sxm")) == 0.0  # one rank: nothing to exchange
    assert 0.4 < NCCL_BUS.pcie < NCCL_BUS.nvlink < 1  # below the link, over PCIe further below (nccl-tests' busbw)


@pytest.mark.parametrize("ranks", [0, -2, 1.5, True], ids=["zero", "negative", "fraction", "bool"])
def test_a_bad_count_of_ranks_is_refused_naming_it(ranks):
    with pytest.raises(ValueError, match=f"Invalid ranks {ranks!r}"):
        ring_seconds(10, ranks, gpu_named("h100-sxm"))


def test_the_step_hides_collectives_behind_compute_but_the_first_gather_and_the_last_reduce():
    card = gpu_named("h100-sxm")
    # Two blocks of 4 GB and 8 GB outside them (embedding, head), all trained: 16 GB of parameters and of gradients.
    flows = traffic([(4 * 10**9, 4 * 10**9), (4 * 10**9, 4 * 10**9)], parameters=16 * 10**9, gradients=16 * 10**9)
    assert (flows.gather_forward, flows.gather_backward, flows.reduce_scatter) == (16e9, 8e9, 16e9)
    assert (flows.first_gather, flows.last_reduce) == (12e9, 12e9)  # the root's 8 GB and the first block's 4 GB
    bw = 450e9 * NCCL_BUS.nvlink * 8 / 7  # bytes of the unsharded size a second over 8 ranks

    def step(matmul_flops: int) -> tuple[float, float]:
        work = Work((("forward", "bfloat16", "matmul", matmul_flops, 0), ("step", "float32", "memory", 0, 8 * 10**9)))
        t = shard_step_time(work, card, flows, ranks=8, accumulation=3, samples=24, target_batch=192)
        return t.step, t.compute.micro_step

    # Compute-bound: a micro-step is the first gather (12 GB) and its compute; the syncing one also the last reduce.
    total, compute = step(10**17)
    assert total == pytest.approx(12e9 / bw + 3 * compute + 2 * 12e9 / bw + 12e9 / bw + 1e9 / (3.35e12 * 0.85), rel=1e-3)
    # Link-bound (compute near nothing): every byte of every collective is on the step's critical path.
    total, compute = step(10**6)
    assert compute < 1e-3 * total
    assert total == pytest.approx(3 * 24e9 / bw + 16e9 / bw, rel=1e-2)


def llama(layers: int = 4) -> torch.nn.Module:
    config = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=4,
                                      num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def loader(length: int = 512) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 32000, (4, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids, "labels": ids}]


def test_over_more_h100s_a_ranks_compute_falls_while_the_collectives_share_grows():
    model = llama()
    rows = autotune.shard_plan(model, loader(), target_batch=64, ranks=(2, 4, 8), gpu="h100", precision="bf16")
    times = [row.time for row in rows]
    assert all(t is not None for t in times)
    params = sum(p.numel() * 4 for p in model.parameters())  # fp32 weights, each gathered for the forward
    for row, t in zip(rows, times):
        assert t.ranks == row.ranks and t.target_batch == 64 and t.tokens == 64 * 512
        assert t.compute.samples == 64 // row.ranks and t.compute.accumulation == row.accumulation_steps
        # At least the forward's all-gather of every parameter at the link's bus bandwidth, per micro-step.
        assert t.gather >= params * (row.ranks - 1) / row.ranks / (450e9 * NCCL_BUS.nvlink) * 0.999
        assert t.compute.step < t.step < t.compute.step + t.communication + 1e-12
    compute = [t.compute.step for t in times]
    share = [t.communication / t.step for t in times]
    assert compute[0] > compute[1] > compute[2]
    assert share[0] < share[1] < share[2]
    assert times[0].step > times[2].step  # 4x the devices: still faster, not 4x


def test_over_more_than_a_node_the_time_says_it_is_a_lower_bound():
    (row,) = autotune.shard_plan(llama(2), loader(128), target_batch=16, ranks=16, gpu="h100")
    assert "spans nodes" in row.time.basis and "lower bound" in row.time.brief()
    (row,) = autotune.shard_plan(llama(2), loader(128), target_batch=16, ranks=8, gpu="h100")
    assert "spans nodes" not in row.time.basis and "lower bound" not in row.time.brief()


def test_without_a_card_there_is_no_time_and_a_card_with_a_cpu_device_is_refused():
    (row,) = autotune.shard_plan(llama(2), loader(128), target_batch=8, ranks=2, device="cpu", memory_limit="8GiB")
    assert row.time is None and row.to_dict()["time"] is None
    with pytest.raises(ValueError, match="Invalid device 'cpu' with gpu='h100-sxm'"):
        autotune.shard_plan(llama(2), loader(128), target_batch=8, ranks=2, device="cpu", gpu="h100")


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
                                "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 8000, "max_position_embeddings": 1024,
                                "torch_dtype": "bfloat16"}))
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_shard_report_and_its_json_give_the_time_with_its_basis(capsys, config_file):
    argv = ("report", "--hf-config", config_file, "--tokens", "256", "--gpu", "h100", "--target-batch", "32", "--shard", "4", "--no-cache")
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    for row in ("time per step", "compute", "collectives", "throughput", "basis"):
        assert f"\n    {row}" in out or f"\n  {row}" in out, row
    assert "FSDP2's collectives over NVLink 4 at 450 GB/s a direction" in out
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    t = json.loads(out)["fsdp2"]["time"]
    assert t["basis"].startswith("predicted for 4 x an H100 SXM") and "NVLink 4" in t["basis"]
    assert t["ranks"] == 4 and t["tokens_per_second"] == pytest.approx(32 * 256 / t["step"])
    assert t["step"] == pytest.approx(t["compute"]["step"] + t["exposed"])
    code, out, err = run(capsys, *argv[:-2], "auto", "--no-cache", "--json")  # the fewest devices that fit, timed too
    assert code == 0, err
    data = json.loads(out)
    assert data["fewest"] and data["fsdp2"]["time"]["ranks"] == data["fsdp2"]["ranks"] >= 1
