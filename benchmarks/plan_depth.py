"""How an estimate-only plan's time grows with depth, and what its step time costs: Llama shapes of 8, 32 and 80 layers,
and GPT-2 small.

Each model is built on the meta device (no weights): a Llama-3-8B-shaped layer (4096 wide, grouped-query
attention 32/8, MLP 14336, vocabulary 128256) repeated 8, 32 and 80 times, in bf16, at 4096 tokens; and
GPT-2 small (12 layers of 768) at 1024 tokens. For each, ``autotune.plan(..., verify=False)`` from nothing
kept (``autotune.probe.estimate.forget()``), with AdamW, for two targets:

- the CPU (``device="cpu"``, bf16 autocast, a budget of 2 TiB so every depth finds a size): models of
  repeated blocks are traced with 2, 3 and 4 blocks and extended (``autotune.probe.depth``);
- CUDA (``device="cuda"``, the same 2 TiB, so the 32- and 80-layer shapes find a size too): traced with 3, 4
  and 5 blocks, whose allocations are extended to the full depth and replayed as the caching allocator would
  (the 8-layer shape is traced whole: copies would not save blocks). Planned as on a machine whose CUDA device
  is an H100 SXM (the catalogue's entry, as the driver's name picks it: ``gpu=`` cannot be given, the 2 TiB
  budget being more than the card holds), so the plan carries its predicted step time; and again with every
  call the time adds switched off (patched here to give none, :func:`on_a_card`), alternated ``--repeat``
  times so that a busy machine slows both alike: "timed" and "untimed", the medians, and their ratio.

Printed per row: the plan's wall time (for CUDA: timed, untimed, their ratio, and the milliseconds the timed plan
spent in the time's calls, the most of any run), the traces it made (each a forward and backward on fake
tensors; the untimed plan's in parentheses where they differ), the micro-batch found, and the time of one H200
step at that size, from FLOP (6 x parameters x tokens per sample, at 989 TFLOP/s of dense bf16 and 40% utilisation: an assumption, not a
measurement), so the plan's cost reads in device steps. Then the 32- and 80-layer times over the 8-layer one
(for CUDA, the timed plans').

With ``--auto``, what ``checkpointing="auto"`` costs against ``checkpointing=True``: the Llama shapes of 8 and 32
layers at 4096 tokens, a target of 64, planned for an H200 (``gpu="h200"``: its memory, less the default headroom;
every block checkpointed fits a few samples, none fits fewer), alternated ``--repeat`` times; the medians, the traces
of the whole model each made (the 32-layer model's copies of a few blocks apart), and the answer (micro-batch and
count). A count of blocks is traced whole: the line through none and every block's bytes, which the copies give,
decides which of the micro-batches weighed are searched (:func:`autotune.probe.partial.fastest_setting`).

    python benchmarks/plan_depth.py            # about three minutes on 2 cores
    python benchmarks/plan_depth.py --auto     # about two minutes
    python benchmarks/plan_depth.py --kinds    # about three minutes

With ``--kinds``, layers of two attention types (:mod:`autotune.probe.stacks`): Gemma-2-2B (sliding and full layers
alternating, eager attention) and Gemma-3-1B (five sliding to one full, SDPA) at 2048 tokens, bf16, AdamW, a budget of
80 GiB, for the CPU (a CUDA target traces such stacks whole), extended from shallow copies against traced whole,
alternated ``--repeat`` times: the medians, their ratio, and the answers (micro-batch and peak bytes), which must be the
same. Gemma-3's full layers hold less than its sliding ones (no mask), so it is traced whole after the check: its ratio
is the check's cost.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Iterator

import torch

import autotune
from autotune.probe import estimate

H200_BF16 = 989e12  # dense bf16 FLOP/s (the data sheet's figure without sparsity)
UTILISATION = 0.4


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def gpt2_small() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config()).to(torch.bfloat16)


def tokens(n: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(1, n, dtype=torch.long), "labels": ids.clone()}


@contextlib.contextmanager
def on_a_card(name: str, *, timed: bool) -> Iterator[list[float]]:
    """Plan as on a machine whose CUDA device is the catalogue's card ``name`` (a CUDA target's answers are timed for
    it, as where the driver's name picks the entry); without ``timed``, with every call the step time adds giving none:
    the plan's (``planner.plan_step_time``), the what-if and offloading rows' (``whatif._predicted``,
    ``whatif.offload_time``) and the sharded rows' (``advice.traffic``, ``advice.row_time``). Yields a list whose one
    figure becomes the seconds spent in those calls."""
    import autotune.planning.planner as planner
    import autotune.planning.times as times
    from autotune.memory.gpus import gpu_named
    from autotune.planning import advice, whatif

    card = gpu_named(name)
    calls = [(planner, "plan_step_time"), (whatif, "_predicted"), (whatif, "offload_time"), (advice, "traffic"), (advice, "row_time")]
    calls = [(module, attr) for module, attr in calls if hasattr(module, attr)]
    kept = [(planner, "card_here", planner.card_here), (times, "card_here", times.card_here)] + [(m, a, getattr(m, a)) for m, a in calls]
    spent = [0.0]

    def clocked(fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start
        return call

    planner.card_here = times.card_here = lambda device: card if torch.device(device).type == "cuda" else None  # type: ignore[assignment]
    for module, attr in calls:
        setattr(module, attr, clocked(getattr(module, attr)) if timed else (lambda *a, **k: None))
    try:
        yield spent
    finally:
        for module, attr, value in kept:
            setattr(module, attr, value)


def counted_plan(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str, limit: str, *,
                 timed: bool = True) -> tuple[float, int, int, float | None]:
    """Wall time, traces made, micro-batch and the seconds spent on its step time (None: it has none), of a cold
    estimate-only plan (on an H100 SXM, with or without the step time)."""
    estimate.forget()
    gc.collect()  # what the runs before left, collected outside the time
    made = 0
    trace_class = estimate.Trace

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal made
        made += 1
        return trace_class(*args, **kwargs)

    estimate.Trace = counting  # type: ignore[misc,assignment]
    try:
        with on_a_card("h100-sxm", timed=timed) as spent:
            start = time.perf_counter()
            plan = autotune.plan(model, [batch], target_batch=4096, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                                 device=device, memory_limit=limit, headroom=0, precision="bf16", verify=False, progress=False)
            seconds = time.perf_counter() - start
    finally:
        estimate.Trace = trace_class  # type: ignore[misc]
    return seconds, made, plan.micro_batch, None if plan.step_time is None else spent[0]


def auto_plan(model: torch.nn.Module, batch: dict[str, torch.Tensor], checkpointing: bool | str) -> tuple[float, int, int, object]:
    """Wall time, traces of the whole model (not of its shallow copies), micro-batch and checkpointing of a cold
    estimate-only plan for an H200."""
    estimate.forget()
    gc.collect()
    whole = 0
    init, trace = estimate.Estimator.__init__, estimate.Estimator.trace
    of_model: set[int] = set()  # the estimators of the whole model (not of its shallow copies)

    def made(self, work, *args, **kwargs):  # type: ignore[no-untyped-def]
        init(self, work, *args, **kwargs)
        if work.model is model:
            of_model.add(id(self))

    def counting(self, b, template=None):  # type: ignore[no-untyped-def]
        nonlocal whole
        key = (estimate.template_key(self.batch if template is None else template), b)
        whole += id(self) in of_model and self._source is None and key not in self._traces
        return trace(self, b, template)

    estimate.Estimator.__init__, estimate.Estimator.trace = made, counting  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        plan = autotune.plan(model, [batch], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), gpu="h200",
                             precision="bf16", checkpointing=checkpointing, verify=False, progress=False)
        seconds = time.perf_counter() - start
    finally:
        estimate.Estimator.__init__, estimate.Estimator.trace = init, trace  # type: ignore[method-assign]
    return seconds, whole, plan.micro_batch, plan.checkpointing


def auto_table(repeat: int) -> None:
    """``checkpointing="auto"`` against ``True`` on the Llama shapes of 8 and 32 layers for an H200."""
    print(f"{'model':<20}{'True s':>8}{'auto s':>8}{'ratio':>7}{'whole traces (True, auto)':>27}   answer (True; auto)")
    for layers in (8, 32):
        model, batch = llama(layers), tokens(4096, 128256)
        runs: dict[object, list[float]] = {True: [], "auto": []}
        made: dict[object, set[int]] = {True: set(), "auto": set()}
        answers: dict[object, set[tuple[int, object]]] = {True: set(), "auto": set()}
        for i in range(repeat):
            for setting in ((True, "auto") if i % 2 == 0 else ("auto", True)):
                seconds, whole, micro, checkpointing = auto_plan(model, batch, setting)
                runs[setting].append(seconds)
                made[setting].add(whole)
                answers[setting].add((micro, checkpointing))
        plain, auto = statistics.median(runs[True]), statistics.median(runs["auto"])
        said = "; ".join(", ".join(f"micro-batch {m}, checkpointing={c!r}" for m, c in sorted(answers[s], key=str)) for s in (True, "auto"))
        traces = f"{max(made[True])}, {max(made['auto'])}"
        print(f"{f'Llama x{layers} @4096':<20}{plain:>8.2f}{auto:>8.2f}{auto / plain:>7.2f}{traces:>27}   {said}", flush=True)


def gemma(name: str) -> torch.nn.Module:
    """Gemma-2-2B and Gemma-3-1B, the shapes of their published config.json, on the meta device in bf16: sliding-window
    and full-attention layers alternating (Gemma-2, eager attention, its default) or five to one (Gemma-3, SDPA)."""
    import transformers

    if name == "Gemma-2-2B":
        config = transformers.Gemma2Config(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                                           num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
                                           query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        config._attn_implementation, cls = "eager", transformers.Gemma2ForCausalLM
    else:
        config = transformers.Gemma3TextConfig(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4,
                                               num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512,
                                               query_pre_attn_scalar=256, max_position_embeddings=32768)
        config._attn_implementation, cls = "sdpa", transformers.Gemma3ForCausalLM
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16)


def kinds_table(repeat: int) -> None:
    """Layers of two attention types extended from shallow copies (each kind checked on a copy) against the whole model
    traced, alternated: the medians, their ratio, and the two answers, which must be one."""
    import autotune.probe.stacks as stacks

    print(f"{'model':<22}{'target':<8}{'whole s':>9}{'extended s':>12}{'ratio':>7}   answer (micro-batch, peak bytes)")
    for name in ("Gemma-2-2B", "Gemma-3-1B"):
        for device in ("cpu",):  # for a CUDA target such stacks are traced whole
            model = gemma(name)
            runs: dict[bool, list[float]] = {True: [], False: []}
            answers: dict[bool, set[tuple[int, int]]] = {True: set(), False: set()}
            for i in range(repeat):
                for extend in ((True, False) if i % 2 == 0 else (False, True)):
                    estimate.forget()
                    gc.collect()
                    with contextlib.ExitStack() as stack:
                        if not extend:
                            found = stacks.repeated_stacks
                            stacks.repeated_stacks = lambda work: ([], None)  # type: ignore[assignment]
                            stack.callback(setattr, stacks, "repeated_stacks", found)
                        start = time.perf_counter()
                        plan = autotune.plan(model, [tokens(2048, model.config.vocab_size)], target_batch=64, precision="bf16",
                                             optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), device=device,
                                             memory_limit="80GiB", headroom=0, verify=False, progress=False)
                        runs[extend].append(time.perf_counter() - start)
                    answers[extend].add((plan.micro_batch, plan.peak_memory))
                    if extend and not any("kinds of blocks" in n for n in plan.notes):
                        print(f"  {name} {device}: not extended: {[n for n in plan.notes if 'traced' in n]}")
            whole, extended = statistics.median(runs[False]), statistics.median(runs[True])
            same = "the same" if answers[True] == answers[False] and len(answers[True]) == 1 else f"DIFFER: {answers}"
            print(f"{name + ' @2048':<22}{device:<8}{whole:>9.2f}{extended:>12.2f}{extended / whole:>7.2f}   "
                  f"{sorted(answers[True])[0]}, {same}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cuda", action="store_true", help="the CPU target only")
    parser.add_argument("--repeat", type=int, default=5, help="runs of each plan, timed and untimed alternated (default 5)")
    parser.add_argument("--auto", action="store_true", help='checkpointing="auto" against True, for an H200, instead')
    parser.add_argument("--kinds", action="store_true", help="layers of two attention types (Gemma-2, Gemma-3) extended "
                        "against traced whole, instead")
    args = parser.parse_args()
    if args.auto:
        auto_table(args.repeat)
        return 0
    if args.kinds:
        kinds_table(args.repeat)
        return 0
    cases = [(f"Llama x{n} @4096", lambda n=n: llama(n), 4096, 128256) for n in (8, 32, 80)]
    cases.append(("GPT-2 small @1024", gpt2_small, 1024, 50257))
    targets = [("cpu", "2TiB")] + ([] if args.no_cuda else [("cuda", "2TiB")])
    print(f"{'model':<20}{'target':<8}{'plan s':>8}{'untimed s':>11}{'ratio':>7}{'time ms':>9}{'traces':>10}{'micro':>7}{'H200 step s':>13}{'plan/step':>11}")
    times: dict[tuple[str, str], float] = {}
    for name, make, length, vocab in cases:
        for device, limit in targets:
            model = make()
            params = sum(p.numel() for p in model.parameters())
            runs: dict[bool, list[float]] = {True: [], False: []}
            made: dict[bool, set[int]] = {True: set(), False: set()}
            found, told, spent = set(), set(), []
            for i in range(args.repeat):
                # untimed where the step time has none to give (the CPU): the timed plans alone
                for timed in ((True, False) if i % 2 == 0 else (False, True)) if device == "cuda" else (True,):
                    seconds, traces, micro, on_time = counted_plan(model, tokens(length, vocab), device, limit, timed=timed)
                    runs[timed].append(seconds)
                    made[timed].add(traces)
                    found.add(micro)
                    told.add((on_time is not None) == (timed and device == "cuda"))
                    spent.append(on_time or 0.0)
            if len(found) != 1 or told != {True}:
                print(f"  {name} {device}: the timed and untimed plans differ: micro-batches {sorted(found)}")
            seconds = times[(name, device)] = statistics.median(runs[True])
            untimed = f"{statistics.median(runs[False]):>11.2f}{seconds / statistics.median(runs[False]):>7.2f}" if runs[False] else f"{'-':>11}{'-':>7}"
            untimed += f"{1000 * max(spent):>9.1f}" if runs[False] else f"{'-':>9}"
            traces = f"{max(made[True])}" + (f" ({max(made[False])})" if made[False] and made[False] != made[True] else "")
            step = 6 * params * length * max(micro, 1) / (H200_BF16 * UTILISATION)
            print(f"{name:<20}{device:<8}{seconds:>8.2f}{untimed}{traces:>10}{micro:>7}{step:>13.2f}{seconds / step:>11.1f}", flush=True)
    for device, _ in targets:
        base = times[("Llama x8 @4096", device)]
        ratios = ", ".join(f"x{n}: {times[(f'Llama x{n} @4096', device)] / base:.2f}" for n in (32, 80))
        print(f"{device}: plan time over the 8-layer one (medians of {args.repeat}): {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
