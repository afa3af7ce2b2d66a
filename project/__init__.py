"""A Lightning training template: fill in your model, run `make train`."""

__version__ = "0.1.0"
