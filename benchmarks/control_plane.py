"""The scheduler and KV-cache manager alone, replaying shared-prefix admissions (CPU): see
``vllm_actors.bench.control_plane``."""

from vllm_actors.bench.control_plane import main

if __name__ == "__main__":
    raise SystemExit(main())
