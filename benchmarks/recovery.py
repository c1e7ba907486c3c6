"""Recovery from a killed worker under load; ``--help`` lists the options."""

from vllm_actors.bench.recovery import main

raise SystemExit(main())
