"""Developer benchmark scripts; their code is in ``benchmarks.lib`` (not installed with the package)."""
