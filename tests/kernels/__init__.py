"""The Triton kernels and their torch references (Triton's interpreter on the CPU, or a GPU)."""
