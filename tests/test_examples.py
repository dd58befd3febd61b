"""The examples run as a user runs them, in a fresh process."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytest.importorskip("sklearn")


def run(name, *, stderr=False):
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, check=True, timeout=300)
    return (done.stdout, done.stderr) if stderr else done.stdout


def test_quickstart_accumulates_and_learns():
    out, err = run("quickstart.py", stderr=True)
    assert "Warning" not in err and "Traceback" not in err, err  # the first example a newcomer runs is quiet
    steps = int(re.search(r"accumulation_steps=(\d+)", out).group(1))
    assert steps > 1
    assert "effective_batch=256" in out
    assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.9


@pytest.mark.parametrize("name", ["hf_trainer.py", "lightning_callback.py", "accelerate_script.py"])
def test_the_trainer_examples_keep_the_target(name):
    pytest.importorskip({"hf_trainer.py": "transformers", "lightning_callback.py": "lightning", "accelerate_script.py": "accelerate"}[name])
    out = run(name)
    kept = re.search(r"(\d+) per device x (\d+) accumulation steps x 1 device\(s\) = (\d+) samples", out)
    micro, steps, target = map(int, kept.groups())
    assert steps > 1 and micro * steps == target
    if name != "hf_trainer.py":
        assert float(re.search(r"test accuracy: ([\d.]+)", out).group(1)) > 0.9


def test_multitask_example_learns_both_heads():
    out = run("multitask.py")
    digit, parity = map(float, re.search(r"digit ([\d.]+), parity ([\d.]+)", out).groups())
    assert digit > 0.85 and parity > 0.85


# gloo sometimes aborts a rank while the interpreter tears down (a worker thread of the process group
# releasing a tensor once Python is finalizing), after the run's work is done: a PyTorch race the test
# workers avoid by leaving with os._exit (tests/ddp_worker.py). An example leaves as a user's script does.
TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(name, cwd):
    """``torchrun --nproc_per_node=2 examples/<name>``; its stdout, after asserting it succeeded.

    A run that failed only by gloo's abort at teardown (that one line, a rank's SIGABRT, no Python error
    from any rank) is run once more, and that run must succeed: any other failure fails at once."""
    import shutil

    launcher = shutil.which("torchrun")
    if launcher is None:
        pytest.skip("torchrun is not on PATH")
    for attempt in range(2):
        done = subprocess.run(
            [launcher, "--standalone", "--nproc_per_node=2", str(EXAMPLES / name)],
            capture_output=True, text=True, timeout=180, cwd=cwd,
        )
        if done.returncode == 0 or attempt or not teardown_abort_only(done.stderr):
            break
    # On failure, the lines that say why (a rank's exception or gloo's abort), not only the launcher's tail.
    why = [line for line in done.stderr.splitlines() if any(k in line for k in ("Error", "error", "terminate", "what()", "enforce"))]
    assert done.returncode == 0, "\n".join(why[:40]) + "\n...\n" + done.stderr[-1500:]
    return done.stdout


def teardown_abort_only(stderr):
    """Whether the launcher's ranks failed by gloo's abort alone: its line, a SIGABRT, and no exception raised in
    a rank (the launcher's own ``ChildFailedError``, which reports the failed ranks, is left out)."""
    raised = {m for m in re.findall(r"^\s*([\w.]*(?:Error|Exception))\b", stderr, re.M) if not m.endswith("ChildFailedError")}
    return TEARDOWN_ABORT in stderr and "SIGABRT" in stderr and not raised


@pytest.mark.slow
def test_ddp_example_under_torchrun(tmp_path):
    out = torchrun("ddp.py", tmp_path)
    assert "world_size=2" in out and "effective_batch=1024" in out
    assert int(re.search(r"accumulation_steps=(\d+)", out).group(1)) > 1


@pytest.mark.slow
def test_fsdp_example_under_torchrun(tmp_path):
    out = torchrun("fsdp.py", tmp_path)
    assert "estimate: 2 ranks" in out and "world_size=2" in out and "effective_batch=1024" in out
    assert int(re.search(r"accumulation_steps=(\d+)", out.split("estimate:")[1].split("\n", 1)[1]).group(1)) > 1
    assert float(re.search(r"last loss ([\d.]+)", out).group(1)) < 0.5
