"""Data: one LightningDataModule over three sources (embedded digits, ImageFolder, torchvision datasets)."""

from project.data.datamodule import ImageClassificationDataModule

__all__ = ["ImageClassificationDataModule"]
