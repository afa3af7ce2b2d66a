"""Data: one LightningDataModule over three sources (embedded digits, ImageFolder, torchvision datasets).

The data modules are imported on first use (PEP 562), so predict and export can use project/data/normalize.py
without importing Lightning.
"""

__all__ = ["DatasetDataModule", "ImageClassificationDataModule", "StreamingDataModule"]


def __getattr__(name: str):
    if name == "ImageClassificationDataModule":
        from project.data.datamodule import ImageClassificationDataModule

        return ImageClassificationDataModule
    if name == "DatasetDataModule":
        from project.data.dataset_module import DatasetDataModule

        return DatasetDataModule
    if name == "StreamingDataModule":
        from project.data.streaming import StreamingDataModule

        return StreamingDataModule
    raise AttributeError(f"module 'project.data' has no attribute '{name}'")
