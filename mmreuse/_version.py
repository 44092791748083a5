"""mmreuse's version, defined once: setuptools reads it (pyproject.toml, [tool.setuptools.dynamic])
without importing the package, and `mmreuse.__version__` re-exports it."""

__version__ = "0.1.0"
