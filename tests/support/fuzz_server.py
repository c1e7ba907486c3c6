"""The fuzzer's target, as a process of its own (so that serving runs beside the test's request
generation, not under the same interpreter lock): a process group of the given model, the
OpenAI app over its AsyncEngineClient under uvicorn on 127.0.0.1:PORT, plus one route of the
test's own, ``GET /_fuzz/state``: the client's unfinished engine requests (what ``admit`` counts
as in flight) and the metrics store's running, waiting and KV blocks in use. SIGTERM stops it.

    python tests/support/fuzz_server.py MODEL PORT SERVED_NAME
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn
from starlette.responses import JSONResponse

from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.server import build_app


async def serve(model: str, port: int, name: str) -> None:
    client = await AsyncEngineClient.start(model, dtype="float32", max_model_len=256, max_num_seqs=32,
                                           num_gpu_blocks_override=512, check_invariants=True)
    try:
        app = build_app(client, served_model_names=[name])

        @app.get("/_fuzz/state")
        async def state() -> JSONResponse:
            summary = await client.get_metrics()
            return JSONResponse({"unfinished": client.num_unfinished, "running": summary.running,
                                 "waiting": summary.waiting, "kv_blocks_in_use": summary.kv_blocks_in_use})

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                lifespan="off")
        await uvicorn.Server(config).serve()
    finally:
        await client.shutdown()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
