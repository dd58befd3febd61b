"""Estimates of models without weights: a model built on the meta device (``with torch.device("meta")``,
as accelerate's ``init_empty_weights`` and transformers do for big models) plans estimate-only to the
same micro-batch and bytes as the same model with weights; a real plan of it is refused with the fix."""

import re
import warnings

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
    from autotune.probe import estimate

    tables = []
    for model in (hf_models.gpt2(), on_meta(hf_models.gpt2)):
        estimate.forget()  # each table from nothing kept: the LoRA rows' models are alike, and would share their traces
        tables.append(autotune.what_if(model, loader, **kw))
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


@pytest.mark.slow  # half a minute: the what-if table estimates the 32 layers for each setting
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
    with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
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


LLAMA_3_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
}


def report(capsys, monkeypatch, tmp_path, *argv):
    import json as _json

    from autotune.cli.main import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = main(["report", *argv, "--json"])
    out, err = capsys.readouterr()
    return code, (_json.loads(out) if code == 0 else None), err


def write_config(tmp_path, config, as_dir=True):
    import json as _json

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(_json.dumps(config))
    return str(folder if as_dir else folder / "config.json")


def test_the_cli_plans_from_a_config_without_weights_as_the_api_does_for_the_model_with_weights(capsys, monkeypatch, tmp_path):
    """A Llama config file (12 small layers) planned from the command line: the model built on the meta device, the
    plan that of the same model with weights through the API, the batch the config's own token ids."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 12, "num_key_value_heads": 2, "vocab_size": 500,
              "max_position_embeddings": 256, "torch_dtype": "float32"}
    path = write_config(tmp_path, config, as_dir=False)
    code, data, err = report(capsys, monkeypatch, tmp_path, "--hf-config", path, "--target-batch", "64", "--device", "cpu",
                             "--memory-limit", "100MiB", "--headroom", "0", "--tokens", "64")
    assert code == 0, err
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}))
    ids = torch.randint(0, 500, (1, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    reference = autotune.plan(model, [batch], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              device="cpu", memory_limit="100MiB", headroom=0, verify=False, progress=False)
    assert data["plan"]["micro_batch"] == reference.micro_batch and 4 < reference.micro_batch < 64
    assert data["plan"]["peak_memory"] == reference.peak_memory
    assert data["device"]["name"] == "estimated for a model without weights"


def test_the_cli_plans_an_image_classifier_from_its_config_as_the_api_does_on_an_image_and_a_class(capsys, monkeypatch, tmp_path):
    """A ViT config (its main input pixel_values): the batch is one image of the config's size and a class, where the
    command line made token ids and stopped on the model's error; the plan is the API's for the model with weights on
    that batch. --tokens, a setting of token ids, is refused in one line."""
    config = {"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 64, "num_hidden_layers": 4,
              "num_attention_heads": 4, "intermediate_size": 128, "image_size": 64, "patch_size": 8, "num_channels": 3,
              "torch_dtype": "float32", "id2label": {"0": "a", "1": "b", "2": "c"}}
    path = write_config(tmp_path, config)
    argv = ("--hf-config", path, "--target-batch", "64", "--device", "cpu", "--memory-limit", "30MiB", "--headroom", "0")
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv)
    assert code == 0, err
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}))
    g = torch.Generator().manual_seed(0)
    batch = {"pixel_values": torch.randn(1, 3, 64, 64, generator=g), "labels": torch.randint(0, 3, (1,), generator=g)}
    reference = autotune.plan(model, [batch], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              device="cpu", memory_limit="30MiB", headroom=0, verify=False, progress=False)
    assert 2 < reference.micro_batch < 64
    assert (data["plan"]["micro_batch"], data["plan"]["peak_memory"]) == (reference.micro_batch, reference.peak_memory)
    assert "tokens" not in data and "tokens per sample" not in data["plan"]["setting"]
    code, _, err = report(capsys, monkeypatch, tmp_path, *argv, "--tokens", "64")
    assert code == 2 and err.count("\n") == 1 and "--tokens: ViTForImageClassification takes images (3x64x64 pixel_values)" in err, err


@pytest.mark.slow  # about a minute: three plans of the 8B shape, the last with its what-if table
def test_the_cli_answers_the_8b_question_from_a_config_directory_with_lora_and_with_8_shards(capsys, monkeypatch, tmp_path):
    pytest.importorskip("peft")
    path = write_config(tmp_path, LLAMA_3_8B_CONFIG)
    common = ("--hf-config", path, "--target-batch", "32", "--device", "cuda", "--memory-limit", "80GiB", "--precision", "bf16",
              "--tokens", "4096")
    code, data, err = report(capsys, monkeypatch, tmp_path, *common, "--lora", "16")
    assert code == 0, err
    assert 1 <= data["plan"]["micro_batch"] < 32 and "estimate" in data["plan"]["notes"][0]
    assert "Warning" not in err and "Traceback" not in err
    code, data, err = report(capsys, monkeypatch, tmp_path, *common, "--shard", "8")
    assert code == 0, err
    assert data["fsdp2"]["fits"] and data["fsdp2"]["micro_batch"] >= 1
    code, _, err = report(capsys, monkeypatch, tmp_path, *common)  # every weight trained: nothing fits, and it says what would
    assert code == 1 and "nothing fits" in err and re.search(r"^\s+--checkpointing\s+micro-batch [1-9]", err, flags=re.M), err


@pytest.mark.parametrize("argv, message", [
    (("--tokens", "64"), "--tokens 64 shapes the model and batch of --hf-config"),
    (("--hf-config", "{config}", "--input-shape", "8"), "drop --input-shape"),
    (("--hf-config", "{config}"), "give the card with --gpu NAME .* or the device.s memory with --memory-limit"),
    (("--hf-config", "{missing}", "--memory-limit", "1GiB"), "Invalid --hf-config .*no such file"),
    (("--hf-config", "{config}", "--memory-limit", "1GiB", "--tokens", "100000"), "Invalid --tokens 100000: the model takes 1 to 256"),
    (("--hf-config", "{config}", "--memory-limit", "1GiB", "--lora", "0"), "Invalid --lora 0"),
    (("--hf-config", "{unknown}", "--memory-limit", "1GiB"), "its model_type 'qwen9' is not one this transformers .* knows; upgrade"),
])
def test_the_config_path_refuses_bad_input_naming_the_fix(argv, message, capsys, monkeypatch, tmp_path):
    import re as _re

    config = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 500, "n_positions": 256}
    path = write_config(tmp_path, config)
    unknown = tmp_path / "unknown.json"
    unknown.write_text('{"model_type": "qwen9", "architectures": ["Qwen9ForCausalLM"], "hidden_size": 64}')
    argv = [a.format(config=path, missing=str(tmp_path / "nothing"), unknown=str(unknown)) for a in argv]
    if "--hf-config" not in argv:
        argv = ["tests/hf_models.py:gpt2", *argv]
    code, _, err = report(capsys, monkeypatch, tmp_path, *argv, "--target-batch", "8", "--device", "cpu")
    assert code == 2 and _re.search(message, err), err


_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300}
_TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 56, "patch_size": 14}
# Small configs of four vision-language families, and the tokens an image of 56x56 becomes by each one's published rule:
# LLaVA, the tower's patches less its CLS token ((56 / 14)^2); Gemma-3, its mm_tokens_per_image; Mistral-3, Pixtral's
# patches merged 2x2 ((56 / 14 / 2)^2); PaliGemma, SigLIP's patches ((56 / 14)^2).
VISION_LANGUAGE = {
    "llava": ({"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 299, "torch_dtype": "float32",
               "text_config": {"model_type": "llama", **_TEXT}, "vision_config": {"model_type": "clip_vision_model", **_TOWER}}, 16),
    "gemma3": ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "image_token_index": 299, "boi_token_index": 297,
                "eoi_token_index": 298, "mm_tokens_per_image": 4, "torch_dtype": "float32",
                "text_config": {"model_type": "gemma3_text", **_TEXT, "head_dim": 16}, "vision_config": {"model_type": "siglip_vision_model", **_TOWER}}, 4),
    "mistral3": ({"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3", "image_token_index": 299, "spatial_merge_size": 2,
                  "torch_dtype": "float32", "text_config": {"model_type": "mistral", **_TEXT}, "vision_config": {"model_type": "pixtral", **_TOWER}}, 4),
    "paligemma": ({"architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma", "image_token_index": 299, "projection_dim": 64,
                   "hidden_size": 64, "vocab_size": 300, "torch_dtype": "float32", "text_config": {"model_type": "gemma", **_TEXT, "head_dim": 16},
                   "vision_config": {"model_type": "siglip_vision_model", **_TOWER, "projection_dim": 64}}, 16),
}


def _config_dir(tmp_path, name, config):
    import json as _json

    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(_json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("family", sorted(VISION_LANGUAGE))
def test_the_cli_plans_a_vision_language_model_on_an_image_and_its_tokens_as_the_api_does(capsys, monkeypatch, tmp_path, family):
    """A vision-language config (LLaVA, Gemma-3, Mistral-3, PaliGemma): each sample holds an image of the tower's size, its tokens
    (by the family's own rule) among --tokens, where the command line planned text alone and said nothing; the plan is
    the API's for the model with weights on that batch, to the byte, and more than text alone holds. --images 0 plans
    the text alone."""
    config, per_image = VISION_LANGUAGE[family]
    path = _config_dir(tmp_path, family, config)
    argv = ("--hf-config", path, "--tokens", "64", "--target-batch", "64", "--device", "cpu", "--memory-limit", "40MiB", "--headroom", "0")
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv)
    assert code == 0, err
    assert data["plan"]["setting"]["images per sample"] == f"1 (3x56x56 pixels), {per_image} of the 64 tokens"

    made = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    model = getattr(transformers, config["architectures"][0])(made)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 297, (1, 64), generator=g)
    ids[0, :per_image] = 299
    labels = ids.clone()
    labels[0, :per_image] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.randn(1, 3, 56, 56, generator=g), "labels": labels}
    if family == "mistral3":
        batch["image_sizes"] = torch.tensor([[56, 56]])
    if family in ("gemma3", "paligemma"):
        batch["token_type_ids"] = (ids == 299).long()
    assert model(**batch).loss.isfinite()  # the batch is one the model takes
    reference = autotune.plan(model, [batch], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              loss_fn=lambda m, b: m(**b).loss, device="cpu", memory_limit="40MiB", headroom=0, verify=False, progress=False)
    assert 2 < reference.micro_batch < 64
    assert (data["plan"]["micro_batch"], data["plan"]["peak_memory"]) == (reference.micro_batch, reference.peak_memory)
    assert dict(reference.setting)["images per sample"] == f"1 (3x56x56 pixels), {per_image} of the 64 tokens"  # said for the API's batch too

    code, text, err = report(capsys, monkeypatch, tmp_path, *argv, "--images", "0")
    assert code == 0, err
    assert "images per sample" not in text["plan"]["setting"]
    assert text["plan"]["micro_batch"] > data["plan"]["micro_batch"]


def test_the_cli_refuses_images_a_batch_cannot_hold_and_says_when_it_plans_text_alone(capsys, monkeypatch, tmp_path):
    """Each in one line, exit 2, before a plan: two images a sample (LLaVA takes every image in one tensor, which a
    micro-batch cannot be cut from), a sample too short for its image, --tokens max and --images on a model of text or
    with MODEL. A Qwen2-VL config (its images' patches in one tensor) is planned on text alone, and a note says so;
    --images 1 for it is refused with the same reason."""
    llava = _config_dir(tmp_path, "llava", VISION_LANGUAGE["llava"][0])
    llama = _config_dir(tmp_path, "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TEXT})
    qwen = _config_dir(tmp_path, "qwen2vl", {
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "image_token_id": 299, "vision_start_token_id": 297,
        "video_token_id": 298, "torch_dtype": "float32",
        "text_config": {"model_type": "qwen2_vl_text", **_TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}},
        "vision_config": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2, "mlp_ratio": 2}})
    common = ("--target-batch", "64", "--device", "cpu", "--memory-limit", "40MiB", "--headroom", "0")
    cases = [
        ((llava, "--images", "2", "--tokens", "64"), "Invalid --images 2: LlavaForConditionalGeneration takes its images as one tensor"),
        ((llava, "--tokens", "16"), "Invalid --tokens 16: an image of LlavaForConditionalGeneration takes 16 tokens of the sample, which leaves no text; give --tokens 528"),
        ((llava, "--tokens", "max"), "--tokens max plans text samples; LlavaForConditionalGeneration's samples hold an image here: give --images 0"),
        ((llama, "--images", "1"), "Invalid --images 1: LlamaForCausalLM takes no images (its config has no vision tower)"),
        ((qwen, "--images", "1", "--tokens", "64"), "Invalid --images 1: Qwen2VLForConditionalGeneration takes every image's patches in one tensor"),
    ]
    for args, words in cases:
        code, _, err = report(capsys, monkeypatch, tmp_path, "--hf-config", *args, *common)
        assert code == 2 and err.count("\n") == 1 and words in err, (args, err)
    code, _, err = report(capsys, monkeypatch, tmp_path, "--demo", "--images", "1")
    assert code == 2 and err.count("\n") == 1 and "--images 1 shapes the model and batch of --hf-config" in err, err

    code, data, err = report(capsys, monkeypatch, tmp_path, "--hf-config", qwen, "--tokens", "64", *common)
    assert code == 0, err
    assert "images per sample" not in data["plan"]["setting"]
    assert any(n.startswith("planned on text alone (no image in the batch): Qwen2VLForConditionalGeneration takes every image's patches")
               for n in data["plan"]["notes"]), data["plan"]["notes"]
