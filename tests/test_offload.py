"""Offloading to host memory as a what-if row (FSDP2's CPUOffloadPolicy on one device): the host memory it needs against
a count by hand, what it takes off the device, its time against the host link's bound by hand, and the row in the
nothing-fits answer of a Llama-3-8B full fine-tune on an H100. Estimates only, on fake tensors."""

import json
import math

import pytest
import torch

import autotune
from autotune.memory.gpus import gpu_named
from autotune.memory.timing import StepTime
from autotune.planning.offload import HOST_RATE, Offload, offload_time
from autotune.units import format_bytes

transformers = pytest.importorskip("transformers")

PCIE5_X16 = 64e9  # bytes/s a direction: the H100 SXM datasheet's "PCIe Gen5: 128GB/s", both directions

SMALL = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=8,
             vocab_size=8000, max_position_embeddings=512, tie_word_embeddings=False)
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "float32"}


def llama_parameters(c: dict) -> tuple[int, int, int]:
    """(all, in the embedding, in the head) parameters of a Llama causal LM with untied embeddings, by hand: per
    layer the four attention projections (keys and values at the grouped heads' width), the three MLP matrices and two
    norms; then the final norm."""
    h, kv = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"] * c["num_key_value_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * c["intermediate_size"] + 2 * h
    embedding = head = c["vocab_size"] * h
    return c["num_hidden_layers"] * layer + h + embedding + head, embedding, head


def small_what_if(memory_limit: str, *, frozen_embedding: bool = False, device: str | None = None, gpu: str | None = "h100",
                  verify: bool = True, config: dict = SMALL):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    if frozen_embedding:
        model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, SMALL["vocab_size"], (4, 256), generator=torch.Generator().manual_seed(0))
    loader = [{"input_ids": ids, "labels": ids}]
    table = autotune.what_if(model, loader, target_batch=16, optimizer=optimizer, memory_limit=memory_limit, gpu=gpu, device=device,
                             verify=verify, progress=False)
    return table, [r for r in table.rows if r.offload]


@pytest.fixture(scope="module")
def small():
    """A Llama of 8 small layers whose weights, gradients and AdamW state (536 MB) do not fit the 305 MiB an H100
    limited to 1120 MiB leaves a step (cuBLAS's 32 MiB workspace among them), its embedding frozen."""
    return small_what_if("1120MiB", frozen_embedding=True)


def test_the_row_needs_the_parameters_gradients_and_optimizer_state_in_host_memory(small):
    table, rows = small
    assert next(r for r in table.rows if r.changes == 0).micro_batch == 0  # the model as given fits nothing
    assert {r.checkpointing for r in rows} == {False, True}
    n, embedding, _ = llama_parameters(SMALL)
    trained = n - embedding
    by_hand = 4 * n + 4 * trained + 2 * 4 * trained  # fp32 weights; fp32 gradients and AdamW's two fp32 states of the trained
    for row in rows:
        assert row.host_bytes == by_hand
        assert format_bytes(by_hand) in row.offload and "CPUOffloadPolicy" in row.describe()


def test_the_device_holds_at_least_the_optimizer_state_less_than_without_offloading(small):
    table, rows = small
    for row in rows:
        assert row.micro_batch >= 1  # offloading is what fits
        plain = next(r for r in table.rows if r.changes == int(row.checkpointing) and r.checkpointing == row.checkpointing
                     and not r.offload and not r.adapters and "(given)" in r.optimizer)
        n, embedding, _ = llama_parameters(SMALL)
        state = 2 * 4 * (n - embedding)
        offloaded = row.fixed + row.per_sample * row.micro_batch
        without = plain.fixed + plain.per_sample * row.micro_batch
        assert offloaded <= without - state


def test_no_row_where_the_model_fits_or_on_the_cpu():
    tiny = {**SMALL, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
    table, rows = small_what_if("2GiB", config=tiny)
    assert next(r for r in table.rows if r.changes == 0).micro_batch >= 1 and rows == []
    table, rows = small_what_if("16MiB", device="cpu", gpu=None, verify=False, config=tiny)
    assert next(r for r in table.rows if r.changes == 0).micro_batch == 0 and rows == []  # no host to offload to


def test_the_time_is_the_longer_of_the_card_and_the_copies_plus_the_hosts_work_by_hand():
    """64 GB of fp32 weights (4 GB of them outside the blocks), their gradients and AdamW's state, 4 micro-steps of 1 s
    on an H100 SXM, whose host link is PCIe 5.0 x16."""
    card = gpu_named("h100-sxm")
    o = Offload(1, 0, {}, parameters=64 * 10**9, gradients=64 * 10**9, optimizer_state=128 * 10**9, root_parameters=4 * 10**9)
    compute = StepTime(micro_step=1.0, optimizer=0.5, accumulation=4, samples=4, tokens=None, flops=0.0, peak=None, basis="predicted",
                       bound="compute")
    t = offload_time(o, compute, card)
    copies = (2 * 64e9 - 4e9 + 64e9) / PCIE5_X16  # each block's weights in twice, the root's once, the gradients out
    sums = 3 * 3 * 64e9 / HOST_RATE.bytes_per_second  # from the second micro-step: two gradients read, one written
    assert t.step == pytest.approx(4 * copies + sums + (3 * 64e9 + 2 * 128e9) / HOST_RATE.bytes_per_second)
    assert t.bound == "host link" and "PCIe 5.0 x16" in t.basis


@pytest.fixture(scope="module")
def llama_3_8b(tmp_path_factory):
    """``autotune report`` of a Llama-3-8B full fine-tune (fp32 weights under bf16 autocast, 2048 tokens, AdamW) on an
    H100 for a target batch of 64: nothing fits (its weights, gradients and state alone are 120 GiB)."""
    from autotune.cli.main import main

    path = tmp_path_factory.mktemp("offload") / "config.json"
    path.write_text(json.dumps(LLAMA_3_8B))
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", "--hf-config", str(path), "--tokens", "2048", "--gpu", "h100", "--precision", "bf16",
                     "--target-batch", "64", "--json", "--no-cache"])
    return code, json.loads(out.getvalue()), err.getvalue()


def test_the_nothing_fits_answer_of_a_llama_3_8b_offers_offloading_with_its_time_and_host_memory(llama_3_8b):
    code, data, err = llama_3_8b
    assert code != 0 and data["plan"] is None
    n, embedding, head = llama_parameters(LLAMA_3_8B)
    assert n == 8_030_261_248  # Llama-3-8B's published count
    host = 4 * n + 4 * n + 2 * 4 * n
    offered = [w for w in data["would_fit"] if "CPUOffloadPolicy" in w["flags"]]
    assert offered and all(w["host_memory"] == host and w["step_time"] > 0 for w in offered)
    message = data["nothing_fits"]["message"]
    lines = [line for line in message.splitlines() if "CPUOffloadPolicy" in line]
    assert len(lines) == len(offered) and all(" a step, " in line and f"{format_bytes(host)} of host memory" in line for line in lines)
    assert "CPUOffloadPolicy" in err  # the same answer on stderr


def test_the_8b_rows_time_is_at_least_the_host_links_bound_by_hand(llama_3_8b):
    _, data, _ = llama_3_8b
    n, embedding, head = llama_parameters(LLAMA_3_8B)
    rows = [r for r in data["what_if"]["rows"] if r["offload"]]
    assert rows
    for row in rows:
        k = math.ceil(64 / row["micro_batch"])  # micro-steps an optimizer step
        bound = 4 * n * 2 * k / PCIE5_X16 + 4 * n / PCIE5_X16  # weights in for each forward and backward, gradients out
        assert row["step_time"] >= bound


def test_every_row_of_the_8b_answer_gives_its_time(llama_3_8b):
    """Every change that fits, and the fewest devices to shard over, says how long an optimizer step takes; the changes
    come fastest first."""
    _, data, _ = llama_3_8b
    rows = [line for line in data["nothing_fits"]["message"].splitlines() if "micro-batch" in line and line.startswith("  ")]
    assert len(rows) >= 4 and all(" a step" in line for line in rows), rows
    timed = [w["step_time"] for w in data["would_fit"] if w.get("step_time") is not None]
    assert timed == sorted(timed)
