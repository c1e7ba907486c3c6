"""Kill actors of a serving group under load and check that no request is lost; ``--help`` lists the options.

Same as ``vllm-actors chaos``.
"""

from vllm_actors.bench.chaos import main

raise SystemExit(main())
