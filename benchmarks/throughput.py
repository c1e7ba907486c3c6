"""nano-vllm's throughput benchmark on vllm_actors; ``--help`` lists the options.

Same as ``vllm-actors bench throughput``.
"""

from vllm_actors.bench.throughput import main

raise SystemExit(main())
