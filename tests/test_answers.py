"""An answer says what it answered: the question and its assumptions echoed at the top of the report (text and
JSON), bad values refused before anything runs, every head of a config planned with the labels its loss needs."""

import json
import math
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
from test_meta import report, write_config  # noqa: E402

from autotune.cli.main import main  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

SMALL_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
               "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 500,
               "max_position_embeddings": 256, "torch_dtype": "bfloat16"}
COMMON = ("--target-batch", "8", "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64")


def text_report(capsys, monkeypatch, tmp_path, *argv):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = main(["report", *argv, "--no-cache"])
    out, err = capsys.readouterr()
    return code, out, err


def parameter_count():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in SMALL_LLAMA.items() if k not in ("architectures", "torch_dtype")})
    return sum(p.numel() for p in LlamaForCausalLM(config).parameters())


@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
def test_the_answer_begins_with_the_question_it_answered(kind, capsys, monkeypatch, tmp_path):
    config = dict(SMALL_LLAMA)
    flags = ["--precision", "bf16"]
    if kind in ("lora", "qlora"):
        flags += ["--lora", "8"]
    if kind == "qlora":
        pytest.importorskip("bitsandbytes")
        config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                         "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"}
    path = write_config(tmp_path, config)
    code, data, err = report(capsys, monkeypatch, tmp_path, "--hf-config", path, *COMMON, *flags)
    assert code == 0, err
    setting = data["plan"]["setting"]
    total = parameter_count()
    assert setting["model"] == "LlamaForCausalLM" and setting["tokens per sample"] == "64" and setting["device"] == "cuda"
    assert setting["parameters"].startswith(f"{total:,} total") if kind == "full" else f"{total:,} total" not in setting["parameters"]
    if kind == "full":
        assert setting["parameters"] == f"{total:,} total, {total:,} trained"
        assert setting["weights"].startswith("pure bf16") and "adapters" not in setting and "quantization" not in setting
    else:
        # PEFT's default for Llama adapts the query and value projections only: said, as the adapters a user gets
        assert setting["adapters"] == "LoRA rank 8, alpha 8, on q_proj, v_proj"
        lora = 2 * (2 * 8 * 64 + 8 * 64 + 8 * 32)  # per layer: q_proj 64->64 and v_proj 64->32 (2 key-value heads of 16)
        # the adapters train in fp32 (PEFT's default) under bf16 autocast; the frozen weights the config's bf16, alone
        assert setting["weights"] == "fp32 master weights under bf16 autocast (trained weights and their gradients fp32); untrained weights bf16"
        assert setting["parameters"].endswith(f", {lora:,} trained")
    if kind == "qlora":
        assert setting["quantization"].startswith("bitsandbytes nf4, double quantization, compute bfloat16")
    assert setting["optimizer"] == "AdamW (torch, fused)" and setting["checkpointing"] == "off" and setting["attention"] == "sdpa"
    code, text, err = text_report(capsys, monkeypatch, tmp_path, "--hf-config", path, *COMMON, *flags)
    assert code == 0, err
    head = text.split("\n\n")[0].splitlines()
    assert head[0] == "Setting (what was planned)"
    assert [line.split(None, 1)[0] for line in head[1:3]] == ["model", "parameters"]
    for what, value in setting.items():
        assert any(line.strip() == f"{what:<22}{value}".strip() for line in head), (what, value, head)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_token_count_below_one_is_refused_by_value(value, capsys, monkeypatch, tmp_path):
    code, _, err = report(capsys, monkeypatch, tmp_path, "--hf-config", write_config(tmp_path, SMALL_LLAMA), "--target-batch", "8",
                          "--device", "cuda", "--memory-limit", "1GiB", "--tokens", value)
    assert code == 2 and f"Invalid --tokens {value}" in err and "at least 1" in err and "Traceback" not in err


def test_a_token_count_that_is_not_an_integer_is_refused(capsys, monkeypatch, tmp_path):
    code, _, err = report(capsys, monkeypatch, tmp_path, "--hf-config", write_config(tmp_path, SMALL_LLAMA), "--target-batch", "8",
                          "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "2k")
    assert code == 2 and "--tokens" in err and "'2k'" in err


BERT_CLASSIFIER = {"architectures": ["BertForSequenceClassification"], "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 500, "max_position_embeddings": 128,
                   "num_labels": 3}
T5_SMALL = {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
            "num_heads": 4, "vocab_size": 500, "decoder_start_token_id": 0, "pad_token_id": 0}
BERT_TOKENS = {**BERT_CLASSIFIER, "architectures": ["BertForTokenClassification"]}
BERT_MLM = {**BERT_CLASSIFIER, "architectures": ["BertForMaskedLM"]}


@pytest.mark.parametrize("config, head", [(BERT_CLASSIFIER, "BertForSequenceClassification"), (BERT_TOKENS, "BertForTokenClassification"),
                                          (BERT_MLM, "BertForMaskedLM"), (T5_SMALL, "T5ForConditionalGeneration")],
                         ids=["sequence-classification", "token-classification", "masked-lm", "t5"])
def test_every_head_from_a_config_plans_with_the_labels_its_loss_needs(config, head, capsys, monkeypatch, tmp_path):
    code, data, err = report(capsys, monkeypatch, tmp_path, "--hf-config", write_config(tmp_path, config), "--target-batch", "16",
                             "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64")
    assert code == 0, err
    assert data["plan"]["setting"]["model"] == head and data["plan"]["micro_batch"] >= 1 and data["plan"]["peak_memory"] > 0
    # the same model on the CPU, built here with its weights, takes a step on such labels: the loss the plan ran is real
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config.items() if k != "architectures"})
    model = getattr(transformers, head)(cfg)
    ids = torch.randint(0, 500, (2, 16))
    labels = {"BertForSequenceClassification": torch.randint(0, 3, (2,)), "BertForTokenClassification": torch.randint(0, 3, (2, 16))}
    out = model(input_ids=ids, labels=labels.get(head, ids))
    assert out.loss.isfinite()


def test_an_unknown_architecture_is_refused_whole_with_the_fix(capsys, monkeypatch, tmp_path):
    config = {**SMALL_LLAMA, "architectures": ["LlamaForSomethingNobodyWroteWithAVeryLongNameThatGoesOnAndOnForQuiteAWhile"]}
    folder = tmp_path / ("a-deep-folder-" * 12)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    code, _, err = report(capsys, monkeypatch, tmp_path, "--hf-config", str(folder), *COMMON)
    assert code == 2 and "Traceback" not in err
    line = err.strip()
    assert line.endswith('upgrade transformers, or set "architectures" to one it has (e.g. LlamaForCausalLM)'), line
    assert "LlamaForSomethingNobodyWroteWithAVeryLongNameThatGoesOnAndOnForQuiteAWhile" in line


def test_no_learning_rate_is_written_that_nobody_gave(capsys, monkeypatch, tmp_path):
    path = write_config(tmp_path, SMALL_LLAMA)
    argv = ["--hf-config", path, "--target-batch", "128", "--device", "cuda", "--memory-limit", "1GiB", "--tokens", "64"]
    for fmt in ("hf", "lightning", "accelerate", "keras", "deepspeed"):
        code, out, err = text_report(capsys, monkeypatch, tmp_path, *argv, "--format", fmt)
        assert code == 0, err
        assert "0.001" not in out and "0.002" not in out and "learning_rate=0" not in out and '"lr"' not in out, (fmt, out)
        if fmt != "deepspeed":
            assert "your rate tuned at batch 32 x2 (sqrt rule, to batch 128)" in out, (fmt, out)  # --base-batch's default
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv)
    assert data["learning_rate"] == {"given": False, "rule": "sqrt", "scale": pytest.approx(2.0), "base_batch": 32}
    code, out, err = text_report(capsys, monkeypatch, tmp_path, *argv, "--format", "hf", "--lr", "2e-5", "--base-batch", "8")
    assert code == 0 and "learning_rate=8e-05," in out  # given: scaled by the rule from batch 8 to 128, sqrt(16) = 4
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv, "--lr", "2e-5")
    assert "learning_rate" not in data and data["plan"]["lr"] == pytest.approx(2e-5 * 2)


def test_a_limit_a_little_above_what_the_device_reports_is_the_device_s_total_with_a_note():
    import autotune
    from autotune.memory.device import device_memory

    total = device_memory(torch.device("cpu")).total
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    loader = [(torch.randn(4, 8), torch.randint(0, 2, (4,)))]
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    plan = autotune.plan(model, loader, target_batch=8, loss_fn=loss, memory_limit=int(total * 1.02), progress=False)
    assert plan.memory_limit == total
    assert any("is above what this cpu reports" in n and "planned with the device's total" in n for n in plan.notes), plan.notes
    with pytest.raises(ValueError, match="Invalid memory_limit .*: this cpu has .*; give at most that"):
        autotune.plan(model, loader, target_batch=8, loss_fn=loss, memory_limit=int(total * 1.2), progress=False)


@pytest.mark.slow  # the 8B shape: the plan, then each row of what would fit estimated (half a minute)
def test_when_nothing_fits_the_8b_full_fine_tune_hears_what_would_never_sgd_never_a_flag_it_gave(capsys, monkeypatch, tmp_path):
    pytest.importorskip("bitsandbytes")
    from test_meta import LLAMA_3_8B_CONFIG

    argv = ("--hf-config", write_config(tmp_path, LLAMA_3_8B_CONFIG), "--target-batch", "64", "--device", "cuda", "--memory-limit",
            "80GiB", "--precision", "bf16", "--tokens", "2048", "--optimizer", "adamw_torch_fused")
    code, _, err = report(capsys, monkeypatch, tmp_path, *argv)
    assert code == 1 and "Traceback" not in err
    message = err.split("autotune: nothing fits: ", 1)[1]
    head, *rows = message.strip().splitlines()
    assert "held: weights 14.96 GiB, gradients 14.96 GiB, optimizer state 29.92 GiB" in head  # 8.03e9 x 2, x 2, x 4 bytes
    fitting = [r for r in rows if "micro-batch" in r]
    changes = [r.split("micro-batch")[0].strip() for r in fitting]
    assert "--checkpointing" in changes and "--lora 16 --lora-modules all-linear" in changes
    shard = next(r for r in fitting if r.strip().startswith("--shard"))
    assert "the fewest that fit" in shard
    assert "sgd" not in message.lower()
    for given in ("--precision", "--tokens 2048", "--optimizer adamw_torch_fused", "--memory-limit 80GiB"):
        assert not any(given in c for c in changes), (given, changes)
    assert any(r.strip().startswith("--tokens max") and "below 2048 tokens" in r for r in rows)  # shorter samples: another value
    # each row is a promise: the command with its flags fits (the cheapest, and LoRA)
    for flags in ("--checkpointing", "--lora 16 --lora-modules all-linear"):
        code, data, err = report(capsys, monkeypatch, tmp_path, *argv, *flags.split())
        row = next(r for r in fitting if r.split("micro-batch")[0].strip() == flags)
        assert code == 0 and data["plan"]["micro_batch"] == int(row.split("micro-batch")[1].split()[0]), (flags, err)


LLAMA_3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
               "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8, "vocab_size": 128256,
               "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}


@pytest.mark.slow  # the 70B shape estimated twice (a quarter of a minute)
def test_shard_auto_finds_the_fewest_devices_the_70b_full_fine_tune_fits_on(capsys, monkeypatch, tmp_path):
    argv = ("--hf-config", write_config(tmp_path, LLAMA_3_70B), "--target-batch", "32", "--device", "cuda", "--memory-limit", "80GiB",
            "--tokens", "4096", "--precision", "bf16", "--checkpointing")
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv, "--shard", "auto")
    assert code == 0 and data["fewest"], err
    fewest = data["fsdp2"]["ranks"]
    assert data["fsdp2"]["fits"] and data["fsdp2"]["peak"] <= data["fsdp2"]["budget"] and 8 < fewest <= 32
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv, "--shard", str(fewest - 1))
    assert code == 1 and not data  # one device fewer: does not fit (the JSON of a shard plan that does not fit exits 1)
    code, _, err = report(capsys, monkeypatch, tmp_path, *argv, "--shard", "many")
    assert code == 2 and "--shard" in err and "auto" in err


@pytest.mark.slow  # the 8B shape planned at several lengths (about a minute)
def test_tokens_max_is_the_longest_sample_the_8b_lora_fits_at_micro_batch_1(capsys, monkeypatch, tmp_path):
    from test_meta import LLAMA_3_8B_CONFIG

    argv = ("--hf-config", write_config(tmp_path, LLAMA_3_8B_CONFIG), "--target-batch", "16", "--device", "cuda", "--memory-limit",
            "24GiB", "--precision", "bf16", "--checkpointing", "--lora", "16")
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv, "--tokens", "max")
    assert code == 0, err
    longest = data["tokens"]["per_sample"]
    assert data["plan"]["micro_batch"] == 1 and 1024 < longest < 8192
    assert any(n.startswith(f"--tokens max: {longest} tokens a sample is the longest") for n in data["plan"]["notes"])
    code, data, err = report(capsys, monkeypatch, tmp_path, *argv, "--tokens", str(longest))
    assert code == 0 and data["plan"]["micro_batch"] == 1, err
    code, _, err = report(capsys, monkeypatch, tmp_path, *argv, "--tokens", str(math.ceil(longest * 1.1)))
    assert code == 1 and "nothing fits" in err


def test_a_model_from_a_file_quantized_on_the_command_line_plans_and_verifies_on_the_cpu(capsys, monkeypatch, tmp_path):
    """``--quantize nf4 --lora`` on a model of the user's: its first forward (which makes the targets) runs in training
    mode, as bitsandbytes repacks a quantized layer's CPU weights in place for inference (and needs its rows in blocks
    of 32 then); the plan's real trial then runs the 4-bit layers."""
    pytest.importorskip("bitsandbytes")
    (tmp_path / "my_mlp.py").write_text(
        "import torch\n"
        "class MLP(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.up = torch.nn.Linear(64, 256)\n"
        "        self.down = torch.nn.Linear(256, 10)\n"
        "    def forward(self, x):\n"
        "        return self.down(torch.relu(self.up(x)))\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return MLP()\n"
    )
    code, data, err = report(capsys, monkeypatch, tmp_path, f"{tmp_path}/my_mlp.py:make", "--input-shape", "64", "--target-batch", "256",
                             "--memory-limit", "2MiB", "--quantize", "nf4", "--lora", "8", "--lora-modules", "up,down")
    assert code == 0, err
    setting = data["plan"]["setting"]
    assert setting["quantization"].startswith("bitsandbytes nf4") and setting["adapters"] == "LoRA rank 8, alpha 8, on down, up"
    assert data["plan"]["verified"] and any(not t["estimate"] for t in data["plan"]["trials"])


def _raw_json(capsys, monkeypatch, tmp_path, *argv):
    """The exit code, stdout parsed as JSON (None when empty) and stderr of ``report ... --json``, whatever the code."""
    code, out, err = text_report(capsys, monkeypatch, tmp_path, *argv, "--json")
    return code, (json.loads(out) if out.strip() else None), err


def test_when_nothing_fits_the_answer_still_begins_with_the_question_text_and_json(capsys, monkeypatch, tmp_path):
    path = write_config(tmp_path, SMALL_LLAMA)
    asked = ("--hf-config", path, "--target-batch", "8", "--device", "cuda", "--tokens", "64", "--cuda-context", "1B")
    code, fits, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--memory-limit", "1GiB")
    assert code == 0, err
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--memory-limit", "1MiB")
    assert code == 1 and "autotune: nothing fits: " in err and "Traceback" not in err
    # the same question in the same words as the plan of the same command that fits
    assert data["plan"] is None and data["setting"] == fits["plan"]["setting"]
    device = data["device"]
    assert device["limit"] == 2**20 and device["set_aside"] == [{"for": "the CUDA context", "bytes": 1}]
    assert device["budget"] == int((2**20 - 1) * (1 - device["headroom"])) < data["nothing_fits"]["needed"]
    # what would fit: the rows of the message, flag for flag, and the whole table
    listed = [line.split("micro-batch")[0].strip() for line in data["nothing_fits"]["message"].splitlines()[1:] if "micro-batch" in line]
    assert [w["flags"] for w in data["would_fit"]] == listed
    assert data["what_if"]["budget"] == device["budget"] and data["what_if"]["rows"][0]["changes"] == 0
    code, text, err = text_report(capsys, monkeypatch, tmp_path, *asked, "--memory-limit", "1MiB")
    assert code == 1 and "autotune: nothing fits: " in err
    setting, device_lines = text.split("\n\n")[:2]
    assert setting.splitlines()[0] == "Setting (what was planned)"
    assert len(setting.splitlines()) == len(fits["plan"]["setting"]) + 1
    assert device_lines.splitlines()[0] == "Device" and device_lines.splitlines()[-1].split()[0] == "budget"


def test_a_cuda_estimate_whose_tensors_fit_but_not_the_allocator_says_so_never_a_need_below_the_budget(capsys, monkeypatch, tmp_path):
    path = write_config(tmp_path, SMALL_LLAMA)
    asked = ("--hf-config", path, "--target-batch", "8", "--device", "cuda", "--tokens", "64", "--cuda-context", "1B")
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--memory-limit", "4MiB")
    assert code == 1, err
    said = data["nothing_fits"]
    budget = data["device"]["budget"]
    assert said["needed"] > budget  # what is said to be needed is more than the budget, as "nothing fits" means
    tensors = float(said["message"].split("(its tensors: ")[1].split(" MiB")[0]) * 2**20
    assert tensors <= budget and "reserved by CUDA's caching allocator" in said["message"]


def test_a_sharded_answer_begins_with_the_question_as_the_unsharded_one(capsys, monkeypatch, tmp_path):
    path = write_config(tmp_path, SMALL_LLAMA)
    code, plan, err = _raw_json(capsys, monkeypatch, tmp_path, "--hf-config", path, *COMMON)
    assert code == 0, err
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, "--hf-config", path, *COMMON, "--shard", "2")
    assert code == 0 and data["setting"] == plan["plan"]["setting"], err
    code, text, err = text_report(capsys, monkeypatch, tmp_path, "--hf-config", path, *COMMON, "--shard", "2")
    head, rest = text.split("\n\n", 1)
    assert code == 0 and head.splitlines()[0] == "Setting (what was planned)" and len(head.splitlines()) == len(data["setting"]) + 1
    assert rest.startswith("FSDP2 over 2 devices")


def test_a_shard_count_that_does_not_fit_hears_what_would_each_row_a_command_that_fits(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:1")  # cuBLAS's workspace (each rank holds one) small for the 2 MiB cards
    path = write_config(tmp_path, SMALL_LLAMA)
    asked = ("--hf-config", path, "--target-batch", "8", "--device", "cuda", "--tokens", "64", "--cuda-context", "1B",
             "--memory-limit", "2MiB")
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--shard", "2")
    assert code == 1 and not data["fsdp2"]["fits"], err
    rows = {w["flags"]: w["fsdp2"] for w in data["would_fit"]}
    assert set(rows) == {"--shard 3", "--checkpointing --shard 2"}  # more devices as asked; checkpointing on as many
    for flags, row in rows.items():
        code, again, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, *flags.split())
        assert code == 0 and again["fsdp2"] == row and again["fsdp2"]["fits"], (flags, err)
    code, text, err = text_report(capsys, monkeypatch, tmp_path, *asked, "--shard", "2")
    assert code == 1 and text.rstrip().splitlines()[-2:] == [
        f"  {flags:<28} micro-batch {row['micro_batch']} per device over {row['ranks']} devices, {format_bytes(row['peak'])} a device"
        for flags, row in sorted(rows.items(), key=lambda r: r[1]["ranks"])
    ]


def test_when_nothing_fits_shorter_samples_are_named_and_tokens_max_finds_one_that_fits(capsys, monkeypatch, tmp_path):
    """The refusal names shorter samples, and ``--tokens max`` finds one that fits; its search asks only whether each
    length fits, so the lengths that do not are refused without the table of what would (built for the refusal the
    user reads: the table's estimates cost more than the search's own)."""
    import autotune.planning.planner as planner

    tables = []
    made = planner.estimate_rows
    monkeypatch.setattr(planner, "estimate_rows", lambda *a, **k: tables.append(k) or made(*a, **k))
    path = write_config(tmp_path, SMALL_LLAMA)
    asked = ("--hf-config", path, "--target-batch", "8", "--device", "cpu", "--memory-limit", "1.5MiB")
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--tokens", "64")
    assert code == 1, err
    line = next(x for x in data["nothing_fits"]["message"].splitlines() if x.strip().startswith("--tokens max"))
    assert "below 64 tokens" in line and len(tables) == 1
    code, data, err = _raw_json(capsys, monkeypatch, tmp_path, *asked, "--tokens", "max")
    assert code == 0 and data["plan"]["micro_batch"] == 1 and 16 <= data["tokens"]["per_sample"] < 64, err
    # each length tried is said before its estimates' lines: the answer's and the one above it that does not fit among them
    fit, miss = map(int, re.search(r"--tokens max: (\d+) tokens a sample is the longest .*\((\d+) tokens do not",
                                   " ".join(data["plan"]["notes"])).groups())
    tried = [int(n) for n in re.findall(r"^autotune: --tokens max: (\d+) tokens a sample, at micro-batch 1$", err, flags=re.M)]
    assert {fit, miss} <= set(tried), err
    lines = err.splitlines()
    assert lines[0].startswith("autotune: --tokens max: ") and any(line.startswith("autotune: estimate at micro-batch 1") for line in lines)
    assert len(tables) == 1  # lengths refused in the search (64 among them), none with a table
