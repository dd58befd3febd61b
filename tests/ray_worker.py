"""autotune.fit inside Ray Train: a TorchTrainer with 2 CPU workers (gloo), each training on the loader
Ray prepares (``ray.train.torch.prepare_data_loader``: a DataLoader subclass that also defines
``__next__``, with a DistributedSampler added), for tests/test_launchers.py.

    python tests/ray_worker.py OUT

Each worker saves its plan and its final parameters to OUT/ray-rank<r>.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

TARGET, LIMIT = 24, "34KiB"


def train_loop(config: dict) -> None:
    import torch
    from ray import train
    from ray.train.torch import prepare_data_loader, prepare_model
    from torch.utils.data import DataLoader
    from trainers_worker import mlp, mse, regression

    import autotune

    torch.set_default_dtype(torch.float64)
    rank = train.get_context().get_world_rank()
    loader = prepare_data_loader(DataLoader(regression(), batch_size=12))
    model = prepare_model(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    result = autotune.fit(model, loader, target_batch=TARGET, optimizer=optimizer, loss_fn=mse, memory_limit=LIMIT, headroom=0, lr_rule="none",
                          epochs=2, progress=False)
    torch.save({"loader": type(loader).__name__, "has_next": hasattr(loader, "__next__"), "micro": result.plan.micro_batch,
                "samples": [h.samples for h in result.history], "params": [p.detach().clone() for p in model.parameters()]},
               Path(config["out"]) / f"ray-rank{rank}.pt")


def main(out: Path) -> None:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}})
    try:
        trainer = TorchTrainer(train_loop, train_loop_config={"out": str(out)}, torch_config=TorchConfig(backend="gloo"),
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(storage_path=str(out / "ray"), name="fit"))
        trainer.fit()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
