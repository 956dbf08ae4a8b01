"""The package's version, in one place: pyproject.toml reads it (``[tool.setuptools.dynamic]``) and
``torchfuser.__version__`` is this. It imports nothing, so ``torchfuser --version`` can read it without
importing torch."""

__version__ = "0.1.0"
