"""The package's version, in one place: pyproject.toml reads it (``[tool.setuptools.dynamic]``), and
``torchfuser.__version__`` and ``torchfuser --version`` import it; importing this file imports nothing."""
__version__ = "0.1.0"
