"""A small ConvNet for small images (8x8 digits up to 32x32 CIFAR)."""

from torch import Tensor, nn


class ConvNet(nn.Module):
    """Two conv stages and a global-average-pooled linear head.

    Args:
        num_classes: size of the output layer; linked from the data module by the CLI.
        in_channels: image channels; linked from the data module by the CLI.
        width: channels of the first stage; the second stage has twice as many.
        dropout: dropout before the linear head.
    """

    def __init__(self, num_classes: int, in_channels: int = 1, width: int = 32, dropout: float = 0.1) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(True)
            )

        w = width
        self.features = nn.Sequential(
            block(in_channels, w), block(w, w), nn.MaxPool2d(2), block(w, 2 * w), block(2 * w, 2 * w),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(2 * width, num_classes))

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W) -> (B, num_classes)
        return self.head(self.features(x))
