"""The command line, run in-process through main(argv), and once as the installed script."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autotune
from autotune import Plan
from autotune.cli.main import main
from autotune.planning.report import equal_split


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "autotune"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_text_report(capsys):
    code, out, err = run(capsys, "report", "--demo")
    assert code == 0
    for section in ["Device", "Plan", "Memory at micro-batch", "Trials", "PyTorch Lightning", "Accelerate", "TrainingArguments", "DeepSpeed", "Keras 3"]:
        assert section in out
    steps = int(re.search(r"accumulation steps\s+(\d+)", out).group(1))
    assert steps > 1  # the demo shows accumulation at work
    assert "effective batch       256" in out
    for part in ["parameters", "gradients", "optimizer state", "activations", "per sample"]:
        assert part in out
    assert "real step at micro-batch" in err  # progress goes to stderr


def test_json_report_is_the_plan_plus_device_and_memory(capsys):
    code, out, _ = run(capsys, "report", "--demo", "--json")
    assert code == 0
    data = json.loads(out)
    plan = Plan.from_dict(data["plan"])
    assert plan.effective_batch == 256 and sum(plan.micro_batches) == 256
    assert data["device"]["device"] == "cpu" and data["device"]["total"] > 0
    mem = data["memory"]
    assert mem["parameters"] > 0 and mem["gradients"] == mem["parameters"]
    assert mem["optimizer_state"] == 2 * mem["parameters"]  # AdamW: two tensors per parameter
    assert data["cached"] is False


def test_per_sample_is_the_slope_of_the_plans_memory_line_in_text_json_and_plot(capsys, tmp_path, monkeypatch):
    from autotune.units import format_bytes

    code, out, _ = run(capsys, "report", "--demo", "--json")
    data = json.loads(out)
    plan = Plan.from_dict(data["plan"])
    # The slope of the memory line the plan chose its micro-batch by, at that micro-batch: its two
    # traces at 2 and 3 samples lie where the optimizer step's line is the peak, nearly flat.
    fixed, slope = plan.memory_curve.line_at(plan.micro_batch)
    assert plan.memory_curve(plan.micro_batch) - plan.memory_curve(plan.micro_batch - 1) == pytest.approx(slope, abs=1)
    assert 600 * 1024 < slope < 640 * 1024
    assert data["memory"]["per_sample"] == pytest.approx(slope)
    code, text, _ = run(capsys, "report", "--demo")
    assert re.search(r"per sample\s+(.+)", text).group(1).strip() == format_bytes(slope)
    import matplotlib.axes

    labels = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: labels.append(k.get("label")) or original(ax, *a, **k))
    assert main(["report", "--demo", "--plot", str(tmp_path / "memory.png")]) == 0
    assert f"estimated peak: {format_bytes(slope)} per sample at micro-batch {plan.micro_batch}" in labels  # as the text says


@pytest.mark.parametrize(
    "fmt, pattern",
    [
        ("lightning", r"accumulate_grad_batches=(\d+).*\n.*batch_size=(\d+)"),
        ("accelerate", r"gradient_accumulation_steps=(\d+)\)\n.*batch_size=(\d+)"),
        ("hf", r"per_device_train_batch_size=(\d+),\n\s+gradient_accumulation_steps=(\d+)"),
        ("keras", r"gradient_accumulation_steps=(\d+)\)\n.*batch_size=(\d+)"),
    ],
)
def test_each_format_gives_exactly_the_target(capsys, fmt, pattern):
    code, out, _ = run(capsys, "report", "--demo", "--format", fmt)
    assert code == 0
    a, b = map(int, re.search(pattern, out).groups())
    assert a * b == 256
    assert "Device" not in out  # just the config


@pytest.mark.parametrize("fmt", ["lightning", "accelerate", "hf", "keras"])
def test_each_python_format_pastes_as_valid_python(capsys, fmt):
    import ast

    code, out, _ = run(capsys, "report", "--demo", "--format", fmt)
    assert code == 0
    ast.parse(out)  # no literal `...,` among keyword arguments: it would be a SyntaxError where pasted


def test_deepspeed_format_is_valid_json(capsys):
    code, out, _ = run(capsys, "report", "--demo", "--format", "deepspeed", "--target-batch", "250")
    assert code == 0
    cfg = json.loads(out)
    assert cfg["train_batch_size"] == 250
    assert cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] == 250


def make_plan(target, micro, world=1):
    return Plan(
        micro_batch=micro, accumulation_steps=-(-target // world // micro), effective_batch=target, world_size=world,
        micro_batches=(micro,), lr=1.0, base_lr=1.0, lr_scale=1.0, lr_rule="none", base_batch=target,
        warmup_steps=None, bn_momentum=None, memory_limit=1, headroom=0.0, peak_memory=1, device="cpu", precision="fp32",
    )


def test_equal_split_is_exact_or_says_why():
    assert equal_split(make_plan(256, 64)) == (64, 4, None) or equal_split(make_plan(256, 64)).per_device == 64
    split = equal_split(make_plan(250, 64))
    assert (split.per_device, split.steps) == (50, 5)
    prime = equal_split(make_plan(251, 64))
    assert (prime.per_device, prime.steps) == (1, 251)
    assert "251 has no divisor between 1 and 64" in prime.note
    uneven = equal_split(make_plan(250, 64, world=4))
    assert uneven.per_device is None and "do not divide evenly over 4 devices" in uneven.note


def test_cache_answers_a_second_identical_run(capsys, cache_home):
    code, first, err1 = run(capsys, "report", "--demo")
    assert code == 0 and "real step" in err1
    code, second, err2 = run(capsys, "report", "--demo")
    assert code == 0
    assert "answered from the cache" in second and "real step" not in err2
    assert second.split("Plan", 1)[1] == first.split("Plan", 1)[1]
    code, third, err3 = run(capsys, "report", "--demo", "--no-cache")
    assert "answered from the cache" not in third and "real step" in err3
    # a different question is a different key
    code, other, err4 = run(capsys, "report", "--demo", "--target-batch", "128")
    assert "answered from the cache" not in other


def test_corrupt_cache_is_ignored_with_a_warning(capsys, cache_home):
    run(capsys, "report", "--demo")
    (entry,) = cache_home.glob("*.json")
    entry.write_text("{not json")
    code, out, err = run(capsys, "report", "--demo")
    assert code == 0 and "answered from the cache" not in out and "real step" in err
    said = [line for line in err.splitlines() if "cache" in line]
    assert len(said) == 1 and said[0].startswith("autotune: warning: ignoring the unreadable cache file")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["report", "nosuchmodule:build", "--input-shape", "4", "--target-batch", "8"], "importing nosuchmodule failed"),
        (["report", "torch.nn:Nope", "--input-shape", "4", "--target-batch", "8"], "has no callable 'Nope'"),
        (["report", "no-colon", "--input-shape", "4", "--target-batch", "8"], "write module:callable"),
        (["report", "--demo", "--input-shape", "3,a,2"], "Invalid --input-shape"),
        (["report", "--demo", "--input-shape", "2,32,32"], "The model failed on inputs of shape [(2, 32, 32)]"),
        (["report", "--demo", "--memory-limit", "lots"], "Invalid memory size 'lots'"),
        (["report", "--demo", "--target-batch", "0"], "Invalid --target-batch 0"),
        (["report", "--demo", "--headroom", "2"], "Invalid --headroom 2"),
        (["report", "torch.nn:Identity", "--input-shape", "4", "--target-batch", "8"], "no parameters"),
        (["report", "--demo", "--optimizer", "lion"], "invalid choice: 'lion'"),
        (["report"], "Missing MODEL"),
    ],
)
def test_usage_errors_exit_2_with_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    if "invalid choice" not in message:
        assert len(err.strip().splitlines()) == 1


def test_nothing_fits_exits_1_with_the_numbers(capsys):
    code, _, err = run(capsys, "report", "--demo", "--memory-limit", "1MiB")
    assert code == 1
    assert re.search(r"needs (at least )?[\d.]+ MiB, the budget is [\d.]+ KiB", err)


def test_model_from_a_file_and_a_model_with_its_own_loss(capsys, tmp_path):
    (tmp_path / "my_model.py").write_text(
        "import torch\n"
        "class LM(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = torch.nn.Embedding(50, 16)\n"
        "        self.out = torch.nn.Linear(16, 50)\n"
        "    def forward(self, tokens):\n"
        "        return self.out(self.emb(tokens))\n"
        "class WithLoss(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 1)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x).pow(2).mean()\n"
        "def make_lm():\n    return LM()\n"
        "def make_with_loss():\n    return WithLoss()\n"
    )
    code, out, _ = run(capsys, "report", f"{tmp_path}/my_model.py:make_lm", "--input-shape", "128", "--input-dtype", "long", "--vocab-size", "50", "--target-batch", "512", "--memory-limit", "8MiB", "--json")
    assert code == 0
    assert json.loads(out)["plan"]["effective_batch"] == 512
    code, out, _ = run(capsys, "report", f"{tmp_path}/my_model.py:make_with_loss", "--input-shape", "8", "--target-batch", "64", "--memory-limit", "1GiB", "--json")
    assert code == 0 and json.loads(out)["plan"]["micro_batch"] == 64


def test_loader_spec(capsys, tmp_path, monkeypatch):
    (tmp_path / "my_data.py").write_text(
        "import torch\n"
        "def batches():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(2)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = run(capsys, "report", "autotune.cli.demo:demo_model", "--loader", "my_data:batches", "--target-batch", "256", "--memory-limit", "64MiB", "--device", "cpu", "--json")
    assert code == 0
    assert json.loads(out)["plan"]["accumulation_steps"] > 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_planning_for_a_gpu_this_machine_lacks(capsys):
    code, out, _ = run(capsys, "report", "--demo", "--device", "cuda", "--memory-limit", "80GiB", "--target-batch", "4096")
    assert code == 0
    assert "estimate, not verified on a device" in out
    assert "set aside for the CUDA context" in out
    assert "real" not in out.split("Trials", 1)[1].split("Notes", 1)[0]
    code, out, _ = run(capsys, "report", "--demo", "--device", "cuda", "--memory-limit", "80GiB", "--target-batch", "4096",
                       "--cuda-context", "3GiB", "--json")
    assert code == 0
    assert json.loads(out)["plan"]["set_aside"] == [["the CUDA context", 3 * 2**30]]
    assert "AUTOTUNE_CUDA_CONTEXT" not in os.environ  # the flag holds for its command only
    code, _, err = run(capsys, "report", "--demo", "--device", "cuda", "--memory-limit", "80GiB", "--target-batch", "4096",
                       "--cuda-context", "big")
    assert code == 2 and "Invalid --cuda-context 'big'" in err and "--cuda-context 1GiB" in err
    code, _, err = run(capsys, "report", "--demo", "--device", "cuda", "--memory-limit", "")
    assert code == 2


def test_a_module_of_the_current_directory_is_found_as_python_m_finds_it(capsys, tmp_path, monkeypatch):
    """The ``autotune`` script's own directory, not the current one, starts its ``sys.path`` (``python -m autotune.cli`` has
    the current one): ``MODEL`` and ``--loader`` given as ``module:callable`` are looked for in the current directory too."""
    (tmp_path / "my_cnn.py").write_text("from autotune.cli.demo import demo_model as build\n")
    (tmp_path / "my_data.py").write_text(
        "import torch\ndef batches():\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(4)]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])  # as the script starts
    code, out, err = run(capsys, "report", "my_cnn:build", "--loader", "my_data:batches", "--target-batch", "32", "--memory-limit",
                         "64MiB", "--format", "hf")
    assert code == 0, err
    assert "per_device_train_batch_size" in out


def test_python_m_autotune_runs_the_command(tmp_path):
    import subprocess

    done = subprocess.run([sys.executable, "-m", "autotune", "report", "--demo", "--format", "hf"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "per_device_train_batch_size" in done.stdout and "Traceback" not in done.stderr


def test_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    code, _, _ = run(capsys, "report", "--demo", "--plot", str(path), "--format", "hf")
    assert code == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_gives_the_install_hint(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, _, err = run(capsys, "report", "--demo", "--plot", str(tmp_path / "m.png"))
    assert code == 2
    assert "pip install 'torch-autotune[plot]'" in err


def test_installed_script(tmp_path):
    script = shutil.which("autotune")
    if script is None:
        pytest.skip("the autotune script is not installed (pip install -e .)")
    env = {"XDG_CACHE_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([script, "report", "--demo", "--format", "deepspeed"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["train_batch_size"] == 256
    bad = subprocess.run([script, "report", "--demo", "--target-batch", "-3"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "Invalid --target-batch -3" in bad.stderr


# --- models people have: transformers built from configs (nothing downloaded) ----------------

HF = str(__import__("pathlib").Path(__file__).parent / "hf_models.py")
TEXT = ["--input-name", "input_ids", "--input-shape", "32", "--input-dtype", "long", "--vocab-size", "500",
        "--input-name", "attention_mask", "--input-shape", "32", "--input-dtype", "mask"]


@pytest.mark.parametrize(
    "factory, inputs",
    [
        ("gpt2", TEXT),
        ("bert", TEXT),
        ("vit", ["--input-name", "pixel_values", "--input-shape", "3,32,32"]),
        ("resnet", ["--input-shape", "3,32,32"]),
    ],
    ids=["gpt2", "bert", "vit", "resnet"],
)
def test_report_on_transformers_models(capsys, factory, inputs):
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "report", f"{HF}:{factory}", *inputs, "--target-batch", "64", "--memory-limit", "48MiB", "--json", "--no-cache")
    assert code == 0, err
    plan = Plan.from_dict(json.loads(out)["plan"])
    assert plan.effective_batch == 64 and 1 <= plan.micro_batch <= 64
    assert any(t.fits and not t.estimate and t.batch_size == plan.micro_batch for t in plan.trials)


# --- the cache: validated on read, keyed on what changes the answer ---------------------------


@pytest.mark.parametrize(
    "content",
    ["{}", '{"plan": null}', '{"plan": {"micro_batch": 8}, "extra": 1}', "[1, 2]"],
    ids=["empty", "null-plan", "partial", "list"],
)
def test_a_cache_entry_that_is_not_a_plan_is_a_warning_and_a_fresh_probe(capsys, cache_home, content):
    run(capsys, "report", "--demo")
    (entry,) = cache_home.glob("*.json")
    entry.write_text(content)
    code, out, err = run(capsys, "report", "--demo")
    assert code == 0 and "answered from the cache" not in out and "real step" in err
    assert [line for line in err.splitlines() if "cache" in line][0].startswith("autotune: warning: ignoring")


CORRUPTIONS = {
    "micro-batch-above-target": lambda d: d["plan"].update(micro_batch=4096, micro_batches=[4096], accumulation_steps=1),
    "negative-peak": lambda d: d["plan"].update(peak_memory=-5),
    "zero-limit": lambda d: d["plan"].update(memory_limit=0),
    "empty-memory": lambda d: d.update(memory={}),
    "memory-not-numbers": lambda d: d["memory"].update(parameters="big"),
    "device-a-string": lambda d: d.update(device="gpu"),
    "device-not-the-plans": lambda d: d["device"].update(device="gpu"),
}


@pytest.mark.parametrize("corrupt", list(CORRUPTIONS.values()), ids=list(CORRUPTIONS))
def test_a_cached_plan_with_impossible_numbers_is_discarded(capsys, cache_home, corrupt):
    run(capsys, "report", "--demo")
    (entry,) = cache_home.glob("*.json")
    data = json.loads(entry.read_text())
    corrupt(data)
    entry.write_text(json.dumps(data))
    code, out, err = run(capsys, "report", "--demo")
    assert code == 0 and "answered from the cache" not in out
    said = [line for line in err.splitlines() if "cache" in line]
    assert len(said) == 1 and said[0].startswith("autotune: warning: ignoring a cache entry that is not a sound plan")


def test_the_cache_key_covers_the_models_code(capsys, tmp_path):
    body = (
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(64, 64)\n"
        "        self.out = torch.nn.Linear(64, 10)\n"
        "    def forward(self, x):\n"
        "        return self.out(torch.relu(self.lin(x)))\n"
        "def make():\n    return Net()\n"
    )
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text(body.replace("torch.relu(self.lin(x))", "torch.relu(self.lin(x.repeat(1, 1)).repeat(1, 1) * x.exp()).exp()"))
    args = ["--input-shape", "64", "--target-batch", "4096", "--memory-limit", "4MiB", "--json"]
    _, a, _ = run(capsys, "report", f"{tmp_path}/a.py:make", *args)
    code, b, _ = run(capsys, "report", f"{tmp_path}/b.py:make", *args)
    assert code == 0 and json.loads(b)["cached"] is False  # same layers, other forward: not the same entry
    assert json.loads(a)["plan"]["micro_batch"] > json.loads(b)["plan"]["micro_batch"]


def test_the_cache_key_covers_autotunes_own_code(capsys, cache_home, monkeypatch, tmp_path):
    """A plan made by other code is not an answer: a checkout updated in place keeps its version number, so the key
    holds a hash of autotune's own source, which changes with any file's contents or name."""
    import hashlib

    from autotune.planning import cache

    package = Path(autotune.__file__).parent
    digest = hashlib.sha256()  # worked out here: every .py file, by its path under the package, then its bytes
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    assert cache.own_code() == digest.hexdigest()[:16]
    copy = tmp_path / "autotune"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert cache.source_hash(copy) == cache.own_code()
    step = copy / "step.py"
    step.write_text(step.read_text() + "\n")
    longer = cache.source_hash(copy)
    assert longer != cache.own_code()  # one byte more
    step.rename(copy / "steps.py")
    assert cache.source_hash(copy) not in (cache.own_code(), longer)  # the same bytes, another name

    run(capsys, "report", "--demo")
    _, again, _ = run(capsys, "report", "--demo")
    assert "answered from the cache" in again
    monkeypatch.setattr(cache, "own_code", lambda: "other code")
    code, other, err = run(capsys, "report", "--demo")
    assert code == 0 and "answered from the cache" not in other and "real step" in err


def test_the_cache_key_covers_the_free_memory_when_no_limit_is_given(capsys, monkeypatch):
    import autotune.memory
    import autotune.planning.planner

    free = {"bytes": 8 * 2**30}
    monkeypatch.setattr(autotune.memory.device, "default_limit", lambda device, held: free["bytes"])
    monkeypatch.setattr(autotune.planning.planner, "default_limit", lambda device, held: free["bytes"])
    _, first, _ = run(capsys, "report", "autotune.cli.demo:demo_model", "--input-shape", "3,32,32", "--target-batch", "1024", "--device", "cpu", "--json")
    free["bytes"] = 8 * 2**30 + 5 * 2**20  # a small fluctuation: the same entry
    _, again, _ = run(capsys, "report", "autotune.cli.demo:demo_model", "--input-shape", "3,32,32", "--target-batch", "1024", "--device", "cpu", "--json")
    assert json.loads(again)["cached"] is True
    free["bytes"] = 40 * 2**20  # far less free memory: a fresh probe with a smaller answer
    _, small, _ = run(capsys, "report", "autotune.cli.demo:demo_model", "--input-shape", "3,32,32", "--target-batch", "1024", "--device", "cpu", "--json")
    assert json.loads(small)["cached"] is False
    assert json.loads(small)["plan"]["micro_batch"] < json.loads(first)["plan"]["micro_batch"]
    assert json.loads(small)["plan"]["memory_limit"] <= 40 * 2**20


def test_nothing_fits_names_command_line_flags(capsys):
    code, _, err = run(capsys, "report", "--demo", "--memory-limit", "1MiB")
    assert code == 1
    assert "--precision bf16" in err and "--memory-limit" in err and "precision='bf16'" not in err
    assert "What if" not in err
    code, _, err = run(capsys, "report", "--demo", "--memory-limit", "1MiB", "--what-if", "--no-cache")
    table = err.split("What if (estimates)\n", 1)[1].splitlines()
    assert code == 1 and table[0].split()[:3] == ["autocast", "checkpointing", "optimizer"]
    micro = [int(re.search(r"\s(\d+)\s+[\d.]+ (?:B|KiB|MiB|GiB)\s", line).group(1)) for line in table[1:]]
    assert len(micro) >= 4 and set(micro) == {0}  # every row estimated, none fits: the table the message points to


def test_micro_batch_by_length(capsys, tmp_path):
    pytest.importorskip("transformers")
    args = ["report", f"{HF}:gpt2", *TEXT, "--target-batch", "512", "--memory-limit", "64MiB", "--lengths", "16,32,128", "--no-cache"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)$", out.split("Micro-batch by length", 1)[1].split("Trials", 1)[0], flags=re.M)
    micro = {int(length): int(m) for length, m, _ in rows}
    assert list(micro) == [16, 32, 128] and micro[16] > micro[32] > micro[128]
    path = tmp_path / "lengths.png"
    code, out, _ = run(capsys, *args, "--json", "--plot", str(path))
    data = json.loads(out)
    assert [r["length"] for r in data["micro_batch_by_length"]] == [16, 32, 128]
    # the synthetic batch holds ids, mask and targets of 32 tokens each
    assert Plan.from_dict(data["plan"]).micro_batch_for(3 * 32) == data["micro_batch_by_length"][1]["micro_batch"]
    assert code == 0 and path.read_bytes()[:4] == b"\x89PNG"
    code, _, err = run(capsys, "report", "--demo", "--lengths", "16,x")
    assert code == 2 and "Invalid --lengths '16,x'" in err


def test_what_if_table_and_checkpointing_flag(capsys):
    code, out, err = run(capsys, "report", "--demo", "--what-if", "--json", "--no-cache")
    assert code == 0, err
    rows = json.loads(out)["what_if"]["rows"]
    assert len(rows) == 8 and rows[0]["verified"] and rows[0]["changes"] == 0
    assert {(r["precision"], r["checkpointing"]) for r in rows} == {("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)}
    code, out, _ = run(capsys, "report", "--demo", "--checkpointing", "--json", "--no-cache")
    assert code == 0 and json.loads(out)["plan"]["checkpointing"] is True


def test_the_what_if_title_names_a_verified_row_only_where_one_ran(capsys):
    """The demo's plan runs a real step on the CPU: its own row is verified, and the title says so; an estimate for a
    card runs none, and its title says estimates alone."""
    for argv, verified in ((("--demo",), True), (("--demo", "--gpu", "l4"), False)):
        code, out, err = run(capsys, "report", *argv, "--what-if", "--no-cache")
        assert code == 0, err
        title = next(line for line in out.splitlines() if line.startswith("What if"))
        assert (title == "What if (estimates; the verified row ran for real)") == verified
        assert (title == "What if (estimates)") == (not verified)
        assert any(line.rstrip().endswith(" verified") for line in out.split(title, 1)[1].splitlines()) == verified


def test_noise_scale_line_needs_a_loader_and_gives_advice(capsys, tmp_path, monkeypatch):
    code, _, err = run(capsys, "report", "--demo", "--noise-scale")
    assert code == 2 and "--noise-scale measures gradients on real data: give --loader" in err
    (tmp_path / "noisy_data.py").write_text(
        "import torch\n"
        "def batches():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(8)]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run(capsys, "report", "autotune.cli.demo:demo_model", "--loader", "noisy_data:batches", "--target-batch", "4096",
                         "--memory-limit", "128MiB", "--device", "cpu", "--noise-scale", "--json", "--no-cache")
    assert code == 0, err
    noise = json.loads(out)["noise_scale"]
    assert noise is None or (noise["value"] > 0 and noise["steps"] >= 2)
    code, out, err = run(capsys, "report", "autotune.cli.demo:demo_model", "--loader", "noisy_data:batches", "--target-batch", "4096",
                         "--memory-limit", "128MiB", "--device", "cpu", "--noise-scale", "--no-cache")
    assert code == 0, err
    section = out.split("Gradient noise scale\n", 1)[1]
    assert "label tokens" not in section  # a class label a sample: the target's items are its samples, nothing to restate


def test_the_noise_scale_of_a_causal_lm_is_told_in_its_label_tokens_with_the_target_in_them(capsys, tmp_path, monkeypatch):
    """A causal LM's own loss averages its shifted label tokens, and the plan weighs micro-batches by them: the noise
    scale is measured in them (it was measured in samples), and the target compared with it is the target's tokens."""
    pytest.importorskip("transformers")
    (tmp_path / "lm_data.py").write_text(
        "import torch, transformers\n"
        "def model():\n"
        "    torch.manual_seed(0)\n"
        "    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64))\n"
        "def batches():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    out = []\n"
        "    for _ in range(12):\n"
        "        ids = torch.randint(0, 100, (8, 24), generator=g)\n"
        "        mask = (torch.arange(24) < torch.randint(3, 25, (8, 1), generator=g)).long()\n"
        "        out.append({'input_ids': ids, 'attention_mask': mask, 'labels': ids.masked_fill(mask == 0, -100)})\n"
        "    return out\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import lm_data

    batches = lm_data.batches()[:8]  # the batches the target's tokens are counted on
    tokens = sum(int(b["labels"][:, 1:].ne(-100).sum()) for b in batches) / sum(len(b["labels"]) for b in batches)
    argv = ("report", "lm_data:model", "--loader", "lm_data:batches", "--target-batch", "64", "--memory-limit", "256MiB",
            "--device", "cpu", "--noise-scale", "--no-cache")
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["items"] == "shifted labels"
    noise = data["noise_scale"]
    assert noise["items"] == "shifted labels" and noise["target_items"] == round(64 * tokens)
    assert noise["micro_batch"] * 4 * 30 <= 12 * 8 or noise["micro_batch"] == 1  # one pass holds the windows asked
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    section = out.split("Gradient noise scale\n", 1)[1].splitlines()
    assert section[0] == (f"  in label tokens shifted by one position (labels[..., 1:] != -100), what the loss averages over: the target "
                          f"of 64 samples is ~{round(64 * tokens):,} of them")


def test_a_ramp_in_the_report_says_what_each_stage_takes(capsys):
    code, out, _ = run(capsys, "report", "--demo", "--ramp", "64,128@5000,256@20000", "--samples", "40000", "--no-cache")
    assert code == 0
    plan = Plan.from_dict(json.loads(run(capsys, "report", "--demo", "--json", "--no-cache")[1])["plan"])
    micro = plan.micro_batch
    lines = out.split("Batch ramp (")[1].splitlines()[1:4]
    for line, (target, start, end) in zip(lines, [(64, 0, 5000), (128, 5000, 20000), (256, 20000, 40000)]):
        k = -(-target // micro)
        assert line.strip().startswith(f"{target} per step from {start:,} to {end:,} samples: {k} micro-batch")
        assert line.endswith(f"{-(-(end - start) // target):,} steps")
    code, _, err = run(capsys, "report", "--demo", "--ramp", "64,128@5000")
    assert code == 2 and "its largest target is 128, and --target-batch is 256" in err
    code, out, _ = run(capsys, "report", "--demo", "--ramp", "adaptive:32", "--json", "--no-cache")
    assert json.loads(out)["ramp"]["stages"][-1].startswith("raised to the largest at or below the noise scale / 3 and its range's lower end")


def test_a_ramp_takes_counts_as_people_write_them_and_the_adaptive_options(capsys):
    """``2e4`` and ``2_000`` for sample counts (once a raw int() message), and the adaptive form's factor,
    margin, windows and learning-rate coupling; a bad count or option named with the forms that work."""
    code, out, _ = run(capsys, "report", "--demo", "--ramp", "64,128@5e3,256@2e4", "--samples", "4e4", "--no-cache")
    assert code == 0 and "128 per step from 5,000 to 20,000 samples" in out
    code, out, _ = run(capsys, "report", "--demo", "--ramp", "adaptive:32,factor=4,margin=3,windows=5", "--json", "--no-cache")
    assert code == 0 and json.loads(out)["ramp"]["spec"] == "BatchRamp.adaptive(32, 256, factor=4, margin=3, windows=5, unit='samples')"
    code, out, _ = run(capsys, "report", "--demo", "--ramp", "adaptive:32,margin=2,lr=linear", "--json", "--no-cache")
    assert code == 0 and json.loads(out)["ramp"]["spec"] == "BatchRamp.adaptive(32, 256, factor=2, margin=2, windows=10, unit='samples', lr='linear')"
    for spec, says in (("64,256@2.5e3x", "'2.5e3x' is not a count"), ("64,256@1.5", "'1.5' is not a whole number"),
                       ("adaptive:32,speed=2", "'speed=2' is not an option of the adaptive ramp (factor=, margin=, windows=, lr=)"),
                       ("adaptive:32,lr=sqrt", "Invalid lr 'sqrt': use 'follow'")):
        code, _, err = run(capsys, "report", "--demo", "--ramp", spec)
        assert code == 2 and says in err and "adaptive:START[,factor=2][,margin=3][,windows=10][,lr=peak]" in err, err
    code, _, err = run(capsys, "report", "--demo", "--ramp", "64,256@100", "--samples", "1.5e2.0")
    assert code == 2 and "invalid count '1.5e2.0'" in err


def test_a_reader_that_stops_early_gets_no_error_line(tmp_path):
    """``autotune report ... | head``: the pipe's reader gone, the command stops without a traceback or an error line."""
    script = shutil.which("autotune")
    if script is None:
        pytest.skip("the autotune script is not installed")
    read, write = os.pipe()
    os.close(read)  # gone before anything is written
    try:
        done = subprocess.run([script, "report", "--demo", "--no-cache"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    finally:
        os.close(write)
    assert done.returncode == 1 and "error" not in done.stderr and "Traceback" not in done.stderr, done.stderr
