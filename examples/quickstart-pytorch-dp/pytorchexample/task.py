"""pytorchexample: the model, the data and the training loop (no Flower here)."""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)  # CIFAR-10's shape


class Net(nn.Module):
    """A small CNN: average pooling, one strided convolution, a linear classifier (1.5k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(4)
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.fc = nn.Linear(8 * 4 * 4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv(self.pool(x)))
        return self.fc(x.flatten(1))


def _prototypes() -> np.ndarray:
    """One coarse 4x4 colour pattern per class, blown up to 32x32 (the same for every client)."""
    coarse = np.random.default_rng(2024).normal(size=(NUM_CLASSES, 3, 4, 4))
    return np.kron(coarse, np.ones((1, 1, 8, 8)))


def generate(num_examples: int, seed: int) -> TensorDataset:
    """CIFAR-shaped images: the class's pattern plus pixel noise, labels uniform over the 10 classes."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, size=num_examples)
    images = _prototypes()[labels] + rng.normal(scale=6.0, size=(num_examples, *IMAGE_SHAPE))
    return TensorDataset(torch.tensor(images, dtype=torch.float32), torch.tensor(labels))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    """This client's training and validation data (64 and 32 images)."""
    train = generate(64, seed=1000 + partition_id)
    val = generate(32, seed=5000 + partition_id + num_partitions)
    return DataLoader(train, batch_size=batch_size, shuffle=True), DataLoader(val, batch_size=batch_size)


def load_centralized_dataset() -> DataLoader:
    """The server's test set (1000 images)."""
    return DataLoader(generate(1000, seed=99), batch_size=250)


def train(net: Net, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    """Train with SGD (momentum 0.9) for ``epochs`` epochs; the average training loss."""
    net.to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss, steps = 0.0, 0
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            loss = F.cross_entropy(net(images.to(device)), labels.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
            steps += 1
    return running_loss / steps


def test(net: Net, testloader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Loss and accuracy of ``net`` on ``testloader``."""
    net.to(device)
    net.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for images, labels in testloader:
            outputs = net(images.to(device))
            loss += F.cross_entropy(outputs, labels.to(device), reduction="sum").item()
            correct += (outputs.argmax(1) == labels.to(device)).sum().item()
    return loss / len(testloader.dataset), correct / len(testloader.dataset)
