"""Loaders that launchers hand to autotune: Ray Train's ``prepare_data_loader`` returns a DataLoader subclass
that also defines ``__next__``, once refused as a one-shot iterator even for one epoch; a DataLoader is
re-iterable whatever else its class defines. ``fit`` inside a Ray ``TorchTrainer`` with 2 CPU workers on
its own prepared loader trains the target every step, exactly (float64, against one process replaying
the big batches). The Ray run is a subprocess under a timeout of seconds."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import autotune

pytestmark = pytest.mark.usefixtures("float64")


class WithNext(DataLoader):
    """A DataLoader that is also its own iterator, as Ray Train's ``_WrappedDataLoader`` is."""

    def __iter__(self):
        self._it = super().__iter__()
        return self

    def __next__(self):
        return next(self._it)


def replay(steps, *, lr=0.05, epochs=1):
    """One process, one big batch per step of 24 consecutive samples (the order the loaders give)."""
    from trainers_worker import mlp, regression

    data, model = regression(), mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = data.tensors
    for _ in range(epochs):
        for i in range(steps):
            opt.zero_grad()
            F.mse_loss(model(x[24 * i:24 * i + 24]).squeeze(-1), y[24 * i:24 * i + 24]).backward()
            opt.step()
    return list(model.parameters())


def test_a_dataloader_that_defines_next_is_trained_for_every_epoch():
    from trainers_worker import mlp, mse, regression

    model = mlp()
    loader = WithNext(regression(), batch_size=12)
    assert autotune.plan(model, loader, target_batch=24, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=mse,
                         memory_limit="20KiB", headroom=0, progress=False).accumulation_steps > 1
    result = autotune.fit(model, loader, target_batch=24, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), loss_fn=mse,
                          memory_limit="20KiB", headroom=0, epochs=2, lr_rule="none", progress=False)
    assert [h.samples for h in result.history] == [24] * 8
    for got, want in zip(model.parameters(), replay(4, epochs=2)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_fit_inside_ray_train_on_its_prepared_loader_is_exact(tmp_path):
    pytest.importorskip("ray.train.torch")
    done = subprocess.run([sys.executable, str(Path(__file__).parent / "ray_worker.py"), str(tmp_path)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"ray-rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert all(r["loader"] == "_WrappedDataLoader" and r["has_next"] for r in ranks)  # what Ray hands over
    assert all(r["micro"] < 12 for r in ranks)  # accumulated: micro-batches below the loader's batch
    assert all(r["samples"] == [24] * 8 for r in ranks)  # two epochs of 96 samples, 24 a step over both workers
    # DistributedSampler without shuffling: rank r takes samples r, r + 2, ..., so each step is 24 consecutive samples
    for got, want in zip(ranks[0]["params"], replay(4, epochs=2)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)
