"""Where one engine step's time goes (GPU): see vllm_actors.bench.profile_step."""

from vllm_actors.bench.profile_step import main

raise SystemExit(main())
