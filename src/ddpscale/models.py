"""Model registry: `model=<name>` -> a builder taking the model and data configs."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ddpscale.config import CNNConfig, DataConfig, ModelConfig, Registry, WideResNetConfig, built, registered


class CNN(nn.Module):
    """Two 3x3 convolutions, max-pool, dropout, two linear layers (pytorch/examples' mnist)."""

    def __init__(self, cfg: CNNConfig, data: DataConfig):
        super().__init__()
        side = (data.image_size - 4) // 2  # two valid 3x3 convolutions, then a 2x2 pool
        self.features = nn.Sequential(
            nn.Conv2d(data.channels, cfg.conv1_channels, 3),
            nn.ReLU(inplace=True),
            nn.Conv2d(cfg.conv1_channels, cfg.conv2_channels, 3),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Dropout(cfg.dropout),
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Linear(cfg.conv2_channels * side * side, cfg.hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(min(2 * cfg.dropout, 0.9)),
            nn.Linear(cfg.hidden, data.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class _WideBlock(nn.Module):
    """Pre-activation residual block: BN-ReLU-conv3x3-(dropout)-BN-ReLU-conv3x3."""

    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(c_in), nn.BatchNorm2d(c_out)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.shortcut = (
            nn.Conv2d(c_in, c_out, 1, stride, bias=False) if stride != 1 or c_in != c_out else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        out = self.conv2(self.dropout(torch.relu(self.bn2(out))))
        return out + skip


class WideResNet(nn.Module):
    """WRN-depth-width for small images; global average pooling makes any size work."""

    def __init__(self, cfg: WideResNetConfig, data: DataConfig):
        super().__init__()
        n = (cfg.depth - 4) // 6
        widths = [16, 16 * cfg.width, 32 * cfg.width, 64 * cfg.width]
        layers: list[nn.Module] = [nn.Conv2d(data.channels, widths[0], 3, 1, 1, bias=False)]
        for stage, stride in zip(range(3), (1, 2, 2)):
            for i in range(n):
                c_in = widths[stage] if i == 0 else widths[stage + 1]
                layers.append(_WideBlock(c_in, widths[stage + 1], stride if i == 0 else 1, cfg.dropout))
        layers += [nn.BatchNorm2d(widths[3]), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(widths[3], data.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


MODELS: dict[str, Callable[[ModelConfig, DataConfig], nn.Module]] = Registry("model", {
    "cnn": CNN,
    "wide_resnet": WideResNet,
})


def build_model(cfg: ModelConfig, data: DataConfig) -> nn.Module:
    """The model named by `cfg.name`, shaped for the data set's channels, size and classes."""
    model = registered(MODELS, "model", cfg.name, "ddpscale.models.MODELS")(cfg, data)
    return built(model, nn.Module, "an nn.Module", "model", cfg.name,
                 "a builder(model_cfg, data_cfg) that returns the model (an nn.Module class taking those two works too)")
