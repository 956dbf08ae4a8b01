import os

import pytest


@pytest.fixture(scope="module")
def mlir_tmp_cache(tmp_path_factory):
    """A fresh MLIR kernel cache per test module: tests see real compiles, never the user's cache."""
    old = os.environ.get("TORCHFUSER_CACHE_DIR")
    os.environ["TORCHFUSER_CACHE_DIR"] = str(tmp_path_factory.mktemp("mlir-cache"))
    yield
    if old is None:
        os.environ.pop("TORCHFUSER_CACHE_DIR")
    else:
        os.environ["TORCHFUSER_CACHE_DIR"] = old
