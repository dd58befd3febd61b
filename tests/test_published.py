"""The CUDA estimate against peaks others measured on real GPUs and published (``benchmarks/published.py``): the
cases whose publication is comparable with today's PyTorch (docs/benchmarks.md says which and why the others are
not), each rebuilt from its public configuration on the meta device, within 1% below and 3% above the figure."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
pytest.importorskip("transformers")
import published  # noqa: E402


def case(id_):
    return next(c for c in published.CASES if c.id == id_)


@pytest.mark.slow  # Mistral-7B's shape at 4 x 4096 tokens, traced on fake tensors
def test_mistral_7b_full_fine_tune_peaks_at_its_optimizer_step_as_fms_acceleration_measured_on_an_a100():
    # fms-acceleration's refs/a100_80gb.csv: 72434837504 bytes, max_memory_allocated (bf16, checkpointing, batch 4)
    c = case("mistral-7b full bs4")
    assert 0.99 <= published.estimate(c, "transformers") / (c.published_bytes / published.GB) <= 1.03


@pytest.mark.parametrize("id_", ["bert-large bs1 ga4 checkpointing fp16 adafactor", "bert-large bs1 ga4 checkpointing fp16 adam8bit"])
def test_bert_large_with_checkpointing_holds_what_transformers_page_measured_on_a_v100(id_):
    # Transformers' perf_train_gpu_one page (NVML used after training, its 1343 MiB CUDA context included)
    if id_.endswith("adam8bit"):
        pytest.importorskip("bitsandbytes")
    c = case(id_)
    assert 0.99 <= published.estimate(c, "transformers") / (c.published_bytes / published.GB) <= 1.03


def test_the_table_names_every_source_and_what_its_figure_is(capsys, monkeypatch):
    monkeypatch.delenv("LITGPT_DIR", raising=False)  # Transformers' models alone: one estimate column
    assert published.main(["--cases", "bert-large bs1 ga4 checkpointing fp16 adafactor"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| bert-large"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[1] == "hf-perf" and float(cells[2]) == pytest.approx(4847 * 2**20 / 1e9, abs=0.005)
    assert float(cells[4]) == pytest.approx(float(cells[3]) / float(cells[2]), abs=0.002)
    assert "perf_train_gpu_one" in out and "1343 MiB" in out
    assert {c.source for c in published.CASES} == set(published.SOURCES)
    assert len(published.CASES) >= 12 and len(published.SOURCES) >= 3


# A Llama shape small enough for a real CPU step, its vocabulary large beside its width: the logits dominate.
TINY = published.Shape("tiny", "llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                                          "intermediate_size": 128, "vocab_size": 8000, "max_position_embeddings": 256,
                                          "rms_norm_eps": 1e-5}, tokens=200)
TINY_CASE = published.Case("tiny lora mb1", "litgpt", "llama-2-7b", 1, 1.0)


def test_litgpt_procedure_hands_the_loss_fp32_logits_from_fabric_and_holds_them_through_the_backward():
    # finetune/lora.py under Fabric's bf16-true: the wrapper converts the bf16 logit chunks to fp32, the loop keeps them
    pytest.importorskip("lightning")
    pytest.importorskip("peft")
    torch.manual_seed(0)
    setup = published.built(TINY_CASE, "transformers", "cpu", TINY)
    model, loop = setup.model, setup.loss
    model.eval()  # LoRA's dropout off: the reference below is the same function
    batch = published.tokens(1, TINY.tokens, vocab=8000)
    loss = loop(model, batch)
    loss.backward()
    assert [tuple(c.shape) for c in loop.logits] == [(1, 128, 8000), (1, 71, 8000)]  # 200 tokens in chunks of 128, shifted
    assert all(c.dtype == torch.float32 for c in loop.logits)
    # reference: Transformers' own forward of the whole sequence, its logits to fp32, cross-entropy in float64
    peft_model = model.module.model
    with torch.no_grad():
        logits = peft_model(input_ids=batch["input_ids"]).logits.double()
    expected = torch.nn.functional.cross_entropy(logits[0, :-1], batch["labels"][0, 1:])
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_estimate_sees_fabrics_fp32_copies_of_the_logits_and_the_loop_holding_them(monkeypatch):
    # Through Fabric the cross-entropy runs on fp32 copies of the logits (4 bytes a logit, and 4 for the log-softmax saved
    # for the backward, where the model's own were 2 and 2), and the loop holds the copies through the backward: the
    # estimate rises by at least the copies' bytes over the same step on the bare model, its logits dropped before
    # the backward.
    pytest.importorskip("lightning")
    pytest.importorskip("peft")
    through_fabric, _ = published.estimated_peaks(TINY_CASE, "transformers", TINY)

    def bare_step(loss, previous=False):
        def step(model, batch):
            logits = model(batch["input_ids"], lm_head_chunk_size=published.CHUNK)
            logits[-1] = logits[-1][..., :-1, :]
            return loss(logits, batch["labels"][..., 1:])

        return step

    monkeypatch.setattr(published, "fabric_module", lambda model, device, quantization=None: model)
    monkeypatch.setattr(published, "Loop", bare_step)
    bare, _ = published.estimated_peaks(TINY_CASE, "transformers", TINY)
    copies = 200 * 8000 * 4  # 200 tokens of 8000 logits in fp32
    assert copies <= (through_fabric - bare) * published.GB <= 3 * copies


def test_a_later_iteration_holds_the_previous_ones_logits_through_its_forward():
    # finetune/lora.py rebinds `logits` only once the next forward has returned: while the wrapper converts that
    # forward's chunks to fp32, the previous fp32 chunks are live too. Nothing else outlives an iteration but the
    # loss (a scalar), so the rise is more than rounding and at most the previous chunks' bytes.
    pytest.importorskip("lightning")
    pytest.importorskip("peft")
    first, _ = published.estimated_peaks(TINY_CASE, "transformers", TINY)
    later, _ = published.estimated_peaks(TINY_CASE, "transformers", TINY, later=True)
    copies = 200 * 8000 * 4
    assert copies / 10 <= (later - first) * published.GB <= copies
