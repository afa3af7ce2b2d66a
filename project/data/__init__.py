"""Data: three LightningDataModules, each named by `data.class_path` in the config, imported on first use (PEP
562), so that predict and export can use project/data/normalize.py without importing Lightning.

- ImageClassificationDataModule (datamodule.py): the embedded digits, an ImageFolder, torchvision's files.
- DatasetDataModule (dataset_module.py): any map-style Dataset and its collate_fn.
- StreamingDataModule (streaming.py): litdata chunks written by `python -m project prepare`.
"""

import importlib

_MODULES = {
    "ImageClassificationDataModule": "project.data.datamodule",
    "DatasetDataModule": "project.data.dataset_module",
    "StreamingDataModule": "project.data.streaming",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module 'project.data' has no attribute '{name}'")
