"""Mount the OpenAI-compatible server under your own FastAPI application.

    python examples/mount_in_fastapi.py                        # starts a group on the default model
    python examples/mount_in_fastapi.py --model path/to/model --dtype float32 --port 8000
    python examples/mount_in_fastapi.py --attach /tmp/vllm-actors-1000/g1234abcd   # a running group

Then the OpenAI API lives under /llm (``OpenAI(base_url="http://localhost:8000/llm/v1")``), next to
the host application's own routes; ``/shout`` shows the same client used directly.

A mounted application's lifespan never runs, so the host application owns the client: its
lifespan starts (or attaches) the client, mounts ``build_app(client)``, and shuts the client down.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from vllm_actors import SamplingParams
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.server import build_app


def create_app(model: str | None = None, attach: str | None = None, **engine_args: Any) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if attach:
            client = await AsyncEngineClient.attach(attach)
        else:
            client = await AsyncEngineClient.start(model, **engine_args)
        app.state.llm = client
        app.mount("/llm", build_app(client, served_model_names=["local-llm"]))
        try:
            yield
        finally:
            await client.shutdown()  # stops the group when this client started it

    app = FastAPI(title="my application", lifespan=lifespan)

    @app.get("/")
    async def index() -> dict[str, str]:
        return {"service": "my application", "openai_api": "/llm/v1"}

    @app.get("/shout")
    async def shout(text: str) -> dict[str, str]:
        client: AsyncEngineClient = app.state.llm
        final = None
        async for output in client.generate(text, SamplingParams(temperature=0.0, max_tokens=8)):
            final = output
        completion = final.outputs[0].text if final is not None else ""
        return {"prompt": text, "completion": completion.upper()}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    parser.add_argument("--attach", default=None, metavar="RUN_DIR", help="attach to a running group instead")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    app = create_app(args.model, args.attach, dtype=args.dtype)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
