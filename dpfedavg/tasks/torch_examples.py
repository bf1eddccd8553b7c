"""Shipped torch tasks (`TorchTask`) on the paper's shard split.

=================  ==========================================================  =====================
task               model                                                       data
=================  ==========================================================  =====================
``mlp-digits``     MLP 64-64-10 (ReLU)                                         scikit-learn digits
``mlp-fmnist``     MLP 784-100-10 (ReLU)                                       Fashion-MNIST pixels
``cnn-fmnist``     CNN: conv 5x5x8, pool, conv 5x5x16, pool, linear 256-10     Fashion-MNIST 28x28
``mlp-cifar10``    MLP head 512-256-10 (ReLU)                                  CIFAR-10 ResNet-18
``mlp-cifar100``   MLP head 512-256-100 (ReLU)                                 CIFAR-100 ResNet-18
=================  ==========================================================  =====================

The data are those of the logistic-regression tasks (`dpfedavg.tasks.datasets`: digits is
bundled with scikit-learn, the others come from ``data-dir`` or flwr-datasets; the CIFAR tasks use
the ImageNet ResNet-18 features of `dpfedavg.tasks.features`), split over the clients by
the paper's shard split (`ShardSplit`: 5 shards of one label
range per client). Loss: cross-entropy plus ``(weight-decay / 2) ||w||^2``; initial weights:
PyTorch's default initialization under ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dpfedavg.config import RunConfig
from dpfedavg.tasks.logistic import ShardSplit
from dpfedavg.tasks.torch_task import ShardedClients, TorchTask, _torch

__all__ = ["EXAMPLES", "cnn_fmnist", "mlp"]


def mlp(sizes: tuple[int, ...]) -> Callable[[], Any]:
    """A factory of ``Linear-ReLU-...-Linear`` with the given layer widths."""

    def build() -> Any:
        nn = _torch().nn
        layers: list[Any] = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        return nn.Sequential(*layers)

    return build


def cnn_fmnist() -> Any:
    """A small CNN for 1x28x28 images (two 5x5 convolutions, max-pooling, a linear layer; 5.3k parameters)."""
    nn = _torch().nn
    return nn.Sequential(
        nn.Conv2d(1, 8, 5),  # 24x24
        nn.ReLU(),
        nn.MaxPool2d(2),  # 12x12
        nn.Conv2d(8, 16, 5),  # 8x8
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def _on_shards(
    cfg: RunConfig, dataset: str, model: Callable[[], Any], x_shape: tuple[int, ...] | None = None
) -> TorchTask:
    split = ShardSplit(cfg, dataset)

    def load() -> tuple[Any, Any, Any]:
        return split.data.train_x, split.data.train_y, split.partition

    def test() -> tuple[Any, Any]:
        x = split.data.test_x
        return (x if x_shape is None else x.reshape(len(x), *x_shape)), split.data.test_y

    return TorchTask(
        cfg,
        model=model,
        clients=ShardedClients(load, cfg.num_clients, x_shape),
        loss="cross_entropy",
        test=test,
        name=cfg.task,
    )


#: task name -> factory(cfg) -> TorchTask (registered in `dpfedavg.tasks.TASKS`).
EXAMPLES: dict[str, Callable[[RunConfig], TorchTask]] = {
    "mlp-digits": lambda cfg: _on_shards(cfg, "digits", mlp((64, 64, 10))),
    "mlp-fmnist": lambda cfg: _on_shards(cfg, "fmnist", mlp((784, 100, 10))),
    "cnn-fmnist": lambda cfg: _on_shards(cfg, "fmnist", cnn_fmnist, x_shape=(1, 28, 28)),
    "mlp-cifar10": lambda cfg: _on_shards(cfg, "cifar10", mlp((512, 256, 10))),
    "mlp-cifar100": lambda cfg: _on_shards(cfg, "cifar100", mlp((512, 256, 100))),
}
