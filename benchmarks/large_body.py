"""One large request while /health is polled: answer time, /health's longest wait, serve's RSS; ``--help``."""

from vllm_actors.bench.large_body import main

raise SystemExit(main())
