"""Prefix caching on vs off (a shared system prompt, multi-turn chat); ``--help`` lists the options.

Same as ``vllm-actors bench prefix``.
"""

from vllm_actors.bench.prefix import main

raise SystemExit(main())
