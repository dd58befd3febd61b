"""Record the CUDA caching allocator's own trace of the ``gpu_validate`` steps, as test data any machine replays.

The allocator keeps a history of every allocation, free and segment when asked
(``torch.cuda.memory._record_memory_history``, read with ``torch.cuda.memory._snapshot()``). This script runs the
steps ``gpu_validate.py`` checks, a few steady-state steps each (``trial_step``: micro-step, optimizer step,
micro-step), and writes each case's history, trimmed to what a replay needs, to
``tests/data/allocator/<case>-<setting>.json.gz``; ``tests/test_allocator_traces.py`` replays them through
``autotune.memory.allocator`` on the CPU.

The cases: GPT-2 (dropout 0.1), the Llama shape and the CNN of ``gpu_validate.py``, and that Llama shape with LoRA
(rank 16 on every linear layer, bf16 base) and with QLoRA (the base in bitsandbytes nf4), each at one sequence
length (``fixed``) and, for the token models, at lengths that change from step to step (``varying``); each with
the allocator's default segments and with ``expandable_segments:True``. The setting is read once, when the
process starts (``PYTORCH_CUDA_ALLOC_CONF``), so every case runs in a process of its own, which also starts the
allocator empty, as the replay does. A few run side by side (``--jobs``): each process has its own allocator.

What a trace file holds (JSON, gzip): the case's settings, the torch and CUDA versions, the device's name and
compute capability, ``PYTORCH_CUDA_ALLOC_CONF``, ``max_memory_allocated`` and ``max_memory_reserved`` as the
allocator measured them over the case, and the events in order, one ``[action, address, size, stream]`` list
each (``actions`` names the action numbers; addresses are offsets from ``base``; ``streams`` the streams; a free
is recorded when it completes, the block back in its pool; an out-of-memory event keeps the device's free bytes
where the others have an address), and the segments left at the end (``[address, size, stream, pool]``). Stack
frames and times are not kept.

    python benchmarks/capture_allocator.py            # on one GPU: every case, both settings, about 2 minutes
    python benchmarks/capture_allocator.py --cases gpt2,cnn --out /tmp/traces
    python benchmarks/capture_allocator.py --dry      # on the CPU: every case built and stepped once, no trace

Without CUDA (and without ``--dry``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_validate  # noqa: E402  (the models, batches and losses of the GPU checks)

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "allocator"
SETTINGS = {"default": "expandable_segments:False", "expandable": "expandable_segments:True"}
MAX_ENTRIES = 1_000_000  # far above any case's events: a trace that fills the ring buffer lost its start, and is refused
LORA_RANK = 16
ADDRESSED = {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap"}


@dataclass(frozen=True)
class Case:
    """One captured step: which model (``gpt2``, ``llama``, ``cnn``, ``lora``, ``qlora``), its micro-batch, and the
    sequence length of each steady-state step (0 for images: the CNN's side is fixed)."""

    model: str
    micro_batch: int
    lengths: tuple[int, ...]

    @property
    def base(self) -> gpu_validate.Model:
        return gpu_validate.MODELS["llama" if self.model in ("lora", "qlora") else self.model]


def _varying(n: int) -> tuple[int, ...]:
    return (n, n // 2, n // 4, n * 3 // 4)


CASES: dict[str, Case] = {
    "gpt2-fixed": Case("gpt2", 4, (1024, 1024)),
    "gpt2-varying": Case("gpt2", 4, _varying(1024)),
    "llama-fixed": Case("llama", 4, (1024, 1024)),
    "llama-varying": Case("llama", 4, _varying(1024)),
    "cnn-fixed": Case("cnn", 64, (0, 0)),
    "lora-fixed": Case("lora", 4, (1024, 1024)),
    "lora-varying": Case("lora", 4, _varying(1024)),
    "qlora-fixed": Case("qlora", 4, (1024, 1024)),
    "qlora-varying": Case("qlora", 4, _varying(1024)),
}


def build(case: Case, device: torch.device, scale: float = 1.0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The case's model on ``device`` and its AdamW (lr 1e-5, torch's default implementation for the device), built
    from a fixed seed: the same on a GPU and, for the estimate, on the CPU. LoRA: the Llama shape in bf16 with
    PEFT's adapters of rank 16 on every linear layer; QLoRA: its linear layers quantized on the device first
    (bitsandbytes nf4, bf16 compute)."""
    if case.model not in ("lora", "qlora"):
        return gpu_validate.fresh(case.base, scale, device)
    import warnings

    import peft

    from autotune.memory.quantized import Quantization, quantize

    net = gpu_validate.llama(scale).to(torch.bfloat16).to(device)
    if case.model == "qlora":
        quantize(net, Quantization("nf4", compute_dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net = peft.get_peft_model(net, peft.LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules="all-linear"))
    return net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-5)


def length_at(case: Case, n: int, scale: float) -> int:
    """A step's sequence length at ``scale`` (the CPU's small models take shorter sequences)."""
    return n if scale >= 1 or n == 0 else max(8, int(n * scale))


def run_steps(case: Case, net: nn.Module, opt: torch.optim.Optimizer, device: torch.device, scale: float,
              steps: int | None = None) -> None:
    """The case's steady-state steps, one per length (the first ``steps`` of them)."""
    from autotune.probe.trial import trial_step

    model = case.base
    for n in case.lengths[:steps]:
        batch = gpu_validate.to(model.batch(case.micro_batch, length_at(case, n, scale), scale), device)
        trial_step(net, opt, model.loss, batch, device.type, model.precision)  # type: ignore[arg-type]
        del batch


def trimmed(snapshot: dict[str, Any], device: int) -> dict[str, Any]:
    """What the replay needs of a snapshot: each event's action, address, size and stream, and the segments at
    the end; the stack frames and times dropped, the requests to free dropped where their completions are
    recorded, addresses as offsets from the lowest."""
    trace = snapshot["device_traces"][device]
    if len(trace) >= MAX_ENTRIES:
        raise RuntimeError(f"the trace filled its {MAX_ENTRIES} entries: its start is lost; record fewer steps")
    if any(e["action"] == "free_completed" for e in trace):  # a block returns to its pool when its free completes
        trace = [e for e in trace if e["action"] != "free_requested"]
    segments = [s for s in snapshot["segments"] if s.get("device", device) == device]
    addressed = {e["action"] for e in trace} & ADDRESSED  # an out-of-memory event's "address" is the device's free bytes
    base = min([e["addr"] for e in trace if e["action"] in addressed] + [s["address"] for s in segments], default=0)
    actions: list[str] = []
    streams: list[int] = []

    def index(values: list[Any], value: Any) -> int:
        if value not in values:
            values.append(value)
        return values.index(value)

    events = [[index(actions, e["action"]), e["addr"] - (base if e["action"] in addressed else 0), int(e["size"]),
               index(streams, e.get("stream", 0))] for e in trace]
    ends = [[s["address"] - base, int(s["total_size"]), index(streams, s.get("stream", 0)), s.get("segment_type", "")] for s in segments]
    return {"actions": actions, "streams": streams, "base": base, "events": events, "segments": ends}


def capture_one(name: str, out: Path, *, device: torch.device | None = None, scale: float = 1.0) -> dict[str, Any]:
    """Capture one case in this process, under the allocator setting it started with, and write its file (``device``
    and ``scale``: the test's, which runs this on the CPU with the CUDA functions faked)."""
    case = CASES[name]
    device = device or torch.device("cuda", torch.cuda.current_device())
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=MAX_ENTRIES)
    began = time.perf_counter()
    net, opt = build(case, device, scale)
    run_steps(case, net, opt, device, scale)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - began
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    stats = torch.cuda.memory_stats(device)
    data = {
        "format": 1,
        "case": name,
        "settings": {**asdict(case), "precision": case.base.precision, "scale": scale, "optimizer": "AdamW(lr=1e-5)",
                     "dropout": 0.1 if case.model == "gpt2" else 0.0, "lora_rank": LORA_RANK if case.model in ("lora", "qlora") else None,
                     "quantization": "nf4" if case.model == "qlora" else None, "cap": None},
        "expandable": "expandable_segments:true" in conf.replace(" ", "").lower(),
        "alloc_conf": conf,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device),
        "capability": list(torch.cuda.get_device_capability(device)),
        "captured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": seconds,
        "measured": {"max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
                     "max_memory_reserved": int(torch.cuda.max_memory_reserved(device)),
                     "num_alloc_retries": int(stats.get("num_alloc_retries", 0))},
        **trimmed(snapshot, device.index or 0),
    }
    setting = "expandable" if data["expandable"] else "default"
    path = out / f"{name}-{setting}.json.gz"
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(data, f, separators=(",", ":"))
    return {"file": str(path), "bytes": path.stat().st_size, "events": len(data["events"]), **data["measured"], "seconds": seconds}


def _in_process(name: str, setting: str, out: Path, timeout: int) -> dict[str, Any]:
    """One case under one allocator setting, in a fresh process (the setting is read when CUDA starts)."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": SETTINGS[setting]}
    argv = [sys.executable, __file__, "--one", name, "--out", str(out)]
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"over its time limit of {timeout} s"}
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def dry(names: list[str], scale: float) -> int:
    """Every case built on the CPU at ``scale`` and stepped once: the script's control flow, no trace."""
    device = torch.device("cpu")
    failed = 0
    for name in names:
        began = time.perf_counter()
        try:
            net, opt = build(CASES[name], device, scale)
            run_steps(CASES[name], net, opt, device, scale, steps=1)
            print(f"{name}: built and stepped on the CPU ({time.perf_counter() - began:.1f} s)")
        except Exception as exc:  # each case is reported; the others run
            failed += 1
            print(f"{name}: FAILED {type(exc).__name__}: {exc}")
    return 1 if failed else 0


def chosen(wanted: str | None) -> list[str]:
    """The cases named (or whose names begin with a word given), in their order; all when none are."""
    if not wanted:
        return list(CASES)
    words = [w.strip() for w in wanted.split(",") if w.strip()]
    names = [n for n in CASES if any(n == w or n.startswith(w) for w in words)]
    if not names:
        raise SystemExit(f"capture_allocator: Invalid --cases {wanted!r}: no case begins with it; the cases are {', '.join(CASES)}")
    return names


def main(argv: list[str] | None = None, *, runner: Callable[[str, str, Path, int], dict[str, Any]] = _in_process) -> int:
    """Capture the chosen cases under both allocator settings (``--dry``: build and step them on the CPU)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="cases: " + ", ".join(CASES))
    parser.add_argument("--cases", help="comma-separated case names or their first words (default: all)")
    parser.add_argument("--settings", default="default,expandable", help="allocator settings: default, expandable or both")
    parser.add_argument("--out", type=Path, default=OUT, help="where the traces go (default: tests/data/allocator)")
    parser.add_argument("--jobs", type=int, default=3, help="cases captured side by side, each in its own process (default 3)")
    parser.add_argument("--timeout", type=int, default=150, help="seconds a case may take (default 150)")
    parser.add_argument("--dry", action="store_true", help="on the CPU: build every case small and step it once; no trace")
    parser.add_argument("--scale", type=float, default=0.06, help=argparse.SUPPRESS)  # --dry's model size
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker process: capture this case here
    args = parser.parse_args(argv)
    names = chosen(args.cases)
    if args.dry:
        return dry(names, args.scale)
    if not torch.cuda.is_available():
        print("capture_allocator: no CUDA device here; nothing to capture (exit 0; --dry checks the cases on the CPU)")
        return 0
    if args.one:
        print(json.dumps(capture_one(args.one, args.out)))
        return 0
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or not settings:
        raise SystemExit(f"capture_allocator: Invalid --settings {args.settings!r}: give default, expandable or both (comma-separated)")
    jobs = [(name, setting) for name in names for setting in settings]
    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda job: runner(job[0], job[1], args.out, args.timeout), jobs))
    print("| case | setting | events | max allocated MiB | max reserved MiB | file KiB | seconds | error |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, setting), r in zip(jobs, results):
        mib = [f"{r[k] / 2**20:.1f}" if k in r else "-" for k in ("max_memory_allocated", "max_memory_reserved")]
        print(f"| {name} | {setting} | {r.get('events', '-')} | {mib[0]} | {mib[1]} | {r['bytes'] / 1024:.0f} | {r['seconds']:.1f} | - |"
              if "error" not in r else f"| {name} | {setting} | - | - | - | - | - | {r['error']} |")
    total = sum(r.get("bytes", 0) for r in results)
    print(f"{sum('error' not in r for r in results)} of {len(jobs)} captured in {time.perf_counter() - began:.0f} s; "
          f"{total / 2**20:.2f} MiB in {args.out}" + ("; over the 4 MiB test data may take: ship fewer" if total > 4 * 2**20 else ""))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
