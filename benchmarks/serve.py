"""Online serving benchmark (this engine's server, vLLM's, or a URL); ``--help`` lists the options.

Same as ``vllm-actors bench serve``.
"""

from vllm_actors.bench.serve import main

raise SystemExit(main())
