"""Microbenchmark of the Triton paged-attention kernels vs torch SDPA (needs a CUDA GPU).

    python benchmarks/kernels.py --out results/kernels.json
"""

from vllm_actors.bench.kernels import main

if __name__ == "__main__":
    main()
