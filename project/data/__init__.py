"""The data modules (datamodule.py: images; dataset_module.py: any Dataset; streaming.py: prepared chunks),
imported on first use (PEP 562): predict and export use normalize.py without importing Lightning."""

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
