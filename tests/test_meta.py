"""Estimates of models without weights: a model built on the meta device (``with torch.device("meta")``,
as accelerate's ``init_empty_weights`` and transformers do for big models) plans estimate-only to the
same micro-batch and bytes as the same model with weights; a real plan of it is refused with the fix."""

import pytest
import torch

import autotune

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402
from test_estimate import text_batch  # noqa: E402


def on_meta(make):
    with torch.device("meta"):
        return make()


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("device, limit, precision", [("cpu", "40MiB", "fp32"), ("cuda", "1GiB", "bf16")], ids=["cpu", "cuda-bf16"])
def test_a_model_on_the_meta_device_plans_as_the_same_model_with_weights(name, device, limit, precision):
    make = getattr(hf_models, name)
    loader = [text_batch(8, 64, seed=s) for s in range(2)]
    plans = []
    for model in (make(), on_meta(make)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        plans.append(autotune.plan(model, loader, target_batch=8192, optimizer=opt, device=device, memory_limit=limit, headroom=0,
                                   precision=precision, verify=False, progress=False))
    with_weights, without = plans
    assert without.micro_batch == with_weights.micro_batch and 8 < without.micro_batch < 8192
    assert without.peak_memory == with_weights.peak_memory
    assert not any("estimate unavailable" in n for n in without.notes)


def test_what_if_and_a_model_partly_on_the_meta_device_answer_as_with_weights():
    """The what-if table of a model without weights, and the plan of one whose second block alone is on the meta
    device (a model loaded part by part), are those of the model with weights."""
    loader = [text_batch(8, 64, seed=s) for s in range(2)]
    kw = dict(target_batch=512, device="cuda", memory_limit="1GiB", headroom=0, verify=False, progress=False)
    tables = [autotune.what_if(model, loader, **kw) for model in (hf_models.gpt2(), on_meta(hf_models.gpt2))]
    assert tables[0].rows == tables[1].rows and len(tables[0].rows) > 3
    mixed = hf_models.gpt2()
    mixed.transformer.h[1].to("meta")
    assert any(p.is_meta for p in mixed.parameters()) and not all(p.is_meta for p in mixed.parameters())
    plans = [autotune.plan(model, loader, **kw) for model in (hf_models.gpt2(), mixed)]
    assert (plans[0].micro_batch, plans[0].peak_memory) == (plans[1].micro_batch, plans[1].peak_memory)
    assert 8 < plans[0].micro_batch < 512


def test_a_real_plan_of_a_model_on_the_meta_device_is_refused_with_the_fix():
    model = on_meta(hf_models.gpt2)
    loader = [text_batch(8, 64)]
    for kw in ({}, {"device": "cpu"}):
        with pytest.raises(ValueError, match=r"on the meta device.*verify=False.*or materialise the model first"):
            autotune.plan(model, loader, target_batch=64, memory_limit="40MiB", progress=False, **kw)
    with pytest.raises(ValueError, match="on the meta device"):
        autotune.fit(model, loader, 64, memory_limit="40MiB", progress=False)


def llama3_8b():
    """The shape of Llama-3-8B (32 layers of 4096, grouped-query attention 32/8, MLP 14336, vocabulary 128256), bf16,
    on the meta device: 8.0e9 parameters and no byte of them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def tokens(n=4096):
    ids = torch.randint(0, 128256, (1, n), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(1, n, dtype=torch.long), "labels": ids.clone()}


EIGHTY = dict(device="cuda", memory_limit="80GiB", precision="bf16", verify=False, progress=False)


@pytest.mark.slow  # a minute: the what-if table traces the whole 32 layers for each setting (a CUDA target)
def test_llama_3_8b_at_4096_tokens_on_80_gib_full_fine_tuning_does_not_fit_and_says_what_would():
    model = llama3_8b()
    assert 7.9e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    with pytest.raises(autotune.NothingFits) as caught:
        autotune.plan(model, [tokens()], target_batch=32, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), **EIGHTY)
    fitting = [row for row in caught.value.what_if.rows if row.micro_batch]
    assert fitting, caught.value.what_if.rows
    assert "fit" in str(caught.value) and "checkpointing" in str(caught.value)


def test_llama_3_8b_at_4096_tokens_on_80_gib_with_lora_or_sharded_over_8_gets_a_micro_batch():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(llama3_8b(), peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < sum(p.numel() for p in trainable) < 2e7
    lora = autotune.plan(model, [tokens()], target_batch=32, optimizer=torch.optim.AdamW(trainable, lr=1e-4),
                         loss_fn=lambda m, b: m(**b).loss, **EIGHTY)
    assert 1 <= lora.micro_batch < 32
    from autotune.planning.sharding import shard_plan

    model = llama3_8b()
    (row,) = shard_plan(model, [tokens()], target_batch=32, ranks=8, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                        device="cuda", memory_limit="80GiB", precision="bf16")
    assert row.fits and row.micro_batch >= 1
