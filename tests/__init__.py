"""The test suite, one folder per layer (tests/README.md); imported as the ``tests`` package."""
