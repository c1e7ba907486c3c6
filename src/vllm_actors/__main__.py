from vllm_actors.cli import main

raise SystemExit(main())
