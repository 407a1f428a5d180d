"""A Starlette app behind FairSchedulerMiddleware: it relays each scheduled request to the
deployment the scheduler bound it to, and streams the answer back unbuffered.

    fair-sched emulate --port 8000 --model tiny --policy priority &
    uvicorn examples.asgi_app:app --host 127.0.0.1 --port 4000

Settings: `examples/fair_sched.yaml`, or the file named by `FAIR_SCHED_CONFIG`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from fair_sched_plugin.asgi import FairSchedulerMiddleware

CONFIG = os.environ.get("FAIR_SCHED_CONFIG") or str(Path(__file__).with_name("fair_sched.yaml"))


async def chat(request: Request) -> Response:
    # Where the scheduler bound this request: the engine it counted it on. None for a model
    # with no `api_base` in the settings: there is nowhere to send it.
    api_base = request.state.fair_sched_deployment  # e.g. "http://127.0.0.1:8000/v1"
    if api_base is None:
        model = request.state.fair_sched_model
        error = {
            "message": f"The model `{model}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
        return JSONResponse({"error": error}, status_code=404)
    client: httpx.AsyncClient = request.app.state.http
    upstream = await client.send(
        client.build_request(
            "POST",
            f"{api_base}/chat/completions",
            content=await request.body(),
            headers={"content-type": "application/json"},
        ),
        stream=True,
    )
    return StreamingResponse(
        upstream.aiter_raw(),
        status_code=upstream.status_code,
        media_type=upstream.headers.get("content-type"),
        background=BackgroundTask(upstream.aclose),
    )


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None)) as client:
        app.state.http = client
        yield


def build_app(config: str | Mapping[str, Any] = CONFIG) -> Starlette:
    app = Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"])], lifespan=lifespan
    )
    # Only the models of the settings are served: any other name is a 404 before it queues.
    app.add_middleware(FairSchedulerMiddleware, config=config, unknown_models="reject")
    return app


app = build_app()
