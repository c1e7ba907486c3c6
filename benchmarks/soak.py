"""Soak ``vllm-actors serve`` under mixed valid, invalid and abusive load; ``--help`` lists the options."""

from vllm_actors.bench.soak import main

raise SystemExit(main())
