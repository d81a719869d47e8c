"""A small convolutional classifier for little images (`model=cnn`, `experiment=digits`)."""

from __future__ import annotations

import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers: (B, C, H, W) -> (B, classes).

    Args:
        in_channels: image channels (1 for the 8x8 digits).
        image_size: height = width of the input; must be even (one 2x2 pool).
        channels: feature maps of the first convolution (the second has twice as many).
        hidden: width of the hidden linear layer.
        num_classes: outputs (logits).
        dropout: before each linear layer.
    """

    def __init__(
        self,
        in_channels: int = 1,
        image_size: int = 8,
        channels: int = 32,
        hidden: int = 128,
        num_classes: int = 10,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if image_size % 2:
            raise ValueError(f"image_size must be even (one 2x2 pooling), got {image_size}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 2C, H/2, W/2)
        )
        flat = 2 * channels * (image_size // 2) ** 2
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(flat, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits (B, num_classes) for images (B, in_channels, H, W)."""
        return self.head(self.features(images))
