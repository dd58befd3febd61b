"""The LightningModule that Lightning's batch-size tuner scales, for the benchmarks that compare with it
(``peers.py``, ``plan_time.py``, ``gpu_validate.py``): a model, its loss, an optimizer made on request, and a
loader whose ``batch_size`` the tuner sets (from 2, its default)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader


def tunable(net: nn.Module, loss: Callable[[nn.Module, Any], torch.Tensor], make_optimizer: Callable[[Any], torch.optim.Optimizer],
            data: Any) -> Any:
    """``net`` as a LightningModule training ``loss`` on ``data`` with ``make_optimizer(parameters)``."""
    import lightning as L

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net
            self.batch_size = 2

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            return make_optimizer(self.parameters())

        def train_dataloader(self) -> Any:
            return DataLoader(data, batch_size=self.batch_size)

    return Lit()
