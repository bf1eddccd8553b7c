"""ResNet-18 (ImageNet) penultimate-layer features for CIFAR-10/100 (paper §5), in plain torch.

The model is torchvision's ``resnet18`` when torchvision imports; otherwise the
architecture written out here with torchvision's module names (the fallback: on
the CPU build of torch 2.13.0 the matching torchvision wheel cannot be imported,
"operator torchvision::nms does not exist"). Either way torchvision's ImageNet
checkpoint (``resnet18-f37072fd.pth``, IMAGENET1K_V1) loads with ``strict=True``.
torch is imported lazily, only by the CIFAR tasks.

Images are scaled to [0, 1], resized (bilinear) to ``image_size`` and
normalized with the ImageNet mean and std; the 512-d output of the global
average pool is the feature vector. Extraction is batched, shows a progress
bar and runs on the GPU when one is present.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from dpfedavg.tasks.errors import DataUnavailableError

__all__ = [
    "WEIGHTS_FILE",
    "WEIGHTS_URL",
    "extract_features",
    "handwritten_resnet18",
    "load_resnet18",
    "penultimate_features",
    "resnet18",
]

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "resnet18-f37072fd.pth"
WEIGHTS_URL = f"https://download.pytorch.org/models/{WEIGHTS_FILE}"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
FEATURE_DIM = 512


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise DataUnavailableError(
            "the CIFAR tasks need torch for the ResNet-18 features: pip install -e '.[torch]' (torch==2.13.0)"
        ) from err
    return torch


def _torchvision() -> Any | None:
    """torchvision, or ``None`` when it does not import (not installed, or built for another torch)."""
    try:
        import torchvision
    except Exception as err:  # noqa: BLE001 - e.g. RuntimeError "operator torchvision::nms does not exist"
        logger.info("torchvision does not import (%s: %s): using the hand-written ResNet-18", type(err).__name__, err)
        return None
    return torchvision


def resnet18() -> Any:
    """An (untrained) ResNet-18: torchvision's when torchvision imports, else `handwritten_resnet18()`."""
    _torch()
    torchvision = _torchvision()
    if torchvision is not None:
        return torchvision.models.resnet18(weights=None)
    return handwritten_resnet18()


def penultimate_features(model: Any, x: Any) -> Any:
    """The 512-d output of the global average pool (before ``fc``), for either ResNet-18 (same module names)."""
    torch = _torch()
    x = model.maxpool(model.relu(model.bn1(model.conv1(x))))
    x = model.layer4(model.layer3(model.layer2(model.layer1(x))))
    return torch.flatten(model.avgpool(x), 1)


def handwritten_resnet18() -> Any:
    """An (untrained) ResNet-18 with torchvision's parameter names and the 1000-way ``fc`` (the fallback)."""
    torch = _torch()
    nn = torch.nn

    class BasicBlock(nn.Module):
        def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = None
            if stride != 1 or inplanes != planes:
                self.downsample = nn.Sequential(
                    nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
                )

        def forward(self, x: Any) -> Any:
            identity = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return self.relu(out + identity)

    class ResNet18(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            self.layer1 = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64))
            self.layer2 = nn.Sequential(BasicBlock(64, 128, 2), BasicBlock(128, 128))
            self.layer3 = nn.Sequential(BasicBlock(128, 256, 2), BasicBlock(256, 256))
            self.layer4 = nn.Sequential(BasicBlock(256, 512, 2), BasicBlock(512, 512))
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(512, 1000)
            for m in self.modules():  # torchvision's initialization
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def features(self, x: Any) -> Any:
            """The 512-d penultimate features (before ``fc``)."""
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return torch.flatten(self.avgpool(x), 1)

        def forward(self, x: Any) -> Any:
            return self.fc(self.features(x))

    return ResNet18()


def load_resnet18(pretrained: bool = True, weights_dir: str | Path | None = None) -> Any:
    """ResNet-18 in eval mode; with ``pretrained``, torchvision's IMAGENET1K_V1 weights.

    The weights file is looked up in ``weights_dir`` (e.g. the run's
    ``data-dir``), then in torch's hub cache (``$TORCH_HOME/hub/checkpoints``),
    then downloaded from download.pytorch.org.
    """
    torch = _torch()
    model = resnet18()
    if pretrained:
        local = Path(weights_dir).expanduser() / WEIGHTS_FILE if weights_dir else None
        if local is not None and local.exists():
            state = torch.load(local, map_location="cpu", weights_only=True)
        else:
            try:
                state = torch.hub.load_state_dict_from_url(
                    WEIGHTS_URL, map_location="cpu", progress=True, check_hash=True
                )
            except Exception as err:  # noqa: BLE001 - any download failure gets the one message below
                hub = Path(torch.hub.get_dir()) / "checkpoints"
                raise DataUnavailableError(
                    f"the ImageNet ResNet-18 weights are not available ({type(err).__name__}: {err}); download "
                    f"{WEIGHTS_URL} and put {WEIGHTS_FILE} in the run's data-dir or in {hub}"
                ) from err
        model.load_state_dict(state, strict=True)
    return model.eval()


def extract_features(
    images: np.ndarray,
    model: Any,
    *,
    image_size: int = 224,
    batch_size: int | None = None,
    device: str | None = None,
    desc: str = "features",
) -> np.ndarray:
    """512-d float32 features of uint8 images ``(N, H, W, 3)`` (or ``(N, H, W)`` grayscale).

    Batched, with a progress bar, on ``device`` (default: CUDA when available).
    """
    torch = _torch()
    from tqdm.auto import tqdm

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    batch_size = batch_size or (512 if device.startswith("cuda") else 64)
    model = model.to(device).eval()
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    images = np.asarray(images)
    if images.ndim == 3:
        images = np.repeat(images[..., None], 3, axis=-1)
    out = np.empty((len(images), FEATURE_DIM), dtype=np.float32)
    with torch.inference_mode():
        for start in tqdm(
            range(0, len(images), batch_size), desc=desc, unit="batch", disable=len(images) <= batch_size
        ):
            batch = torch.from_numpy(images[start : start + batch_size]).to(device)
            x = batch.permute(0, 3, 1, 2).float().div_(255.0)
            if x.shape[-1] != image_size or x.shape[-2] != image_size:
                x = torch.nn.functional.interpolate(
                    x, size=(image_size, image_size), mode="bilinear", align_corners=False
                )
            x = (x - mean) / std
            out[start : start + len(batch)] = penultimate_features(model, x).float().cpu().numpy()
    logger.info("extracted %s features %s on %s", desc, out.shape, device)
    return out
