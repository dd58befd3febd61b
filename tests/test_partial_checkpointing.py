"""Activation checkpointing on a count of blocks, and ``checkpointing="auto"``: the fewest blocks that let the planned
micro-batch fit.

References, never the code's answer checked against itself: the estimate's peaks with one block fewer, a float64 step on
one big batch computed by hand, the number of times each block runs in the real step, and torch's ``FlopCounterMode``
on a real forward for the work a recomputed block adds.
"""

import copy
import dataclasses
import json
import types
import warnings

import pytest
import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

import autotune
from autotune.cli.main import main
from autotune.cli.parser import make_parser
from autotune.memory.checkpointing import activation_checkpointing, blocks
from autotune.probe.estimate import Estimator
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402

aten = torch.ops.aten
# torch's counter counts the CPU's fused attention kernel as nothing: CUDA's flash kernel's formulas (same arguments).
CPU_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__,
}


def tokens(b, length, vocab, seed=0):
    ids = torch.randint(0, vocab, (b, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def own_loss(model, batch):
    return model(**batch).loss


def peak(model, batch, b, checkpointing):
    """The estimate's peak of the step at micro-batch ``b`` (a fresh estimator: nothing kept from a plan)."""
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cpu"), checkpointing=checkpointing)
    return Estimator(work)(b)


# --- "auto": the fewest blocks with which the micro-batch fits ------------------------------------------------------


@pytest.fixture(scope="module")
def deep_llama():
    """A 16-layer Llama shape with wide MLPs and 256 tokens: its activations dominate, so that with no block
    checkpointed one sample needs more than eight do with every block checkpointed. The limit lies between the two,
    from the estimate's own peaks."""
    model = hf_models.llama(layers=16, dim=32, mlp=512, vocab=32)
    batch = tokens(8, 256, 32)
    none_1, all_8 = peak(model, batch, 1, False), peak(model, batch, 8, True)
    assert none_1 > all_8  # the shape the test needs
    limit = (none_1 + all_8) // 2
    plan = autotune.plan(model, [batch], target_batch=8, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         loss_fn=own_loss, memory_limit=limit, headroom=0.0, checkpointing="auto", verify=False, progress=False)
    return model, batch, limit, plan


def test_auto_checkpoints_the_fewest_blocks_with_which_the_micro_batch_fits(deep_llama):
    model, batch, limit, plan = deep_llama
    total = len(blocks(model))
    assert peak(model, batch, 1, False) > plan.budget  # without checkpointing not even one sample fits
    assert plan.micro_batch == 8  # as with every block checkpointed
    k = plan.checkpointing
    assert type(k) is int and 0 < k < total
    assert peak(model, batch, 8, k) <= plan.budget < peak(model, batch, 8, k - 1 or False)
    assert peak(model, batch, 8, k) == plan.peak_memory
    assert dict(plan.setting)["checkpointing"] == f"activation checkpointing on {k} of {total} blocks (the first)"
    assert any(f"the first {k} of {total} blocks checkpointed" in n and f"{k - 1} do not" in n for n in plan.notes)
    again = autotune.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.checkpointing == k and type(again.checkpointing) is int


def test_an_auto_plans_trials_say_the_blocks_each_ran_with_and_hold_the_count_search(deep_llama):
    """Every trial of an "auto" plan says the checkpointing it ran with, and its bytes are a fresh estimate's at its size
    with those blocks: the search with every block, the count search's tries at the micro-batch (among them the count
    below the answer, which does not fit), the answer's own, each once. The report's Trials table gives the blocks
    beside each."""
    from autotune.planning.report import render_text

    model, batch, limit, plan = deep_llama
    k = plan.checkpointing
    assert {t.checkpointing for t in plan.trials} >= {True, k, k - 1 or False}
    for t in plan.trials:
        fresh = peak(model, batch, t.batch_size, t.checkpointing)
        if t.checkpointing is True:  # traced on copies of few blocks (see autotune.probe.depth)
            assert t.peak_memory == pytest.approx(fresh, rel=1e-3)
        else:
            assert t.peak_memory == fresh
        assert t.fits == (t.peak_memory <= plan.budget)
    assert any(t.batch_size == plan.micro_batch and t.checkpointing == (k - 1 or False) and not t.fits for t in plan.trials)
    # each trace once: the answer's count confirmed on the trace its search made is not listed again
    tried = [(t.batch_size, type(t.checkpointing), t.checkpointing) for t in plan.trials]
    assert len(tried) == len(set(tried)), plan.trials
    table = render_text(plan).split("\nTrials\n")[1].split("\n\n")[0].splitlines()
    assert table[0].split()[-2:] == ["checkpointed", "blocks"]
    said = {("all" if t.checkpointing is True else f"first {t.checkpointing}" if t.checkpointing else "none") for t in plan.trials}
    assert {" ".join(row.split()[6:]) for row in table[1:]} == said  # batch, bytes and unit, fits, kind, seconds, blocks


def test_an_auto_plans_plot_draws_the_trials_of_its_own_count(deep_llama, tmp_path, monkeypatch):
    """``--plot`` draws the memory curve of the plan's setting: the trials made with its count of blocks, not those of
    the search with every block or the counts tried."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from autotune.cli.render import plot_memory

    _, _, _, plan = deep_llama
    drawn = []
    original = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda ax, x, y, *a, **k: drawn.extend(zip(x, y)) or original(ax, x, y, *a, **k))
    plot_memory(plan, tmp_path / "memory.png")
    own = [(t.batch_size, t.peak_memory / 2**20) for t in plan.trials if t.checkpointing == plan.checkpointing and type(t.checkpointing) is int]
    assert own and sorted(drawn) == sorted(own)
    assert len(own) < len(plan.trials)


def test_auto_on_a_mixture_of_experts_checkpoints_the_fewest_blocks_with_which_the_micro_batch_fits():
    """A Mixtral shape (experts run one by one, estimated grouped: the note says so), its router's logits an output of
    every block, under a limit between micro-batch 8's peak with no block checkpointed and with every one: the count
    found fits micro-batch 8, one fewer does not, by the estimate."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                        router_aux_loss_coef=0.02, max_position_embeddings=256, experts_implementation="eager")
    model = transformers.MixtralForCausalLM(config)
    batch = tokens(8, 128, 64)
    plain, every = peak(model, batch, 8, False), peak(model, batch, 8, True)
    plan = autotune.plan(model, [batch], target_batch=8, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss,
                         memory_limit=(plain + every) // 2, headroom=0.0, checkpointing="auto", verify=False, progress=False)
    k, m = plan.checkpointing, plan.micro_batch
    count = len(blocks(model)) if k is True else k
    assert m == 8 and type(count) is int and 0 < count < len(blocks(model))
    assert peak(model, batch, m, k) <= plan.budget < peak(model, batch, m, (count - 1) or False)
    assert any("mixture of experts" in n for n in plan.notes)


def test_auto_on_qlora_checkpoints_the_fewest_blocks_with_which_the_micro_batch_fits_and_the_real_step_fits():
    """A Llama shape in nf4 with LoRA on every linear layer (bitsandbytes' CPU kernels), under a limit between micro-batch
    8's peak with no block checkpointed and with every one: the count found fits micro-batch 8 and one fewer does not,
    by the estimate, and the plan's real step at that count fits its budget."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    model = hf_models.llama(layers=4, dim=64, mlp=512, vocab=64)
    autotune.quantize(model, "nf4")
    with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    batch = tokens(8, 128, 64)

    def adam():
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def qpeak(b, checkpointing):
        work = Workload(model=model, optimizer=adam(), loss_fn=own_loss, batch=batch, device=torch.device("cpu"),
                        checkpointing=checkpointing)
        return Estimator(work)(b)

    plain, every = qpeak(8, False), qpeak(8, True)
    plan = autotune.plan(model, [batch], target_batch=8, optimizer=adam(), loss_fn=own_loss, memory_limit=(plain + every) // 2,
                         headroom=0.0, checkpointing="auto", progress=False)
    k = plan.checkpointing
    assert plan.micro_batch == 8 and type(k) is int and 0 < k < len(blocks(model))
    assert qpeak(8, k) <= plan.budget < qpeak(8, (k - 1) or False)
    real = [t for t in plan.trials if not t.estimate and t.batch_size == 8]
    assert real and real[-1].fits and real[-1].peak_memory <= plan.budget


def test_autos_predicted_step_is_shorter_than_full_checkpointings(deep_llama):
    from autotune.memory.gpus import gpu_named
    from autotune.memory.timing import predict

    model, batch, _, plan = deep_llama

    def step(checkpointing):
        work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                        device=torch.device("cpu"), checkpointing=checkpointing)
        return predict(Estimator(work).work(8), gpu_named("a100-80gb-sxm"), samples=8)

    partial, full = step(plan.checkpointing), step(True)
    assert partial.flops < full.flops  # fewer blocks run their forward again
    assert partial.micro_step < full.micro_step


def test_the_first_blocks_are_checkpointed_because_that_peak_is_lowest(monkeypatch):
    """The rule the module docstring gives: for the same count, the first blocks peak below the last ones, or every
    other one."""
    from autotune.memory import checkpointing

    model = hf_models.llama(layers=8, dim=32, mlp=256, vocab=32)
    batch = tokens(4, 128, 32)
    first = peak(model, batch, 4, 4)
    for other in (lambda found, k: found[len(found) - k:], lambda found, k: found[1::2][:k]):
        monkeypatch.setattr(checkpointing, "chosen", other)
        assert first < peak(model, batch, 4, 4)


# --- fit trains with exactly the count, and equals one big batch ----------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.usefixtures("float64")
def test_fit_with_a_count_equals_one_big_batch_and_checkpoints_exactly_those_blocks(name):
    model = getattr(hf_models, name)(layers=4).double()
    reference = copy.deepcopy(model)
    loader = [tokens(8, 32, 500, seed=s) for s in range(2)]
    plan = autotune.plan(model, loader[:1], target_batch=8, loss_fn=own_loss, memory_limit="1GiB", lr_rule="none",
                         checkpointing=2, verify=False, progress=False)
    assert plan.checkpointing == 2
    plan = dataclasses.replace(plan, micro_batch=4, micro_batches=(4, 4), accumulation_steps=2)  # two micro-steps a window
    runs = [0] * 4
    for i, block in enumerate(blocks(model)):  # a block's first module runs once more in a recomputation
        next(block.children()).register_forward_pre_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + torch.is_grad_enabled()))

    autotune.fit(model, loader[:1], optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=own_loss, plan=plan,
                 progress=False, noise_scale=False)

    # the first two blocks, and only they, run once more in each of the two micro-steps' backwards
    assert runs[0] == runs[1] == runs[2] + 2 == runs[3] + 2 and runs[3] >= 2
    assert all("forward" not in block.__dict__ for block in blocks(model)) and model.config.use_cache  # put back
    own_loss(reference, loader[0]).backward()  # one big batch, by hand
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())) <= 1e-12


def lora_llama(layers=2):
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(hf_models.llama(layers=layers), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def test_checkpointing_puts_back_the_input_embeddings_hooks_transformers_switch_adds():
    """Transformers' checkpointing switch also hooks the input embeddings so that their output requires grad, and its
    off switch leaves the hook on: with a frozen embedding (LoRA) every later step would keep that output in autograd's
    graph. After the run the model's hooks are as they were: none, or the user's own, the very same."""
    model = lora_llama()
    embeddings = model.get_input_embeddings()
    ids = torch.randint(0, 500, (1, 8))
    assert not embeddings(ids).requires_grad  # frozen: the shape the test needs
    with activation_checkpointing(model, True):
        assert embeddings._forward_hooks and embeddings(ids).requires_grad  # the switch's hook, as the Trainer runs it
    assert not embeddings._forward_hooks and not embeddings(ids).requires_grad
    assert not any(hasattr(m, "_require_grads_hook") or getattr(m, "_require_grads_hooks", None) for m in model.modules())

    model.enable_input_require_grads()  # the user's own, before the run
    (own,) = model.base_model.model._require_grads_hooks
    hooks = dict(embeddings._forward_hooks)
    with activation_checkpointing(model, True):
        pass
    assert dict(embeddings._forward_hooks) == hooks and model.base_model.model._require_grads_hooks == [own]
    assert model.base_model.model._require_grads_hook is own and embeddings(ids).requires_grad


def test_an_estimate_without_checkpointing_is_the_same_after_one_with_it():
    """The estimate keeps one fake copy of a model's structure for every setting (a plan's what-if rows estimate with
    and without checkpointing): the checkpointed estimate's switch must leave nothing on it that changes the next.
    LoRA's frozen embedding, estimated without checkpointing: the same peak fresh and after an estimate with every
    block checkpointed (the hook left on made it about 2% more here, 33.5 MiB on the Llama-3-8B shape)."""
    from autotune.probe.estimate import estimator_for, forget

    def estimated(checkpointing):
        model = lora_llama(2)
        work = Workload(model=model, optimizer=torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
                        loss_fn=own_loss, batch=batch, device=torch.device("cpu"), checkpointing=checkpointing)
        return estimator_for(work).trace(2).peak

    batch = tokens(4, 128, 500)
    forget()
    fresh = estimated(False)
    forget()
    estimated(True)
    assert estimated(False) == fresh
    forget()


# --- the estimate's work: one more forward for each checkpointed block ----------------------------------------------


def test_the_estimated_work_counts_one_more_forward_of_each_checkpointed_block():
    """With torch's early stop off a checkpointed block's backward runs its whole forward again: the backward's FLOPs
    grow by the first k blocks' forward FLOPs, as torch counts them on a real forward, from none to all."""
    model = hf_models.llama(layers=4)
    batch = tokens(2, 32, 500)
    with set_checkpoint_early_stop(False):
        work = [peakless_work(model, batch, k or False) for k in range(4)] + [peakless_work(model, batch, True)]
    real = copy.deepcopy(model)
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION) as counter, torch.no_grad():
        own_loss(real, batch)
    per_block = [sum(counter.get_flop_counts()[f"LlamaForCausalLM.model.layers.{i}"].values()) for i in range(4)]
    assert min(per_block) > 0
    forward = {w.of(phase="forward").flops for w in work}
    assert len(forward) == 1  # the forward is the same whatever is checkpointed
    backward = [w.of(phase="backward").flops for w in work]
    assert [b - backward[0] for b in backward] == [sum(per_block[:k]) for k in range(5)]


def peakless_work(model, batch, checkpointing):
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cpu"), checkpointing=checkpointing)
    return Estimator(work).work(2)


# --- bad values ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, r"Invalid checkpointing -1: a count of blocks is at least 0"),
    (5, ValueError, r"Invalid checkpointing 5 for LlamaForCausalLM: it has 4 blocks; give a count from 0 to 4"),
    ("some", TypeError, r"Invalid checkpointing 'some' \(str\): give True or False, 'auto'"),
    (2.5, TypeError, r"Invalid checkpointing 2.5 \(float\): give True or False, 'auto' .* or a count of blocks"),
], ids=["negative", "above the blocks", "another word", "a float"])
@pytest.mark.parametrize("verb", ["plan", "fit"])
def test_bad_values_are_refused_before_anything_changes(value, error, match, verb):
    model = hf_models.llama(layers=4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(error, match=match):
        getattr(autotune, verb)(model, [tokens(4, 16, 500)], target_batch=4, loss_fn=own_loss, checkpointing=value,
                                progress=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any("forward" in block.__dict__ for block in blocks(model))


@pytest.mark.parametrize("value", [1, "auto"])
def test_a_count_for_a_model_without_blocks_is_refused(value):
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=rf"Invalid checkpointing {value!r} for Linear: it has no nn.ModuleList of blocks") as caught:
        autotune.plan(model, [(torch.randn(4, 4), torch.randn(4, 2))], target_batch=4, checkpointing=value, progress=False)
    assert "give False, or wrap" in str(caught.value)  # not True: every block is refused too, for want of blocks
    with pytest.raises(ValueError, match="Invalid checkpointing=True for Linear"):
        autotune.plan(model, [(torch.randn(4, 4), torch.randn(4, 2))], target_batch=4, checkpointing=True, progress=False)
    with pytest.raises(ValueError, match="Invalid checkpointing 1 for Linear"), activation_checkpointing(model, 1):
        pass


def test_a_plan_with_a_word_for_its_count_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    plan = autotune.plan(model, [(torch.randn(4, 4), torch.randn(4, 2))], target_batch=4, progress=False)
    with pytest.raises(ValueError, match=r"Invalid plan data: checkpointing .auto. is neither a bool nor a count of blocks"):
        autotune.Plan.from_dict({**plan.to_dict(), "checkpointing": "auto"})


# --- the command line -----------------------------------------------------------------------------------------------


def test_the_command_line_takes_auto_a_count_or_the_flag_alone(capsys):
    code = main(["report", "--demo", "--checkpointing", "3", "--json", "--no-cache"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["checkpointing"] == 3 and plan["setting"]["checkpointing"] == "activation checkpointing on 3 of 12 blocks (the first)"
    code = main(["report", "--demo", "--checkpointing", "auto", "--json", "--no-cache"])
    out, err = capsys.readouterr()
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert any(n.startswith("checkpointing='auto'") for n in plan["notes"])
    assert main(["report", "--demo", "--checkpointing", "13", "--no-cache"]) == 2
    assert "Invalid --checkpointing 13: Sequential has 12 blocks; give a count from 0 to 12, auto" in capsys.readouterr().err
    parse = make_parser().parse_args
    assert parse(["report", "--checkpointing", "model.py:make"]).checkpointing is True  # MODEL after the flag stays MODEL
    assert parse(["report", "--checkpointing", "model.py:make"]).model == "model.py:make"
    assert parse(["report", "model.py:make", "--checkpointing", "auto"]).checkpointing == "auto"


def test_auto_for_a_card_takes_the_fastest_micro_batch_and_count_it_weighs():
    """The micro-batch and count ``fastest_setting`` takes are the fastest predicted among the largest micro-batch and
    its halves, each with the fewest blocks that fit it, found here by the estimate's peaks (a fresh estimator)."""
    from autotune.memory.gpus import gpu_named
    from autotune.memory.timing import predict
    from autotune.probe.partial import fastest_setting

    model, batch = hf_models.llama(layers=6, dim=32, mlp=512, vocab=32), tokens(8, 128, 32)
    total, card, share = len(blocks(model)), gpu_named("h100-sxm"), 8
    budget = (peak(model, batch, 4, False) + peak(model, batch, 8, True)) // 2

    def setting(k):
        return True if k == total else (k or False)

    def step(b, k):
        w = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                     device=torch.device("cpu"), checkpointing=setting(k))
        return predict(Estimator(w).work(b), card, accumulation=-(-share // b), samples=share).step

    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cpu"))
    m, count, weighed = fastest_setting(work, 8, budget, card=card, share=share)
    assert peak(model, batch, m, setting(count)) <= budget
    assert count == 0 or peak(model, batch, m, setting(count - 1)) > budget
    times = {}
    for b in (8, 4, 2, 1):
        k = next(k for k in range(total + 1) if peak(model, batch, b, setting(k)) <= budget)
        times[b] = step(b, k)
        if k == 0:
            break
    assert 0 < count and len(times) >= 2  # the shape the test needs: at 8 some blocks must be checkpointed
    assert step(m, count) == pytest.approx(min(times.values()), rel=1e-9)
    assert len(weighed) == len(times)


@pytest.mark.parametrize("close", [0.0, 10.0])
def test_auto_where_the_prediction_cannot_tell_the_candidates_apart_times_them_with_real_steps(close, monkeypatch):
    """Where the plan runs real steps and the candidates' predicted steps lie within ``partial.CLOSE`` of the fastest, each
    is confirmed by the probe at its micro-batch and count, and the one whose real trial steps make the shortest optimizer
    step is taken (here on the CPU, planned as for a card: ``card_here`` gives one, as NVML's name does on a GPU; CLOSE
    set so that every candidate is close, or none)."""
    import autotune.planning.planner as planner
    from autotune.memory.gpus import gpu_named
    from autotune.probe import partial

    model, batch = hf_models.llama(layers=6, dim=32, mlp=512, vocab=32), tokens(8, 128, 32)
    limit = (peak(model, batch, 4, False) + peak(model, batch, 8, True)) // 2
    monkeypatch.setattr(planner, "card_here", lambda device: gpu_named("h100-sxm"))
    monkeypatch.setattr(partial, "CLOSE", close)
    before = copy.deepcopy(model.state_dict())
    plan = autotune.plan(model, [batch], target_batch=8, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                         loss_fn=own_loss, memory_limit=limit, headroom=0.0, checkpointing="auto", progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    weighed = next(n for n in plan.notes if n.startswith("checkpointing='auto' weighed, predicted"))
    candidates = [int(m) for m in __import__("re").findall(r"micro-batch (\d+) with", weighed)]
    assert len(candidates) >= 2  # the shape the test needs
    real = {}  # each size's last real trial: the timing's (a trial at the first size found ran with every block checkpointed)
    for t in plan.trials:
        if not t.estimate and t.fits:
            real[t.batch_size] = (t.micro_step, t.optimizer_step)
    timed = [n for n in plan.notes if "timed the" in n]
    if close == 0.0:
        assert not timed and set(real) == {plan.micro_batch}  # the fastest predicted, confirmed alone
        assert (plan.step_time.micro_step, plan.step_time.optimizer) == real[plan.micro_batch]  # not the search's
        assert "over 1 trial step" in plan.step_time.basis
        return
    assert len(timed) == 1 and f"timed the {len(candidates)} predicted" in timed[0], plan.notes
    assert set(candidates) <= set(real)  # every candidate ran for real at its micro-batch
    step = {m: -(-8 // m) * real[m][0] + real[m][1] for m in candidates}
    assert plan.micro_batch == min(step, key=step.get)
    assert (plan.step_time.micro_step, plan.step_time.optimizer) == real[plan.micro_batch]  # its own trial
    assert "over 1 trial step" in plan.step_time.basis
    k = plan.checkpointing
    count = 0 if k is False else len(blocks(model)) if k is True else k
    assert peak(model, batch, plan.micro_batch, k) <= plan.budget
    assert count == 0 or peak(model, batch, plan.micro_batch, (count - 1) or False) > plan.budget  # the fewest for it


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["for the cpu", "estimated for cuda"])  # "cuda" alone marks a test for a GPU
def test_whether_a_count_fits_from_one_trace_is_the_estimators_own_search_at_every_count(device):
    """``partial.needed`` decides a count from one trace at the micro-batch (for CUDA, the allocator's replay of that
    trace's own allocations); the estimator's ``largest`` decides it from its curve of two sizes, a confirming trace and
    its own replay. At every count of blocks and a budget at each count's own figure and just below it, they agree."""
    from autotune.memory.allocator import cublas_workspace, expandable_segments, replay, steady_state
    from autotune.probe.estimate import estimator_for
    from autotune.probe.partial import needed

    model, batch = hf_models.llama(layers=4, dim=32, mlp=256, vocab=32), tokens(8, 64, 32)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device(device), precision="bf16" if device == "cuda" else "fp32")
    total, b = len(blocks(model)), 6
    for count in range(total + 1):
        setting = True if count == total else (count or False)
        fresh = estimator_for(work, checkpointing=setting)
        at = fresh.trace(b)
        need = at.peak
        if device == "cuda":
            events = steady_state(at.held, list(at.events), fresh.step_events(), workspace=cublas_workspace())
            need = replay(events, expandable=expandable_segments()).reserved
        for budget in (need, need - 1, need + 2**20):
            searched = estimator_for(work, checkpointing=setting).largest(budget, b)[0] >= b
            assert needed(estimator_for(work, checkpointing=setting), b, budget)[0] == searched, (count, budget)


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["for the cpu", "estimated for cuda"])  # "cuda" alone marks a test for a GPU
def test_the_count_searchs_first_line_is_drawn_through_the_whole_models_bytes_with_none_and_every_block(device):
    """The count search starts from the bytes of no block and of every block checkpointed, which copies of a few blocks
    give without tracing the whole model. They are the bytes a trace of the whole model gives (a fresh estimator of it,
    read as the search reads any count: the allocator's reserved bytes for CUDA, else the tensors' peak);
    and a count of blocks, traced whole, gives none (a trace of it would cost what trying it does)."""
    from autotune.probe.depth import DepthEstimator
    from autotune.probe.estimate import estimator_for
    from autotune.probe.partial import _copies_bytes, needed

    layers = 24 if device == "cuda" else 12  # a CUDA target copies more blocks (see autotune.probe.depth)
    model, batch = hf_models.llama(layers=layers, dim=16, mlp=64, vocab=32), tokens(8, 32, 32)
    for setting in (False, True, 5):
        work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                        device=torch.device(device), precision="bf16" if device == "cuda" else "fp32", checkpointing=setting)
        copies = estimator_for(work, checkpointing=setting)
        if setting == 5:
            assert not isinstance(copies, DepthEstimator) and _copies_bytes(copies, 3) is None
            continue
        assert isinstance(copies, DepthEstimator)
        assert _copies_bytes(copies, 5) == needed(Estimator(work), 5, 2**40)[1], setting


def test_the_what_if_table_keeps_a_count_of_blocks_in_your_own_row_and_times_it_so():
    """Your own row of the what-if table is your setting: a count of checkpointed blocks stays that count (its words,
    its column, its LoRA row), and its step is timed with that many blocks recomputed, shorter than with every block."""
    model, batch = hf_models.llama(layers=6, dim=32, mlp=512, vocab=32), tokens(8, 128, 32)

    def table(checkpointing):
        return autotune.what_if(model, [batch], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                loss_fn=own_loss, checkpointing=checkpointing, gpu="h100-sxm", progress=False)

    counted, every = table(3), table(True)
    own = next(r for r in counted.rows if r.changes == 0)
    assert own.checkpointing == 3 and type(own.checkpointing) is int
    assert "activation checkpointing on the first 3 blocks" in own.describe()
    assert any(line.split()[1:3] == ["first", "3"] for line in str(counted).splitlines())
    lora = next(r for r in counted.rows if r.adapters and not r.adapters.startswith("QLoRA"))
    assert lora.checkpointing == 3 and lora.changes == 1
    off = next(r for r in counted.rows if r.checkpointing is False and not r.adapters and r.changes == 1 and r.precision == own.precision)
    all_blocks = next(r for r in every.rows if r.changes == 0)
    assert all_blocks.checkpointing is True
    assert off.step_time < own.step_time < all_blocks.step_time  # 0, 3 and 6 blocks' forwards run again


def test_a_sharded_estimate_keeps_a_count_of_blocks(capsys):
    """``shard_plan`` and ``report --shard`` with a count of checkpointed blocks estimate that count: a rank's activations
    lie between no checkpointing's and every block's, and the setting says the count."""
    model, batch = hf_models.llama(layers=6, dim=32, mlp=512, vocab=32), tokens(8, 128, 32)

    def activations(checkpointing):
        (row,) = autotune.shard_plan(model, [batch], target_batch=16, ranks=2, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                     loss_fn=own_loss, device="cpu", memory_limit="1GiB", checkpointing=checkpointing)
        return row.parts["activations"]

    assert activations(False) > activations(3) > activations(True)
    code = main(["report", "--demo", "--shard", "2", "--checkpointing", "3", "--memory-limit", "1GiB", "--json", "--no-cache"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["setting"]["checkpointing"] == "activation checkpointing on 3 of 12 blocks (the first)"
    code = main(["report", "--demo", "--shard", "2", "--checkpointing", "auto", "--memory-limit", "1GiB", "--json", "--no-cache"])
    out, err = capsys.readouterr()
    assert code == 0, err
    row = json.loads(out)["fsdp2"]
    assert any(n.startswith("checkpointing='auto': every block checkpointed in this estimate") for n in row["notes"])  # said
    assert json.loads(out)["setting"]["checkpointing"] == "activation checkpointing on the model's blocks"  # every block, as said


@pytest.mark.parametrize("seeded", [False, True], ids=["whole", "seeded"])
@pytest.mark.parametrize("shape", ["affine", "convex", "floor", "steps"])
@pytest.mark.parametrize("budget", [5, 40, 77, 99, 120])
def test_the_count_search_finds_the_fewest_that_fit_in_no_more_than_twice_a_bisections_steps(shape, budget, seeded, monkeypatch):
    """``fewest_blocks`` tries counts where the line through two counts' bytes meets the budget: whatever the bytes'
    shape against the count (affine, convex, a floor that checkpointing does not lower, steps), the answer is the
    fewest that fit, found by brute force here, in at most twice the steps a bisection takes. Seeded: none and every
    block's bytes come from copies of few blocks (cheap, not tried), and the line through them is the first try."""
    import math

    from autotune.probe import partial

    total = 32
    need = {
        "affine": lambda k: 130 - 3 * k,
        "convex": lambda k: 30 + (32 - k) ** 2 // 10,
        "floor": lambda k: max(130 - 4 * k, 60),
        "steps": lambda k: 130 - 10 * (k // 8),
    }[shape]
    tried = []
    monkeypatch.setattr(partial, "blocks", lambda model: [None] * total)
    monkeypatch.setattr(partial, "estimator_for", lambda work, checkpointing: types.SimpleNamespace(setting=checkpointing, on_trace=None))

    def needed(estimator, b, budget_, confirm=True):
        count = total if estimator.setting is True else int(estimator.setting)
        tried.append(count)
        return need(count) <= budget_, need(count)

    monkeypatch.setattr(partial, "needed", needed)
    monkeypatch.setattr(partial, "_copies_bytes", lambda estimator, b: need(total if estimator.setting is True else 0) if seeded and estimator.setting in (False, True) else None)
    recorded = []
    work = types.SimpleNamespace(model=None, record=recorded.append)
    found = partial.fewest_blocks(work, 8, budget)
    # each count tried is a trial of the plan: its size, bytes, verdict and count
    assert [(t.batch_size, t.peak_memory, t.fits, t.checkpointing) for t in recorded] == [
        (8, need(k), need(k) <= budget, k or False) for k in tried]
    fitting = [k for k in range(total + 1) if need(k) <= budget]
    expected = fitting[0] if fitting else total  # every block is taken to fit
    assert found == expected
    bisection = math.ceil(math.log2(total + 2))
    assert len(tried) <= 2 * bisection, tried
    if shape == "affine":
        assert len(tried) <= (2 if seeded else 4), tried  # the line lands on the answer: it, and the count below it


@pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["for the cpu", "estimated for cuda"])  # "cuda" alone marks a test for a GPU
def test_auto_searches_the_count_only_for_candidates_that_could_be_the_fastest(device, monkeypatch):
    """``fastest_setting`` first reads each candidate's count off the line through none and every block's bytes (shallow
    copies, no trace of the whole model) and searches the count only where the step predicted with ``SLACK`` blocks
    fewer could be the fastest. On a compute-bound Llama shape (meta device, 2048 tokens, for an H100) it takes the
    micro-batch and count that searching every candidate takes, searches fewer of them, and each count read lies
    within ``SLACK`` blocks above the count searched (the premise of the slack)."""
    import re

    from transformers import LlamaConfig, LlamaForCausalLM

    from autotune.memory.gpus import gpu_named
    from autotune.probe import partial
    from autotune.probe.estimate import estimator_for

    layers = 16 if device == "cuda" else 12  # a CUDA target copies more blocks (see autotune.probe.depth)
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
                         intermediate_size=8192, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    batch = tokens(1, 2048, 32000)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device(device), precision="bf16")
    none_1 = partial._copies_bytes(estimator_for(work, checkpointing=False), 1)
    every_8 = partial._copies_bytes(estimator_for(work, checkpointing=True), 8)
    budget = int(every_8 + 0.3 * (none_1 - every_8))
    searched = []
    fewest = partial.fewest_blocks
    monkeypatch.setattr(partial, "fewest_blocks", lambda work, m, *a, **k: searched.append(m) or fewest(work, m, *a, **k))
    card = gpu_named("h100-sxm")
    m, count, weighed = partial.fastest_setting(work, 8, budget, card=card, share=32)
    read_first = list(searched)
    searched.clear()
    monkeypatch.setattr(partial, "_read_counts", lambda *a: None)  # every candidate searched
    every_m, every_count, every_weighed = partial.fastest_setting(work, 8, budget, card=card, share=32)
    assert (m, count) == (every_m, every_count)
    assert 1 < m < 8 and 0 < count < layers  # the shape the test needs: neither end is the fastest
    assert len(read_first) < len(searched) == len(every_weighed) and len(weighed) == len(every_weighed)
    exact = {o[1]: o[2] for o in every_weighed}
    for step, size, k, words in weighed:
        assert (" about " in words) == (size not in read_first), words
        assert exact[size] <= k <= exact[size] + partial.SLACK, (size, k, exact[size])
        if size not in read_first:
            assert re.search(rf"micro-batch {size} with about {k} of {layers} blocks", words)
            assert next(o[0] for o in every_weighed if o[1] == size) > min(o[0] for o in every_weighed)  # truly slower
    said = partial.weighed(weighed, close=0.0)
    assert said.endswith("not searched: slower than the fastest even with 2 blocks fewer)") and "with about" in said
    assert "about:" not in partial.weighed(every_weighed, close=0.0)


def test_a_counts_bytes_for_cuda_are_what_the_allocator_reserves_under_the_budget():
    """Where CUDA's caching allocator serves a count's step under the budget only by releasing its cached segments, the
    bytes ``needed`` gives for it are what the allocator reserves under that cap: within the budget, as its verdict
    (the count search's trial said 20.19 GiB "fits" for a 19.56 GiB budget); where it does not fit, over the budget.
    A Llama shape of 1024 tokens and a 5000-word vocabulary, its first 2 of 4 blocks checkpointed, at 3 samples."""
    from autotune.probe.partial import needed

    model, batch = hf_models.llama(layers=4, dim=64, mlp=512, vocab=5000), tokens(8, 1024, 5000)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cuda"), precision="bf16")
    estimator, mib = Estimator(work, checkpointing=2), 2**20
    uncapped = needed(estimator, 3, 2**40)[1]
    tensors = estimator.trace(3).peak
    answers = {budget: needed(estimator, 3, budget) for budget in range(uncapped - 64 * mib, uncapped + mib, 4 * mib)}
    assert any(ok for budget, (ok, _) in answers.items() if budget < uncapped)  # the shape the test needs
    assert any(not ok for ok, _ in answers.values())
    for budget, (ok, n) in answers.items():
        assert ok == (n <= budget), (budget, ok, n)
        assert n >= tensors + 32 * mib  # at least the tensors and cuBLAS's workspace


def test_a_count_decided_at_two_samples_is_confirmed_on_its_own_trace_without_new_ones():
    """``needed`` decides a count of blocks at micro-batch 2 from one trace there (for CUDA, the allocator's replay of its
    allocations); the plan then asks the estimator's own search up to 2, which traces the largest size first and reads
    the allocations at 2 off that same trace: no new trace, and the same answer at the count's own bytes and below."""
    from autotune.probe.estimate import estimator_for
    from autotune.probe.partial import needed

    model, batch = hf_models.llama(layers=4, dim=32, mlp=256, vocab=32), tokens(8, 64, 32)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss, batch=batch,
                    device=torch.device("cuda"), precision="bf16")
    fresh = Estimator(work, checkpointing=2)
    ok, need = needed(fresh, 2, 2**40)
    assert ok and len(fresh._traces) == 1
    assert fresh.largest(need, 2)[0] == 2 and len(fresh._traces) == 1  # fits at its own bytes, read off its own trace
    assert needed(fresh, 2, need - 2**20)[0] is False and fresh.largest(need - 2**20, 2)[0] < 2  # a MiB less: neither
