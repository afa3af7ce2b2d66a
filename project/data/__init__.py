"""Data: one LightningDataModule over three sources (embedded digits, ImageFolder, torchvision datasets)."""

from project.data.datamodule import ImageClassificationDataModule
from project.data.streaming import StreamingDataModule

__all__ = ["ImageClassificationDataModule", "StreamingDataModule"]
