"""Every bad input gets a clear error before anything changes: the model, the optimizer state, the
gradients, the learning rates, the RNG and the loader's shuffling order are as they were."""

import re
import warnings

import pytest
import torch
from bad_inputs import API, CLI, MODELS_FILE, Setup

import autotune
from autotune.cli.main import main


@pytest.mark.parametrize("case", API, ids=[c.what for c in API])
def test_bad_input_raises_a_clear_error_and_changes_nothing(case):
    s = Setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(case.error, match=case.match):
            case.call(s)
    assert s.unchanged(case.kept), f"{case.what}: something changed before the error"


@pytest.fixture
def cli_files(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "bad_models.py").write_text(MODELS_FILE)
    return tmp_path


@pytest.mark.parametrize("what, argv, code, message", CLI, ids=[c[0] for c in CLI])
def test_bad_command_line_exits_with_one_line(what, argv, code, message, cli_files, capsys):
    if "cuda" in argv and torch.cuda.is_available() and "80GiB" not in argv:
        pytest.skip("this machine has CUDA")
    argv = [a.replace("{models}", str(cli_files / "bad_models.py")).replace("{tmp}", str(cli_files)) for a in argv]
    got = main(argv)
    err = capsys.readouterr().err
    assert got == code, err
    assert message in err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if code == 1:  # the probe's progress lines come first
        lines = [line for line in lines if not line.startswith("autotune: real step") and not line.startswith("autotune: estimate")]
    if "invalid choice" not in message and "invalid value" not in message:  # argparse prints its usage line first
        assert len(lines) == 1, err


def test_the_docs_table_lists_every_case():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    for case in API:
        assert case.what in text, case.what
    for what, *_ in CLI:
        assert what in text, what
    assert len(API) + len(CLI) >= 40
    assert len(re.findall(r"^\| \d+ \|", text, flags=re.M)) >= len(API) + len(CLI)


def test_an_error_raised_by_your_model_keeps_its_type_and_says_where_it_came_from():
    """A model that cannot take the loader's inputs: the model's own error (its type and message
    untouched), with a note saying which of autotune's steps ran it and that nothing changed."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = [(torch.randn(8, 8), torch.randint(0, 3, (8,)))] * 4
    bad = [(torch.randn(8, 5), torch.randint(0, 3, (8,)))] * 4
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as planned:
        autotune.plan(model, bad, target_batch=16, optimizer=opt, progress=False, memory_limit="64MiB")
    assert any(n.startswith("autotune: raised by the model or the loss in a planning trial") for n in planned.value.__notes__)
    plan = autotune.plan(model, good, target_batch=16, optimizer=opt, progress=False, memory_limit="64MiB")
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied") as fitted:
        autotune.fit(model, bad, plan=plan, optimizer=opt, progress=False, memory_limit="64MiB")
    assert any(n.startswith("autotune: raised by the model or the loss in the check before training") and "per-sample shapes [(5,), ()]" in n
               for n in fitted.value.__notes__), fitted.value.__notes__
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
