"""The developer benchmarks' code: kernel sweeps, peer engines, the throughput floor, profiles.

Run through ``benchmarks/*.py``; not installed with the package."""
