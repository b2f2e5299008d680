"""dspark: confidence-scheduled speculative decoding that pays off at every load."""

__version__ = "0.1.0"
