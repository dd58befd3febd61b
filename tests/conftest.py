import os
import sys
from pathlib import Path

# One thread per process: the tests' outcomes never depend on timing, and on a small loaded machine
# torch's default (one thread per core, in every subprocess too) oversubscribes the cores and turns
# seconds into minutes. Subprocesses (examples, torchrun) inherit the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py

# transformers binds its log handler to the sys.stderr of the moment it is first imported: imported
# here, before any test captures stderr, a later warning never writes to a capture that has closed
# (whose "Logging error" traceback would fail the test that meets it, depending on the tests chosen).
try:
    import transformers  # noqa: E402, F401
except ImportError:  # an optional test dependency
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def float64():
    """Default dtype float64 for the test (exactness checks against a float64 reference)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


class _Errors(__import__("logging").Handler):
    def __init__(self):
        super().__init__(level=__import__("logging").ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_torch_errors_logged():
    """No test may make torch log an error (a fake-tensor traceback on stderr during a plan that succeeds)."""
    import logging

    import torch._subclasses.fake_tensor  # noqa: F401  (its logger, which does not propagate, exists)

    handler = _Errors()
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.split(".")[0] == "torch"]
    for logger in loggers:
        logger.addHandler(handler)
    yield
    for logger in loggers:
        logger.removeHandler(handler)
    assert not handler.records, f"torch logged: {handler.records[0].getMessage()}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """No test that passes may leave a traceback on stderr (torch's logger, a thread, a child process
    writing to the inherited stream): a plan or a run that succeeds prints none."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed and "Traceback (most recent call last)" in report.capstderr:
        report.outcome = "failed"
        report.longrepr = "a traceback reached stderr in a test that passed:\n" + report.capstderr[-3000:]
