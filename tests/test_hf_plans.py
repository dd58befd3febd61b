"""Planning models nobody here wrote, built from small configs (T5, Llama, Qwen2, GPT-2, BERT): the
estimate is the real peak, one real trial verifies it, the size is the largest that fits for real,
and fit trains the plan's micro-batches on the shape that was probed."""

import copy

import pytest
import torch

import autotune
from autotune.memory.ledger import TensorLedger

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402,F401  (sets HF_HUB_OFFLINE before transformers builds anything)

VOCAB = 500


def t5():
    torch.manual_seed(0)
    config = transformers.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_heads=4, vocab_size=VOCAB,
                                   dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config)


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config)


def qwen2():
    torch.manual_seed(0)
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256)
    return transformers.Qwen2ForCausalLM(config)


MODELS = {"t5": t5, "llama": llama, "qwen2": qwen2, "gpt2": hf_models.gpt2, "bert": hf_models.bert}


def batches(name, *, n=8, b=8, length=64, padded):
    """Fixed-length batches, as a loader with one length gives them; half the rows padded, or none."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, VOCAB, (b, length), generator=g)
        mask = torch.ones(b, length, dtype=torch.long)
        if padded:
            mask[: b // 2, length // 2 :] = 0
        if name == "bert":
            labels = torch.randint(0, 3, (b,), generator=g)
        elif name == "t5":  # inputs and labels of two lengths
            labels = torch.randint(1, VOCAB, (b, length // 4), generator=g)
        else:
            labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def real_peak(model, batch, size):
    """The steady-state step (micro-step, AdamW step, micro-step) at ``size`` on copies, counted apart from autotune."""
    model = copy.deepcopy(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    index = torch.arange(size) % batch["input_ids"].shape[0]
    batch = {k: v[index] for k, v in batch.items()}
    ledger = TensorLedger("cpu")
    ledger.track([*model.parameters(), *model.buffers(), *batch.values()])
    with ledger:
        model(**batch).loss.backward()
        opt.step()
        model(**batch).loss.backward()
    return ledger.peak


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("name", list(MODELS))
def test_one_real_trial_finds_the_largest_size_and_fit_trains_it(name, padded):
    model = MODELS[name]()
    loader = batches(name, padded=padded)
    limit = real_peak(model, loader[0], 12) + 2**16  # between 12 and the next sizes: accumulation needed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plan = autotune.plan(model, loader, target_batch=64, optimizer=opt, memory_limit=limit, headroom=0, progress=False,
                         base_batch=64)
    real = [t for t in plan.trials if not t.estimate]
    assert len(real) == 1 and real[0].batch_size == plan.micro_batch and real[0].fits
    assert plan.memory_curve is not None
    assert plan.memory_curve(plan.micro_batch) == pytest.approx(plan.peak_memory, rel=0.005)  # estimate = real
    assert plan.peak_memory == real_peak(model, loader[0], plan.micro_batch)  # the real trial's count, reproduced
    assert real_peak(model, loader[0], plan.micro_batch + 1) > limit  # nothing larger fits: the true maximum
    assert plan.shape_model is None  # one length in the loader: no model of memory against length
    assert plan.micro_batch_for(loader[0]) == plan.micro_batch
    result = autotune.fit(model, loader, plan=plan, optimizer=opt, max_steps=1, progress=False)
    assert result.history[0].micro_batches == plan.micro_batches  # the verified micro-batch, on the probed shape
    assert result.noise_scale is None and "it takes two" in result.noise_note  # one window: said, not silent
