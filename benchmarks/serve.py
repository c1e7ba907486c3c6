"""Online serving benchmark (this engine's server, vLLM's, or a URL); ``--help`` lists the options.

Same as ``vllm-actors bench serve``.
"""

from vllm_actors.bench.serve import main

if __name__ == "__main__":  # the client processes are spawned: they import this file too
    raise SystemExit(main())
