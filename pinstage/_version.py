"""The one place pinstage's version is written: the build reads it (pyproject's dynamic
version), and ``pinstage.__version__`` and ``pinstage --version`` import it."""

__version__ = "0.1.0"
