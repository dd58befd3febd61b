"""A run that stops, for whatever reason, leaves the model as its last good step left it: weights,
BatchNorm statistics and gradients, checked bitwise against a run of exactly those steps. And batches
are joined by key."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.batches import concat, pad_to_longest

pytestmark = pytest.mark.usefixtures("float64")


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1)), batch_size=8)


def train(model, *, stop=None, max_steps=None):
    """Windows of 3 micro-batches of 8; ``stop``: fail in the second micro-batch of the third window."""
    from test_noise import manual_plan

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {"steps": 0, "calls": 0}

    def stepped(*args):
        seen["steps"], seen["calls"] = seen["steps"] + 1, 0

    optimizer.register_step_post_hook(stepped)

    def loss_fn(m, batch):
        x, y = batch
        loss = F.mse_loss(m(x).squeeze(-1), y)
        if not autotune.is_planning() and m.training and len(x) == 8:
            seen["calls"] += 1
            if stop is not None and seen["steps"] == 2 and seen["calls"] == 2:
                if stop == "nan":
                    return loss * float("nan")
                raise stop
        return loss

    autotune.fit(model, loader(), optimizer=optimizer, loss_fn=loss_fn, progress=False, max_steps=max_steps,
                 plan=manual_plan(24, [8, 8, 8]))


@pytest.mark.filterwarnings("ignore:BatchNorm normalises over micro-batches")
@pytest.mark.parametrize("stop, match", [
    ("nan", "Non-finite loss .* at step 3 .* the weights \\(and BatchNorm statistics\\) are those after step 2"),
    (KeyboardInterrupt(), None),
    (RuntimeError("the data went away"), "the data went away"),
], ids=["non-finite-loss", "ctrl-c", "an-error"])
def test_a_stop_inside_a_window_leaves_the_model_as_after_the_last_good_step(stop, match):
    """Two full steps, then a stop in the third window after its first micro-batch ran (its BatchNorm
    update and its gradient must not stay). For a non-finite loss the window runs to its end first."""
    good = bn_model()
    train(good, max_steps=2)
    model = bn_model()
    with pytest.raises(KeyboardInterrupt if match is None else (autotune.AutotuneError, RuntimeError), match=match):
        train(model, stop=stop)
    for (name, want), got in zip(good.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name  # weights, running statistics and the batch count
    assert all(p.grad is None for p in model.parameters())


def test_dict_batches_join_by_key_and_different_keys_are_refused():
    a = {"input_ids": torch.tensor([[1, 2]]), "attention_mask": torch.tensor([[1, 1]])}
    b = {"attention_mask": torch.tensor([[1, 0]]), "input_ids": torch.tensor([[5, 6]])}
    joined = concat([a, b])
    assert joined["input_ids"].tolist() == [[1, 2], [5, 6]] and joined["attention_mask"].tolist() == [[1, 1], [1, 0]]
    longer = {"attention_mask": torch.tensor([[1, 1, 0]]), "input_ids": torch.tensor([[5, 6, 7]])}
    assert pad_to_longest([a, longer])["input_ids"].tolist() == [[1, 2, 0], [5, 6, 7]]
    with pytest.raises(ValueError, match=r"different keys: \['attention_mask', 'input_ids'\] and \['input_ids', 'labels'\] "
                                         r"\(missing \['attention_mask'\], extra \['labels'\]\)"):
        concat([a, {"input_ids": torch.tensor([[1, 2]]), "labels": torch.tensor([[1, 1]])}])
    assert copy.deepcopy(a).keys() == a.keys()


def test_only_the_transports_own_errors_read_as_a_lost_rank():
    """A collective that failed because a peer went away is told apart from an error of your own code
    that happens to mention a broken pipe (one process: no store to name the rank from)."""
    from autotune.parallel.ranks import lost_peer

    assert lost_peer(RuntimeError("Broken pipe while reading shard 3"), what="in this window") is None
    assert lost_peer(ValueError("a bad sample at index 4"), what="in this window") is None
    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:9868")
    lost = lost_peer(gloo, what="in this step's exchange")
    assert str(lost).startswith("lost the connection to another rank in this step's exchange")
    assert "a rank exited or crashed" in str(lost)


def test_an_fsdp2_out_of_memory_error_in_a_ranks_zero_weight_micro_batch_names_a_micro_batch_that_exists():
    """Under FSDP2 a rank whose window has no samples left runs zero-weight micro-batches of a spare
    sample, in lockstep; an out-of-memory error there once gave NothingFits at micro_batch=0. Now the
    spare's size counts: the window is retried once at it, then NothingFits names it."""
    import types

    from autotune.train.sharded import _lowered

    run = types.SimpleNamespace(plan=types.SimpleNamespace(min_micro_batch=1, budget=1024, memory_limit=2048), spare=torch.zeros(1, 3),
                                retried_at_floor=False, limit=None)
    error = torch.OutOfMemoryError("injected")
    with pytest.warns(autotune.AutotuneWarning, match="Out of memory at micro_batch=1, the smallest: retrying the window once"):
        assert _lowered(run, None, 0, error) is None
    failure = _lowered(run, None, 0, error)
    assert isinstance(failure, autotune.NothingFits) and failure.micro_batch == 1
    assert "at micro_batch=1 under FSDP2 (OutOfMemoryError raised on this rank), twice" in str(failure)
