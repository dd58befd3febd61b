"""Data-parallel training on 2 and 3 CPU ranks (gloo, float64) against a single-process big-batch
reference written here, apart from autotune.

Every multi-process test runs under a hard timeout (``ddp_worker.launch``): a hang or a collective
mismatch fails the test in seconds instead of blocking. The cases that succeed on every rank share
launches (``SHARED``: one launch of 2 ranks and one of 3 for all of them, each case as in a process of
its own); those that stop ranks on purpose launch alone.
"""

import ddp_worker as W
import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    pytest.mark.slow,  # processes of their own: skipped by `pytest -m "not slow"`, run by CI
    pytest.mark.xdist_group("distributed"),  # one worker runs SHARED's launches, once
]
SHARED = W.Launches()


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every rank's result of a case of SHARED, by name (its launch runs the first time one is asked for)."""
    return SHARED.results_in(tmp_path_factory.mktemp("distributed"))


def shares(target, world, window=0):
    """Each rank's samples in window ``window`` of an epoch, by the rule docs/distributed.md states: the
    target shared evenly, its remainder going to ranks that take turns (window k: one more for the
    ranks (k * remainder + j) % world, j < remainder)."""
    base, extra = divmod(target, world)
    more = {(window * extra + j) % world for j in range(extra)}
    return [base + (1 if r in more else 0) for r in range(world)]


def global_windows(seqs, target, stages=None):
    """Global window k: each rank's next ``shares(target, world, k)[r]`` samples, until no rank has any.
    With ``stages`` ([(from_samples, target), ...], a fixed batch ramp) the target of window k is the
    stage's at the samples of the windows before it."""
    world = len(seqs)
    at, k = [0] * world, 0
    while any(at[r] < len(seqs[r]) for r in range(world)):
        if stages is not None:
            target = max(t for start, t in stages if start <= sum(at))
        share = shares(target, world, k)
        yield [s for r in range(world) for s in seqs[r][at[r] : at[r] + share[r]]]
        at = [a + s for a, s in zip(at, share)]
        k += 1


def reference(config, world, *, model_class=W.TokenModel):
    """Single process: the global window k is rank r's next shares(target, world, k)[r] samples, for every r;
    one optimizer step on the exact token mean of each global window (no step for a window with no
    token), until no rank has data."""
    torch.set_default_dtype(torch.float64)
    try:
        samples = W.token_samples(config["n"], lengths=tuple(config.get("lengths", (10, 10))), empty_every=config.get("empty_every", 0),
                                  by_parity=config.get("by_parity"))
        seqs = [[samples[i] for i in W.rank_indices(len(samples), r, world, config.get("shards", "sampler"))] for r in range(world)]
        model = model_class()
        if config.get("optimizer") == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = 0
        for _ in range(config.get("epochs", 1)):
            for window in global_windows(seqs, config["target"], config.get("ramp")):
                total, items = 0.0, 0
                for x, y in window:  # one sample at a time: lengths differ
                    real = y != W.PAD
                    if real.any():
                        total = total + F.cross_entropy(model(x.unsqueeze(0))[0][real], y[real], reduction="sum")
                        items += int(real.sum())
                if items == 0:
                    continue
                opt.zero_grad(set_to_none=True)
                (total / items).backward()
                opt.step()
                steps += 1
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, steps
    finally:
        torch.set_default_dtype(torch.float32)


def results(tmp_path, world):
    out = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, o in enumerate(out):
        assert "error" not in o, f"rank {r}: {o.get('traceback', o.get('error'))}"
    return out


def assert_exact(outs, config, world, **kw):
    want, steps = reference(config, world, **kw)
    for o in outs:
        assert len(o["history"]) == steps
        for name, value in want.items():
            assert (o["params"][name] - value).abs().max().item() <= 1e-10, name
    for o in outs[1:]:
        assert all(torch.equal(o["params"][k], outs[0]["params"][k]) for k in want)


BASE = dict(lengths=(10, 10), limits=["64MiB"] * 3)


EPOCH_END = {f"W{world}-N{n}-T{target}": (world, SHARED.add(f"epoch-end-W{world}-N{n}-T{target}", world, "tokens",
                                                            {**BASE, "n": n, "target": target, "limits": ["120KiB", "64MiB", "64MiB"]}))
             for world, n, target in [(2, 82, 49), (2, 100, 49), (3, 100, 49), (3, 97, 64)]}


@pytest.mark.parametrize("case", list(EPOCH_END))
def test_any_target_and_world_size_at_the_end_of_an_epoch(launched, case):
    """T % W != 0 used to desynchronise the ranks at the end of 87-100% of epochs."""
    world, (name, config) = EPOCH_END[case]
    outs = launched(name)
    assert_exact(outs, config, world)
    # one collective per optimizer step (the agreement rides in the gradients' only bucket); once per
    # fit call, the start-up agreement on the first batches, the check that the ranks' first batches
    # differ, and the exchange that finds the epoch over on every rank; none inside a window,
    # whatever the micro-batches
    for o in outs:
        assert o["collectives"].count("all_reduce") == len(o["history"]) + 3


FULL_STEPS = {f"W{world}-N{n}-T{target}" + ("-uneven" if shards == "strided" else ""): (world, n, target, shards)
              for world, n, target, shards in [(3, 102, 10, "sampler"), (3, 102, 7, "sampler"), (2, 81, 10, "sampler"),
                                               (3, 98, 10, "strided"), (2, 81, 7, "strided")]}
FULL_STEPS = {case: (*params, SHARED.add(f"full-steps-{case}", params[0], "tokens", {**BASE, "n": params[1], "target": params[2], "shards": params[3]}))
              for case, params in FULL_STEPS.items()}


@pytest.mark.parametrize("case", list(FULL_STEPS))
def test_every_step_but_an_epochs_last_is_full_while_every_shard_has_data(launched, case):
    """The rule of docs/distributed.md: the remainder of target / world takes turns among the ranks, so
    equal shards (a DistributedSampler) run out together and only the epoch's last step is short;
    with uneven shards every step is full until the first shard ends. Exact in float64."""
    world, n, target, shards, (name, config) = FULL_STEPS[case]
    outs = launched(name)
    assert_exact(outs, config, world)
    steps = [r["samples"] for r in outs[0]["history"]]
    sizes = [len(rank_indices) for rank_indices in (W.rank_indices(n, r, world, shards) for r in range(world))]
    if len(set(sizes)) == 1:
        assert steps[:-1] == [target] * (len(steps) - 1) and 0 < steps[-1] <= target
    else:  # full while every shard has data: until the smallest shard ends
        full = next((i for i, s in enumerate(steps) if s < target), len(steps))
        assert full * (target // world) <= min(sizes) <= (full + 1) * (-(-target // world))
    assert sum(steps) == sum(sizes)  # every sample once (a DistributedSampler pads to equal shards)


FIXED_RAMP = {f"W{world}": (world, stages, SHARED.add(f"fixed-ramp-W{world}", world, "tokens", {**BASE, "n": 100, "target": stages[-1][1], "ramp": stages,
                                                                                      "limits": ["120KiB", "64MiB", "64MiB"]}))
              for world, stages in [(2, [(0, 6), (18, 12), (54, 20)]), (3, [(0, 7), (30, 16)])]}


@pytest.mark.parametrize("case", list(FIXED_RAMP))
def test_a_fixed_batch_ramp_on_several_ranks_is_exact_at_every_stage(launched, case):
    """Every rank changes the target at the same window (the stage is read from the global samples
    seen), each step is the exact token mean of its global window (float64), with per-rank
    micro-batches under different memory limits."""
    world, stages, (name, config) = FIXED_RAMP[case]
    outs = launched(name)
    assert_exact(outs, config, world)
    seen, want = 0, []
    for record in outs[0]["history"]:
        want.append(max(t for start, t in stages if start <= seen))
        seen += record["samples"]
    assert [r["target"] for r in outs[0]["history"]] == want and len(set(want)) == len(stages)
    assert all([r["target"] for r in o["history"]] == want for o in outs[1:])


ADAPTIVE = SHARED.add("adaptive-ramp", 2, "tokens", {**BASE, "n": 400, "target": 48, "adaptive": (4, 48), "epochs": 2, "count": False})


def test_an_adaptive_batch_ramp_changes_on_every_rank_at_the_same_step(launched):
    """Each rank measures the noise scale with its own first micro-batch, so their estimates differ; the
    votes ride in the exchange the ranks already make and the target rises only when every rank voted:
    the same targets at the same steps on every rank, the same weights, no extra collective."""
    name, config = ADAPTIVE
    outs = launched(name)
    targets = [[r["target"] for r in o["history"]] for o in outs]
    assert targets[0] == targets[1] and len(set(targets[0])) > 1
    assert all(torch.equal(outs[0]["params"][k], outs[1]["params"][k]) for k in outs[0]["params"])
    for o in outs:
        # once per fit: the start-up agreement and the distinct-samples check; once per epoch: the exchange
        # that finds it over on every rank
        assert o["collectives"].count("all_reduce") == len(o["history"]) + 2 + config["epochs"]


@pytest.mark.parametrize("config, match", [
    ({"targets": [24, 16]}, "Invalid target_batch: the ranks disagree \\(rank 0: 24, rank 1: 16\\); every rank must train with the same"),
    ({"dims": [16, 12]}, "Invalid model \\(its parameters' names and shapes\\): the ranks disagree \\(rank 0: checksum .*, rank 1: checksum"),
], ids=["target", "model"])
def test_settings_that_must_agree_across_ranks_are_refused_on_every_rank_at_start_up(tmp_path, config, match):
    """Ranks given different targets would train 20 samples a step without a word; ranks with different
    models would meet raw gloo errors. Both are refused at start-up, on every rank, before any step."""
    import re

    W.launch(2, str(tmp_path), "tokens", {**BASE, "n": 24, "target": 24, "wrap": "plain", **config})
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for o in outs:
        assert "error" in o and re.search(match, o["error"]), o.get("error")


SAME_SAMPLES = {shards: SHARED.add(f"same-samples-{shards}", 2, "tokens", {**BASE, "n": 24, "target": 12, "shards": shards})[0]
                for shards in ("all", "sampler")}


def test_ranks_that_load_the_same_samples_are_warned(launched):
    """Every rank iterating the whole dataset (no DistributedSampler) is warned about, on every rank;
    ranks with their own shards are not."""
    for shards, warned in (("all", True), ("sampler", False)):
        for o in launched(SAME_SAMPLES[shards]):
            assert any("Every rank got the same first batch" in w for w in o["warnings"]) is warned, o["warnings"]


NOISE = SHARED.add("noise-windows", 2, "tokens", {**BASE, "n": 96, "target": 4, "noise_every": [2, 4]})


def test_ranks_measure_the_noise_scale_in_the_same_windows(launched):
    """Ranks that would pace the noise meter differently (every 2nd and every 4th window) measure in
    the same windows, every 3rd (the mean), so that neither waits for the other's measurement."""
    outs = launched(NOISE[0])
    measured = outs[0]["noise_measured"]
    assert measured == outs[1]["noise_measured"]
    assert measured == list(range(1, len(outs[0]["history"]) + 1, 3)) and len(measured) >= 6, measured


PER_RANK = SHARED.add("per-rank-limits", 2, "tokens", {**BASE, "n": 96, "target": 48, "limits": ["64MiB", "100KiB"]})


def test_per_rank_limits_give_per_rank_micro_batches(launched):
    name, config = PER_RANK
    outs = launched(name)
    ranks = outs[0]["plan"]["rank_micro_batches"]
    assert ranks == outs[1]["plan"]["rank_micro_batches"] and ranks[0] > ranks[1]
    assert outs[0]["plan"]["micro_batch"] == ranks[0] and outs[1]["plan"]["micro_batch"] == ranks[1]
    assert len(outs[0]["history"][0]["micro_batches"]) < len(outs[1]["history"][0]["micro_batches"])
    assert_exact(outs, config, 2)


OOM_ONE_RANK = SHARED.add("oom-one-rank", 2, "tokens", {**BASE, "n": 100, "target": 49, "oom_rank": 1, "oom_at": 3, "limits": ["64MiB", "64MiB"]})


def test_an_out_of_memory_error_on_one_rank_is_redone_there_only(launched):
    name, config = OOM_ONE_RANK
    outs = launched(name)
    assert any("Out of memory" in w for w in outs[1]["warnings"])
    assert not any("Out of memory" in w for w in outs[0]["warnings"])  # rank 0 kept its window
    assert outs[1]["plan"]["micro_batch"] < outs[0]["plan"]["micro_batch"]
    assert_exact(outs, config, 2)


LONG_TAIL = SHARED.add("long-tail", 3, "tokens", {**BASE, "n": 90, "target": 40, "lengths": (2, 40), "limits": ["64MiB", "200KiB", "64MiB"]})


def test_dynamic_padding_and_a_long_tail(launched):
    """Each loader batch padded to its own longest sample: ranks cut different numbers of micro-batches."""
    name, config = LONG_TAIL
    outs = launched(name)
    counts = {len(h["micro_batches"]) for o in outs for h in o["history"]}
    assert len(counts) > 1  # the ranks really ran different numbers of micro-batches
    assert_exact(outs, config, 3)


SHAPE_SIZED = SHARED.add("shape-sized", 2, "tokens", {**BASE, "n": 80, "target": 40, "shards": "strided", "by_parity": [(2, 8), (24, 40)], "pad": True,
                                                   "loader_batch": 2, "limits": ["300KiB", "300KiB"]})


def test_shape_sized_micro_batches_on_ranks_with_different_lengths(launched):
    """Rank 0 holds short sequences, rank 1 long ones: each sizes its micro-batches by its own shapes
    and joins loader batches of different lengths by padding; still exact."""
    name, config = SHAPE_SIZED
    outs = launched(name)
    short, long_ = (max(s for h in o["history"] for s in h["micro_batches"]) for o in outs)
    assert short > long_ and short > 2  # joined past the loader's batches of 2, sized by length
    assert outs[0]["plan"]["shape_model"] is not None
    assert_exact(outs, config, 2)


WITHOUT_ITEMS = SHARED.add("without-items", 2, "tokens", {**BASE, "n": 60, "target": 12, "empty_every": 3, "loader_batch": 1, "limits": ["64MiB", "64MiB"]})


def test_micro_batches_and_windows_without_items(launched):
    name, config = WITHOUT_ITEMS
    assert_exact(launched(name), config, 2)


UNEVEN_SHARDS = SHARED.add("uneven-shards", 2, "tokens", {**BASE, "n": 97, "target": 30, "shards": "strided", "limits": ["64MiB", "64MiB"]})


def test_shards_of_different_lengths(launched):
    name, config = UNEVEN_SHARDS
    outs = launched(name)
    assert len(outs[0]["indices"]) == 49 and len(outs[1]["indices"]) == 48
    assert_exact(outs, config, 2)


@pytest.mark.parametrize("bad, when", [(81, "in this window"), (41, "looking at its first batches")], ids=["training", "first-batches"])
def test_a_bad_sample_on_one_rank_stops_every_rank_within_seconds(tmp_path, bad, when):
    config = {**BASE, "n": 96, "target": 24, "bad": bad, "bad_rank": 1, "limits": ["64MiB", "64MiB"]}
    assert_stopped_together(tmp_path, "tokens", config, bad, when)


def assert_stopped_together(tmp_path, scenario, config, bad, when):
    """Rank 1 meets the bad sample and raises it; rank 0 stops too, naming it, within seconds."""
    seconds = W.launch(2, str(tmp_path), scenario, config, timeout=40)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outs[1]["error"] == f"ValueError: a bad sample at index {bad}"
    assert outs[0]["error"].startswith(f"AutotuneError: rank 1 failed {when}") and f"a bad sample at index {bad}" in outs[0]["error"]
    assert abs(outs[0]["at"] - outs[1]["at"]) < 10
    assert seconds < 40


def test_a_rank_that_exits_mid_run_is_named_by_the_others(tmp_path):
    """Rank 1's process leaves at its 3rd training forward (os._exit: no error of its own, as a process
    killed or crashed): rank 0, waiting in the step's exchange, says that rank 1 exited, not the
    transport's "connection closed by peer", within seconds."""
    config = {**BASE, "n": 96, "target": 24, "limits": ["64MiB", "64MiB"], "exit_rank": 1, "exit_at": 3}
    seconds = W.launch(2, str(tmp_path), "tokens", config, timeout=40)
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert not (tmp_path / "rank1.pt").exists()
    assert out["error"].startswith("AutotuneError: rank 1 exited in this step's exchange (its process is gone)"), out["error"]
    assert seconds < 40


def test_a_rank_whose_optimizer_step_runs_out_of_memory_is_named_with_its_error_by_the_others(tmp_path):
    """Rank 1 runs out of memory inside its third optimizer step (the step may be partly applied: the run
    cannot go on) and leaves with that error; rank 0, waiting in the next exchange, names rank 1 and its
    error (once: "rank 1 exited ... its process is gone")."""
    config = {**BASE, "n": 96, "target": 24, "limits": ["64MiB", "64MiB"], "step_oom_rank": 1, "step_oom_at": 3}
    seconds = W.launch(2, str(tmp_path), "tokens", config, timeout=40)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outs[1]["error"].startswith("AutotuneError: Out of memory inside optimizer.step() at step 3"), outs[1]["error"]
    assert outs[0]["error"].startswith("AutotuneError: rank 1 stopped on an error of its own, so this rank stops too"), outs[0]["error"]
    assert "Out of memory inside optimizer.step() at step 3" in outs[0]["error"]
    assert seconds < 40


WRAPS = {wrap: SHARED.add(f"wrap-{wrap}", 2, "tokens", {**BASE, "n": 64, "target": 25, "wrap": wrap, "limits": ["64MiB", "64MiB"]})
         for wrap in ("compiled", "nested", "plain-perturbed")}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_compiled_nested_and_plain_models_are_recognised(launched, wrap):
    name, config = WRAPS[wrap]
    assert_exact(launched(name), config, 2)


UNUSED = SHARED.add("unused-parameter", 2, "tokens", {**BASE, "n": 64, "target": 25, "unused": True, "optimizer": "adamw", "limits": ["64MiB", "64MiB"]})


def test_an_unused_parameter_is_left_alone_by_adamw(launched):
    name, config = UNUSED
    outs = launched(name)
    torch.set_default_dtype(torch.float64)
    try:
        start = W.WithUnused()
    finally:
        torch.set_default_dtype(torch.float32)
    for o in outs:
        assert "unused.weight" in o["grads_none"]
        assert torch.equal(o["params"]["unused.weight"], start.unused.weight)  # weight decay never touched it
    assert_exact(outs, config, 2, model_class=W.WithUnused)


BUCKET_VIEW = SHARED.add("bucket-view", 2, "tokens", {**BASE, "n": 64, "target": 32, "bucket_view": True, "limits": ["120KiB", "120KiB"]})


def test_gradient_as_bucket_view_at_a_tight_limit_trains_without_running_out(launched):
    name, config = BUCKET_VIEW
    outs = launched(name)
    assert not any("Out of memory" in w for o in outs for w in o["warnings"])
    assert any(name == "the gradient sync's bucket" for name, _ in outs[0]["plan"]["set_aside"])
    assert_exact(outs, config, 2)


EXCHANGE = {case: SHARED.add(f"exchange-{case}", 2, "exchange", {"bucket_bytes": size})[0]
            for case, size in (("one-bucket", 2**20), ("several-buckets", 1024))}


@pytest.mark.parametrize("case, views", [("one-bucket", True), ("several-buckets", False)], ids=list(EXCHANGE))
def test_the_exchange_makes_the_global_mean_from_each_kind_of_gradient(launched, case, views):
    """GradientSync alone, 2 ranks with 3 and 5 items: gradients that hold the rank's mean, its share
    of the global count the ranks expected, or its share of another count all become the global
    mean; multiplied twice per bucket, never, and once after the sum. With one bucket they come back
    as views of the buffer it keeps, with several they are copied back."""
    outs = launched(EXCHANGE[case])
    total = sum(o["items"] for o in outs)
    want = [sum(o["items"] * o["local"][i] for o in outs) / total for i in range(len(outs[0]["local"]))]
    buckets = outs[0]["buckets"]
    assert (buckets == 1) is views
    for o in outs:
        for name, case in o["cases"].items():
            assert case["synced"], name
            assert max(float((got - ref).abs().max()) for got, ref in zip(case["grads"], want)) <= 1e-12, name
            assert all(case["views"]) is views and (any(case["views"]) is views), name
        assert [case["muls"] for case in o["cases"].values()] == [2 * buckets, 0, buckets]


HELD = {how: SHARED.add(f"held-gradients-{how}", 2, "tokens", {**BASE, "n": 64, "target": 24, how: True}) for how in ("zero_in_place", "keep_grads")}


@pytest.mark.parametrize("how", list(HELD))
def test_gradients_an_optimizer_holds_on_to_are_never_written_over(launched, how):
    """The summed gradients are handed out as views of the exchange's buffer. An optimizer that zeroes
    them in place (instead of setting None) makes the next backward add into them, so the next
    exchange must not read and write that buffer at once; one that keeps last step's gradients must
    find them as they were. Either way the next exchange writes into a new buffer."""
    name, config = HELD[how]
    outs = launched(name)
    assert len(outs[0]["history"]) > 2
    for o in outs:
        assert o["kept_intact"]
        assert (o["kept_steps"] >= len(o["history"])) if how == "keep_grads" else o["kept_steps"] == 0
    assert_exact(outs, config, 2)


EPOCHS = SHARED.add("sampler-epochs", 2, "epochs", {"n": 40, "target": 16})


def test_sampler_epochs_continue_across_fit_calls(launched):
    outs = launched(EPOCHS[0])
    for o in outs:
        # The same samples in the same order, so the same weights up to rounding: a call's first
        # window weights by this rank's count, later ones by the share of the last global count.
        assert max(float((o["one"][k] - o["two"][k]).abs().max()) for k in o["one"]) <= 1e-12
        assert o["one_epoch"] == o["two_epoch"] == 2  # set_epoch(0), (1), then ready for epoch 2


BN_ADJUST = SHARED.add("bn-adjust", 2, "bn", {"n": 40, "target": 20, "bn": "adjust", "limits": ["64MiB", "5KiB"]})


def test_batchnorm_statistics_agree_across_ranks(launched):
    outs = launched(BN_ADJUST[0])
    for name in ("bn.running_mean", "bn.running_var"):
        assert torch.equal(outs[0]["params"][name], outs[1]["params"][name])
    for o in outs:
        # plus one per step for the statistics (and the three per fit call, as above)
        assert o["collectives"].count("all_reduce") == 2 * len(o["history"]) + 3


BN_POOLED = SHARED.add("bn-pooled", 2, "bn", {"n": 40, "target": 20, "bn": "pooled", "steps": 1, "limits": ["64MiB", "5KiB"]})


def test_pooled_batchnorm_is_one_global_big_batch_forward(launched):
    name, config = BN_POOLED
    outs = launched(name)
    assert outs[0]["plan"]["rank_micro_batches"][0] != outs[0]["plan"]["rank_micro_batches"][1]
    assert_pooled_is_one_global_forward(outs, config)


def assert_pooled_is_one_global_forward(outs, config):
    """After one step of the "bn" scenario with bn="pooled", every rank's running statistics are one
    forward over the whole global window (each rank's share of its strided shard), at BNNet's momentum 0.3."""
    torch.set_default_dtype(torch.float64)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(config["n"], 6, generator=g) * 2 + 1
        window = torch.cat([x[W.rank_indices(config["n"], r, 2, "strided")][: shares(config["target"], 2)[r]] for r in range(2)])
        z = W.BNNet().lin(window).detach()  # the BatchNorm's input, at the weights before the step
        mean, var = z.mean(0), z.var(0, unbiased=True)
        for o in outs:
            assert (o["params"]["bn.running_mean"] - 0.3 * mean).abs().max().item() <= 1e-10
            assert (o["params"]["bn.running_var"] - (0.7 + 0.3 * var)).abs().max().item() <= 1e-10
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_communication_hook_is_refused(tmp_path):
    W.launch(2, str(tmp_path), "comm_hook", {})
    for r in range(2):
        out = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert out["error"].startswith("ValueError: Invalid model: its DDP wrapper has a communication hook")


def test_data_parallel_is_refused():
    import autotune

    model = nn.DataParallel(nn.Linear(4, 2))
    with pytest.raises(TypeError, match="nn.DataParallel is not supported"):
        autotune.plan(model, [(torch.randn(4, 4), torch.randn(4, 2))], target_batch=8)
