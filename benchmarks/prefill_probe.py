"""Which kernel attends the engine's long prefills, and what it costs (needs a CUDA GPU): for each executor
(in-process, process group) and each ``VLLM_ACTORS_PREFILL_ATTENTION`` choice, in a fresh process, the
worker's reported attention and the time of one uncached 64k-token prefill of the Llama-3.2-1B shape."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r'''
import json, sys, time, random
from pathlib import Path
from vllm_actors import LLM, SamplingParams
from vllm_actors.bench.serve_server import write_model_dir
from vllm_actors.bench.throughput_workload import LLAMA_3_2_1B_CONFIG as c
model = write_model_dir(Path(sys.argv[1]), {**c, "max_position_embeddings": 131072})
executor = sys.argv[2]
extra = {} if executor == "group" else {"executor": "inprocess"}
with LLM(str(model), load_format="dummy", dtype="bfloat16", max_model_len=70000, skip_tokenizer_init=True,
         enable_prefix_caching=False, **extra) as llm:
    info = getattr(getattr(llm, "group", None), "worker_info", None)
    if info is None:
        from vllm_actors.kernels.attention import describe_attention
        info = {"attention": describe_attention(llm.engine.worker.runner.model.attn_backend)}
    rng = random.Random(0)
    times = []
    for _ in range(3):
        prompt = [rng.randrange(1000, 100000) for _ in range(65536)]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        times.append(time.perf_counter() - start)
    print("RESULT", json.dumps({"attention": info.get("attention"), "seconds": times}))
'''

results = []
scratch = Path(tempfile.mkdtemp())
for executor in ("inprocess", "group"):
    for choice in ("triton", "flash_attn"):
        env = dict(os.environ, VLLM_ACTORS_PREFILL_ATTENTION=choice)
        done = subprocess.run([sys.executable, "-c", CHILD, str(scratch / "model"), executor], env=env,
                              capture_output=True, text=True, timeout=300)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        row = {"executor": executor, "choice": choice, **(json.loads(line[0][7:]) if line else
                                                         {"error": done.stderr[-1500:]})}
        print(json.dumps(row), flush=True)
        results.append(row)
out = Path(os.environ.get("OUT", "results")) / "prefill_probe.json"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(results, indent=1))
print("logs:", time.time())
