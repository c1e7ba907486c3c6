"""Tests that need CUDA (skipped without it): the engine, tensor parallelism and the fused all-reduce on GPUs."""
