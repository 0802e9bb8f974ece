"""A CIFAR-10-shaped data set made up on the spot (no download): 3x32x32 images, 10 classes.

Each class has a fixed random mean image; a sample is its class mean plus noise, so a small
network learns it within a few dozen steps. The same ``seed`` gives the same data on every rank.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

CLASSES = 10


class SyntheticImages(Dataset):
    """``size`` pairs ``(image [3, 32, 32] float32, label int64)``."""

    def __init__(self, size: int = 2048, seed: int = 0, noise: float = 0.5) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"SyntheticImages: size must be an int >= 1, got {size!r}")
        g = torch.Generator().manual_seed(seed)
        means = torch.randn(CLASSES, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, CLASSES, (size,), generator=g)
        self.images = means[self.labels] + noise * torch.randn(size, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]
