"""FSDP2 (``fully_shard``) on 2 CPU ranks (gloo, float64) against the single-process big-batch
reference of ``test_distributed`` (written apart from autotune).

Every multi-process test runs under a hard timeout (``ddp_worker.launch``): a hang or a collective
mismatch fails the test in seconds instead of blocking.
"""

import importlib.util
import os

import ddp_worker as W
import pytest
import torch
from test_distributed import (
    assert_exact,
    assert_pooled_is_one_global_forward,
    assert_stopped_together,
    results,
)
from torch import nn

fsdp = pytest.importorskip("torch.distributed.fsdp")
pytestmark = [
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
    pytest.mark.slow,  # processes of their own: skipped by `pytest -m "not slow"`, run by CI
    pytest.mark.xdist_group("fsdp"),  # one worker runs SHARED's launch, once
]
# The cases that succeed on every rank, in one launch of 2 ranks (each as in a process of its own); those
# that stop ranks on purpose launch alone.
SHARED = W.Launches(seconds_per_case=20)

BIG = "64MiB"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every rank's result of a case of SHARED, by name (its launch runs the first time one is asked for)."""
    return SHARED.results_in(tmp_path_factory.mktemp("fsdp"))


SHARDED = {f"{optimizer}-{limit}": SHARED.add(f"sharded-{optimizer}", 2, "fsdp", {"n": 45, "target": 7, "lengths": (4, 9), "limits": [limit, limit],
                                                                                 "optimizer": optimizer})
           for optimizer, limit in [("sgd", "24KiB"), ("adamw", "32KiB")]}


@pytest.mark.parametrize("case", list(SHARDED))
def test_sharded_training_equals_one_big_batch(launched, case):
    """Target 7 over 2 ranks (shares 4 and 3), micro-batches smaller than the shares, sequences of
    4 to 9 tokens padded per loader batch: the ranks cut different numbers of micro-batches (the
    one with fewer runs zero-weight ones), and the last window is short."""
    name, config = SHARDED[case]
    outs = launched(name)
    for o in outs:
        plan = o["plan"]
        assert plan["accumulation_steps"] > 1, plan
        assert plan["effective_batch"] == 7
        assert max(len(h["micro_batches"]) for h in o["history"]) > 1
    # a rank with fewer micro-batches than the other in some window (zero-weight micro-batches ran)
    counts = [[len(h["micro_batches"]) for h in o["history"]] for o in outs]
    assert counts[0] != counts[1]
    assert_exact(outs, config, 2)


PER_RANK = SHARED.add("per-rank-limits", 2, "fsdp", {"n": 48, "target": 12, "lengths": (6, 6), "limits": [BIG, "28KiB"], "optimizer": "adamw"})


def test_different_limits_per_rank(launched):
    """In lockstep a size fits when it fits on every rank: the tighter rank decides for both."""
    name, config = PER_RANK
    outs = launched(name)
    micro = [o["plan"]["micro_batch"] for o in outs]
    assert micro[0] == micro[1] and outs[0]["plan"]["accumulation_steps"] > 1, micro
    # rank 0 alone fitted a larger size, rank 1 did not: the same trials on both, rank 1's verdict
    sizes = [[t["batch_size"] for t in o["plan"]["trials"]] for o in outs]
    assert sizes[0] == sizes[1]
    assert any(t["fits"] and t["batch_size"] > micro[0] for t in outs[0]["plan"]["trials"])
    assert not any(t["fits"] and t["batch_size"] > micro[1] for t in outs[1]["plan"]["trials"])
    assert outs[1]["plan"]["peak_memory"] <= 28 * 1024
    assert_exact(outs, config, 2)


OVER_THE_LIMIT = SHARED.add("over-the-limit", 2, "fsdp", {"n": 48, "target": 12, "lengths": (6, 6), "limits": [BIG, BIG],
                                                          "train_limits": [BIG, "31KiB"], "optimizer": "adamw"})


def test_an_out_of_memory_window_on_one_rank_is_redone_by_every_rank(launched):
    """Rank 1's limit drops below the plan's peak while training: its first window counts over,
    every rank drops the window's gradients and redoes it, rank 1 with half its micro-batch."""
    name, config = OVER_THE_LIMIT
    outs = launched(name)
    assert any("Out of memory" in w for w in outs[1]["warnings"]), outs[1]["warnings"]
    assert not any("Out of memory" in w for w in outs[0]["warnings"])
    assert outs[1]["final_plan"]["micro_batch"] < outs[1]["plan"]["micro_batch"]
    assert outs[0]["final_plan"]["micro_batch"] == outs[0]["plan"]["micro_batch"]
    assert_exact(outs, config, 2)


IN_A_WINDOW = {case: SHARED.add(f"in-a-window-{case}", 2, "fsdp", {"n": 45, "target": 7, "lengths": (4, 9), "limits": ["32KiB", "32KiB"],
                                                                     "optimizer": "adamw", "oom_rank": 1, "oom_in": where, "oom_call": call})
               for case, where, call in [("forward-synced", "forward", 2), ("backward-synced", "backward", 2), ("backward-unsynced", "backward", 1)]}


@pytest.mark.parametrize("case", list(IN_A_WINDOW))
def test_an_out_of_memory_error_inside_a_window_is_redone_by_every_rank(launched, case):
    """Rank 1 raises torch.OutOfMemoryError (as a CUDA allocation does) in a block's forward, or in its
    backward, at its second micro-batch of the first window (the one whose gradients sync) or its
    first (no sync: no agreement before the post-backward there), while rank 0 runs the same
    micro-batch in lockstep: both abandon it at the same point, drop the window, and redo it, rank 1
    with half its micro-batch and rank 0, whose limit is the same, with rank 1's. The run then equals the big-batch replay of the samples each step saw."""
    name, config = IN_A_WINDOW[case]
    outs = launched(name)
    assert outs[0]["plan"]["accumulation_steps"] > 1  # the error came inside a window of several micro-batches
    assert any(w.startswith("Out of memory at micro_batch=") and "OutOfMemoryError raised on this rank" in w
               for w in outs[1]["warnings"]), outs[1]["warnings"]
    assert not any("Out of memory" in w for w in outs[0]["warnings"])
    assert outs[1]["final_plan"]["micro_batch"] < outs[1]["plan"]["micro_batch"]
    # the same limit on both ranks: rank 0 goes on at rank 1's smaller micro-batch too
    assert outs[0]["final_plan"]["micro_batch"] == outs[1]["final_plan"]["micro_batch"]
    assert_exact(outs, config, 2)


ROOT_OWNED = {case: SHARED.add(f"root-owned-{case}", 2, "fsdp", {"n": 45, "target": 21, "lengths": (4, 9), "limits": ["40KiB", "40KiB"],
                                                                   "optimizer": "adamw", "root_owned": True, "oom_rank": rank,
                                                                   "oom_module": module, "oom_in": where, "oom_call": 3})
              for case, module, where, rank in [("root-forward-before-first-block", "embed", "forward", 1),
                                                ("root-forward-after-last-block", "head", "forward", 0), ("loss", "loss", "forward", 1),
                                                ("root-backward-before-first-block", "head", "backward", 0),
                                                ("root-backward-after-last-block", "embed", "backward", 1)]}


@pytest.mark.parametrize("case", list(ROOT_OWNED))
def test_an_out_of_memory_error_in_the_roots_own_code_is_redone_by_every_rank(launched, case):
    """The block sharded with fully_shard, then the model: the embedding and the head belong to the root,
    as a language model's embedding, LM head and loss do, where its largest tensors are made. An
    out-of-memory error in the root's forward before its block (the embedding) or after it (the head),
    in the loss, or in the backward of the root's own computation before the block's backward (the
    head's) or after it (the embedding's), at the third micro-batch of a window of several: every rank
    abandons that micro-batch, the window is redone, that rank with half its micro-batch, and the run
    equals the big-batch replay of the samples each step saw."""
    name, config = ROOT_OWNED[case]
    rank = config["oom_rank"]
    outs = launched(name)
    assert outs[0]["plan"]["accumulation_steps"] > 2
    assert any(w.startswith("Out of memory at micro_batch=") and "OutOfMemoryError raised on this rank" in w
               for w in outs[rank]["warnings"]), outs[rank]["warnings"]
    assert not any("Out of memory" in w for w in outs[1 - rank]["warnings"])
    assert outs[rank]["final_plan"]["micro_batch"] < outs[rank]["plan"]["micro_batch"]
    assert outs[1 - rank]["final_plan"]["micro_batch"] == outs[rank]["final_plan"]["micro_batch"]  # the same limit
    assert_exact(outs, config, 2)


# The model of every case: its embedding, block and head each sharded with fully_shard, then the model, whose
# parameters all live in its children (or, "blocks": [], only the model sharded); windows uneven across the
# ranks (21 over 2) and a last window of one sample, where one rank runs only a zero-weight micro-batch.
ROOT = {"n": 64, "target": 21, "lengths": (4, 9), "limits": ["40KiB", "40KiB"], "optimizer": "sgd", "plan_headroom": 0.1}
ROOT_CASES = {name: SHARED.add(name, 2, "fsdp", {**ROOT, **case}) for name, case in {
    "root-without-parameters-start-of-forward": dict(oom_rank=1, oom_module="root", oom_in="pre_forward", oom_call=3),
    "root-without-parameters-end-of-forward": dict(oom_rank=0, oom_module="root", oom_in="forward", oom_call=3),
    "root-without-parameters-backward-of-its-output": dict(oom_rank=0, oom_module="root", oom_in="backward", oom_call=4),
    "root-without-parameters-loss": dict(oom_rank=1, oom_module="loss", oom_call=3),
    "only-the-root-sharded-start-of-forward": dict(blocks=[], oom_rank=1, oom_module="root", oom_in="pre_forward", oom_call=3),
    "only-the-root-sharded-backward-of-a-block": dict(blocks=[], oom_rank=0, oom_module="mix", oom_in="backward", oom_call=3),
}.items()}


@pytest.mark.parametrize("name", list(ROOT_CASES))
def test_an_out_of_memory_error_anywhere_in_a_root_without_parameters_is_redone_exactly(launched, name):
    """An out-of-memory error at the start or the end of the root's own forward, in the loss, in the backward of
    the root's output (the first backward op), or in a block's backward when only the root is sharded, on
    either rank: every rank abandons that micro-batch, the window is redone, and the run equals the big-batch
    replay of each step's samples. The limits are the same on both ranks, so both go on at the smaller
    micro-batch (in lockstep they run as many micro-batches anyway), and both plans say so."""
    _, config = ROOT_CASES[name]
    outs = launched(name)
    rank = config["oom_rank"]
    assert outs[0]["plan"]["accumulation_steps"] > 1
    assert any(w.startswith("Out of memory at micro_batch=") and "OutOfMemoryError raised on this rank" in w
               for w in outs[rank]["warnings"]), outs[rank]["warnings"]
    assert not any("Out of memory" in w for w in outs[1 - rank]["warnings"])
    final = [o["final_plan"]["micro_batch"] for o in outs]
    assert final[0] == final[1] < outs[rank]["plan"]["micro_batch"], final
    assert outs[0]["final_plan"]["rank_micro_batches"] == outs[1]["final_plan"]["rank_micro_batches"] == final
    assert any(f"lowered to {final[0]} as rank {rank}" in n for n in outs[1 - rank]["final_plan"]["notes"])
    for o in outs:  # every window after the redo cut at that micro-batch
        redone = next(i for i, h in enumerate(o["history"]) if max(h["micro_batches"], default=0) <= final[0])
        assert all(max(h["micro_batches"], default=0) <= final[0] for h in o["history"][redone:])
    assert_exact(outs, config, 2)


def test_the_same_under_torchrun(tmp_path):
    """The out-of-memory error in the backward of the root's own head (before its block's backward), with
    the ranks started by torchrun (its environment, its rendezvous) instead of the test's own launcher."""
    import json
    import shutil
    import subprocess

    launcher = shutil.which("torchrun")
    if launcher is None:
        pytest.skip("torchrun is not on PATH")
    # 36 KiB: the plan's peaks at micro-batches 2 and 3 are about 31.2 and 35.7 KiB, and gloo's buffers move the count by
    # a few KiB under load, so the plan finds 3 or 2, and the error lowers either. Where it finds 1 (at 32 KiB under the
    # whole suite's load; at 34 KiB the error's warning was missing once, likely the same) the error meets the smallest
    # size and is retried, not lowered
    config = {"n": 45, "target": 7, "lengths": [4, 9], "limits": ["36KiB", "36KiB"], "optimizer": "adamw",
              "oom_rank": 1, "oom_in": "backward", "oom_call": 2, "root_owned": True, "oom_module": "head"}
    done = subprocess.run([launcher, "--standalone", "--nproc_per_node=2", W.__file__, "fsdp", str(tmp_path), json.dumps(config)],
                          capture_output=True, text=True, timeout=90, cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(W.__file__), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0, done.stderr[-2000:]
    outs = results(tmp_path, 2)
    said = (outs[1]["plan"]["micro_batch"], [(t["batch_size"], t["peak_memory"], t["fits"]) for t in outs[1]["plan"]["trials"]],
            [w for w in outs[1]["warnings"] if "returned a view" not in w])
    assert outs[1]["plan"]["micro_batch"] > 1, said
    assert any("OutOfMemoryError raised on this rank" in w for w in outs[1]["warnings"]), said
    assert outs[1]["final_plan"]["micro_batch"] < outs[1]["plan"]["micro_batch"], said
    assert_exact(outs, config, 2)


def test_an_out_of_memory_error_inside_fsdp2s_own_collective_code_stops_every_rank(tmp_path):
    """Out of memory allocating an all-gather's buffer: rank 0 is already inside that all-gather, so the
    error cannot be shared; every rank stops within seconds, naming it, instead of hanging."""
    config = {"n": 45, "target": 7, "lengths": (4, 9), "limits": ["32KiB", "32KiB"], "optimizer": "adamw",
              "oom_rank": 1, "oom_in": "all_gather", "oom_call": 3}
    W.launch(2, str(tmp_path), "fsdp", config, timeout=60)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outs[1]["error"] == "OutOfMemoryError: injected: out of memory allocating an all-gather"
    assert outs[0]["error"].startswith("AutotuneError: rank 1 failed in this window, so every rank stops")
    assert "allocating an all-gather" in outs[0]["error"]
    assert abs(outs[0]["at"] - outs[1]["at"]) < 10


def test_out_of_memory_in_every_planning_trial_of_one_rank_is_named_on_every_rank(tmp_path):
    """Rank 1 runs out of memory in every trial: no size fits anywhere, and every rank's NothingFits says
    it was rank 1's, with its error (rank 0 once said its own step ran out of memory "twice")."""
    config = {"n": 45, "target": 7, "lengths": (4, 9), "limits": ["32KiB", "32KiB"], "optimizer": "adamw",
              "oom_rank": 1, "oom_in": "forward", "oom_call": 1, "oom_in_plan": True, "oom_every": True}
    W.launch(2, str(tmp_path), "fsdp", config, timeout=60)
    for r in range(2):
        error = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["error"]
        assert error.startswith("NothingFits: Even micro_batch=1 ran out of memory under FSDP2 on rank 1 (OutOfMemoryError: "
                                "injected: out of memory in a forward)"), error


PLANNING_OOM = SHARED.add("planning-oom", 2, "fsdp", {"n": 48, "target": 12, "lengths": (6, 6), "limits": [BIG, BIG], "optimizer": "adamw",
                                                      "oom_rank": 1, "oom_in": "forward", "oom_call": 1, "oom_in_plan": True})


def test_an_out_of_memory_error_in_a_planning_trial_gives_one_plan_on_every_rank(launched):
    """Rank 1 runs out of memory in the first trial (the whole share): every rank abandons it, the size
    does not fit on either, and the search below it takes the same path on both."""
    name, config = PLANNING_OOM
    outs = launched(name)
    plans = [o["plan"] for o in outs]
    first = [p["trials"][0] for p in plans]
    assert first[0]["batch_size"] == first[1]["batch_size"] == 6 and not first[0]["fits"] and not first[1]["fits"]
    for key in ("micro_batch", "accumulation_steps", "micro_batches"):
        assert plans[0][key] == plans[1][key], key
    assert [t["batch_size"] for t in plans[0]["trials"]] == [t["batch_size"] for t in plans[1]["trials"]]
    assert plans[0]["micro_batch"] < 6
    assert all(any("every rank abandoned that trial" in n for n in p["notes"]) for p in plans)
    assert_exact(outs, config, 2)


LEDGER = {f"{length}-tokens": SHARED.add(f"ledger-{length}-tokens", 2, "fsdp", {"n": 32, "target": 16, "lengths": (length, length),
                                                                                "limits": ["150KiB", "100KiB"], "optimizer": "adamw", "preloaded": True})
          for length in (48, 32)}


@pytest.mark.parametrize("case", list(LEDGER))
def test_the_plans_peak_is_the_ledgers_peak_per_rank(launched, case):
    """The probe's per-rank peak against the real per-rank peak counted over the whole of fit.

    Both peaks move between runs by up to one block's collective buffer (about 2 KiB here): gloo's
    threads release those buffers at racing times. The sizes keep that under 2% of the peak, so
    that the 5% bound tests the probe, not the race (at 16 tokens, a 45 KiB peak, it did not)."""
    name, config = LEDGER[case]
    outs = launched(name)
    for r, o in enumerate(outs):
        planned, counted = o["plan"]["peak_memory"], o["ledger_peak"]
        assert o["plan"]["accumulation_steps"] > 1
        assert abs(planned - counted) <= 0.05 * counted, (r, planned, counted)
        assert counted <= int(config["limits"][r][:-3]) * 1024


ESTIMATE = SHARED.add("estimate", 2, "fsdp", {"n": 32, "target": 16, "lengths": (48, 48), "limits": ["150KiB", "100KiB"], "optimizer": "adamw",
                                              "preloaded": True, "estimate": 3})


def test_the_estimate_from_the_unsharded_model_bounds_the_real_peak(launched):
    """autotune.planning.sharding's per-rank figure (what NothingFits and `report --shard` give) against
    the real per-rank peak of a sharded run at the same micro-batch: within 10%."""
    outs = launched(ESTIMATE[0])
    for r, o in enumerate(outs):
        assert o["plan"]["micro_batch"] == 3 and o["plan"]["accumulation_steps"] > 1
        assert abs(o["estimate"] - o["ledger_peak"]) <= 0.10 * o["ledger_peak"], (r, o["estimate"], o["ledger_peak"])


BN = {bn: SHARED.add(f"bn-{bn}", 2, "bn", {"n": 40, "target": 19, "bn": bn, "steps": 1, "limits": [3300, 3300], "fsdp": True, "micro": 3})
      for bn in ("adjust", "pooled")}


@pytest.mark.parametrize("bn", list(BN))
def test_batchnorm_under_fsdp2(launched, bn):
    """Shares 10 and 9 of 19, micro-batches of 3 (3, 3, 2, 2 and 3, 3, 3): rank 1 runs a zero-weight one
    whose BatchNorm statistics must not count. Pooled: one global big-batch forward's statistics."""
    name, config = BN[bn]
    outs = launched(name)
    micro = outs[0]["history"][0]["micro_batches"], outs[1]["history"][0]["micro_batches"]
    assert len(micro[0]) > len(micro[1]), micro
    for name in ("bn.running_mean", "bn.running_var"):
        assert torch.equal(outs[0]["params"][name], outs[1]["params"][name])
    if bn == "pooled":
        assert_pooled_is_one_global_forward(outs, config)


def gpt2_reference(config, world):
    """One process, float64: each global window (rank r's k-th share, for every r) one SGD step on
    the exact mean of the next-token losses of its samples, each sample run alone, unpadded."""
    import hf_models
    import torch.nn.functional as F
    from test_distributed import global_windows

    torch.set_default_dtype(torch.float64)
    try:
        samples = W.text_samples(config["n"])
        seqs = [[samples[i] for i in W.rank_indices(len(samples), r, world, "sampler")] for r in range(world)]
        model = hf_models.gpt2()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for _, window in zip(range(config["steps"]), global_windows(seqs, config["target"])):
            total = sum(F.cross_entropy(model(t.unsqueeze(0)).logits[0, :-1], t[1:], reduction="sum") for t in window)
            items = sum(t.shape[0] - 1 for t in window)
            opt.zero_grad(set_to_none=True)
            (total / items).backward()
            opt.step()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_default_dtype(torch.float32)


GPT2 = {case: SHARED.add(f"gpt2-{case}", 2, "fsdp_gpt2", {"n": 40, "target": 9, "steps": 3, "limits": ["5MiB", "5MiB"], "pad": pad})
        for case, pad in (("per-batch-padding", False), ("joined-by-length", True)) if importlib.util.find_spec("transformers")}


@pytest.mark.parametrize("case", ["per-batch-padding", "joined-by-length"])
def test_gpt2_with_attention_masks_and_dynamic_padding(launched, case):
    """A transformers model nobody here wrote, each block sharded, with attention masks: the
    next-token loss over the tokens the mask keeps, batches padded to their own longest sequence
    (or joined across lengths by pad_to_longest)."""
    pytest.importorskip("transformers")
    name, config = GPT2[case]
    outs = launched(name)
    assert outs[0]["plan"]["accumulation_steps"] > 1
    assert len(outs[0]["history"]) == config["steps"]
    want = gpt2_reference(config, 2)
    for o in outs:
        for name, value in want.items():
            assert (o["params"][name] - value).abs().max().item() <= 1e-10, name


@pytest.mark.parametrize("bad, when", [(81, "in this window"), (41, "looking at its first batches")], ids=["training", "first-batches"])
def test_a_bad_sample_on_one_rank_stops_every_rank_within_seconds(tmp_path, bad, when):
    config = {"n": 96, "target": 24, "lengths": (6, 6), "bad": bad, "bad_rank": 1, "limits": [BIG, BIG]}
    assert_stopped_together(tmp_path, "fsdp", config, bad, when)


def test_an_error_inside_one_ranks_forward_stops_every_rank_within_seconds(tmp_path):
    """Rank 1 raises inside its forward, in the middle of a window, while rank 0 waits in that forward's
    collective; rank 1 then lingers (no exit frees rank 0). Rank 0 stops within seconds, naming rank 1
    and its error, well before the process group's 20 s timeout."""
    config = {"n": 96, "target": 24, "lengths": (6, 6), "limits": [BIG, BIG], "fail_rank": 1, "fail_call": 3, "linger": 25}
    W.launch(2, str(tmp_path), "fsdp", config, timeout=60)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outs[1]["error"] == "ValueError: a failure inside the forward"
    assert outs[0]["error"].startswith("AutotuneError: rank 1 failed in this window, so every rank stops")
    assert "a failure inside the forward" in outs[0]["error"]
    assert outs[0]["at"] - outs[1]["at"] < 10


def test_a_rank_that_exits_inside_a_forward_is_named_by_the_others(tmp_path):
    """Rank 1's process leaves inside a forward of a window (os._exit), while rank 0 waits in that
    forward's all-gather: rank 0 says that rank 1 exited, within seconds."""
    config = {"n": 96, "target": 24, "lengths": (6, 6), "limits": [BIG, BIG], "exit_rank": 1, "exit_at": 3}
    seconds = W.launch(2, str(tmp_path), "fsdp", config, timeout=60)
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert not (tmp_path / "rank1.pt").exists()
    assert out["error"].startswith("AutotuneError: rank 1 exited in this window (its process is gone)"), out["error"]
    assert seconds < 40


def test_an_error_inside_a_planning_forward_is_named_on_every_rank(tmp_path):
    """The same failure during plan()'s lockstep trials: each rank raises the cause (rank 1 its own
    error, rank 0 naming rank 1 and it), not the transport's "connection closed" from a last gather on
    the aborted group."""
    config = {"n": 96, "target": 24, "lengths": (6, 6), "limits": [BIG, BIG], "fail_rank": 1, "fail_call": 2, "fail_in_plan": True}
    W.launch(2, str(tmp_path), "fsdp", config, timeout=60)
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert outs[1]["error"] == "ValueError: a failure inside the forward"
    assert outs[0]["error"].startswith("AutotuneError: rank 1 failed") and "a failure inside the forward" in outs[0]["error"]


# --- one process: what is refused ---------------------------------------------------------------


@pytest.fixture
def one_rank():
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(W.free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def data():
    return [(torch.randn(4, 4), torch.randint(0, 2, (4,)))]


def test_a_model_quantized_by_bitsandbytes_and_sharded_by_fsdp2_is_refused_before_anything_runs(one_rank):
    """``fully_shard`` makes a bitsandbytes 4-bit weight (stored as bf16, the FSDP-QLoRA setting) a plain DTensor without
    its quantization state, so its forward fails inside bitsandbytes: ``plan`` and ``fit`` say why first, and nothing
    changes."""
    bnb = pytest.importorskip("bitsandbytes")
    from torch.distributed.fsdp import fully_shard

    import autotune

    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", quant_storage=torch.bfloat16)
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64, dtype=torch.bfloat16), requires_grad=False, quant_type="nf4",
                                     quant_storage=torch.bfloat16).to("cpu")  # quantized on the CPU
    model = nn.Sequential(layer, nn.Linear(64, 2))
    fully_shard(model[0])
    fully_shard(model)
    assert not hasattr(model[0].weight, "quant_type")  # the premise: the sharded weight lost what it was
    before = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    loader = [(torch.randn(4, 64), torch.randint(0, 2, (4,)))]
    for verb in (autotune.plan, autotune.fit):
        with pytest.raises(ValueError, match=r"FSDP2 is not planned for weights quantized by bitsandbytes \(4-bit\).*one device"):
            verb(model, loader, target_batch=4, progress=False)
    assert all(torch.equal(before[k], v.full_tensor()) for k, v in model.state_dict().items())


@pytest.mark.filterwarnings("ignore:FSDP is switching to use `NO_SHARD`")  # torch's own, building FSDP1 on one rank
def test_fsdp1_points_to_fully_shard(one_rank):
    from torch.distributed.fsdp import FullyShardedDataParallel

    import autotune

    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match="fully_shard"):
        autotune.plan(model, data(), target_batch=8)
    with pytest.raises(TypeError, match="fully_shard"):
        autotune.fit(model, data(), 8, progress=False)


def test_a_model_sharded_only_inside_is_refused(one_rank):
    from torch.distributed.fsdp import fully_shard

    import autotune

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    with pytest.raises(TypeError, match="fully_shard"):
        autotune.plan(model, data(), target_batch=8)


def test_what_if_and_noise_scale_say_what_to_use_instead(one_rank):
    from torch.distributed.fsdp import fully_shard

    import autotune

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    with pytest.raises(ValueError, match="shard_plan"):
        autotune.what_if(model, data(), target_batch=8, memory_limit="1MiB", progress=False)
    with pytest.raises(ValueError, match="unsharded model"):
        autotune.noise_scale(model, data() * 4, micro_batch=2, micro_batches=2, windows=2)


def test_planning_without_real_trials_is_refused(one_rank):
    from torch.distributed.fsdp import fully_shard

    import autotune

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model)
    with pytest.raises(ValueError, match="--shard"):
        autotune.plan(model, data(), target_batch=8, verify=False)
