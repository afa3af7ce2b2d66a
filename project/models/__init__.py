"""Plain `nn.Module`s. Any importable module that maps images to logits works: see README."""

from project.models.convnet import ConvNet
from project.models.torchvision_model import TorchvisionClassifier

__all__ = ["ConvNet", "TorchvisionClassifier"]
