"""OpenAI-compatible HTTP routes in front of the emulated engine (a Starlette app).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (and ``GET /metrics/?name[]=...``, only the named samples, as
vLLM serves them), and the test hooks ``GET|POST /emulator/faults`` and
``GET /emulator/stats`` (so a test driving a subprocess can flip faults and read the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from .engine import EmulatedEngine, EmulatorConfig, EngineClosedError, Sequence, SequenceState
from .metrics import EngineMetrics

CompletionKind = Literal["chat", "text"]

CHARS_PER_TOKEN = 4
GARBAGE_METRICS = b"<html><body><h1>502 Bad Gateway</h1>{{{ not prometheus ]]]</body></html>\n"
SSE_DONE = b"data: [DONE]\n\n"


# Output token i reads `filler_word` followed by the digit i % 10. A stream of identical chunks
# is what LiteLLM takes for a model stuck in a loop: it fails the stream after 100 of them in a
# row ("The model is repeating the same chunk"), so no two neighbouring tokens are the same.
TOKEN_VARIANTS = 10
# Stands for the varying digit in a preformatted chunk (JSON writes it as \u0000).
_VARIANT_MARK = "\x00"


def token_text(filler_word: str, index: int) -> str:
    """The text of output token `index` (0-based) of every response."""
    return f"{filler_word}{index % TOKEN_VARIANTS}"


def _dumps(payload: object) -> str:
    return json.dumps(payload, separators=(",", ":"))


def error_response(status: int, message: str, error_type: str) -> JSONResponse:
    """An error in the shape vLLM's OpenAI server uses."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


class BadRequestError(ValueError):
    """The request body is not something the emulated engine accepts (HTTP 400)."""


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class CompletionRequest:
    kind: CompletionKind
    model: str
    prompt_tokens: int
    max_tokens: int
    priority: int
    stream: bool
    include_usage: bool
    user: str | None
    prefix_blocks: tuple[int, ...] = ()
    """Chained hashes of the prompt's whole cache blocks; () while prefix caching is off."""
    prompt_text: str = ""
    """The prompt as the engine counts it (what the fault switches look for)."""


def estimate_prompt_tokens(text_chars: int) -> int:
    return max(1, text_chars // CHARS_PER_TOKEN)


def _token_ids_text(ids: list[int]) -> str:
    # One token id as CHARS_PER_TOKEN characters, so ids are counted and hashed like text.
    return "".join((i & 0xFFFFFFFF).to_bytes(CHARS_PER_TOKEN, "big").decode("latin-1") for i in ids)


def _text_prompt(prompt: object) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(item, int) for item in prompt):
            return _token_ids_text(prompt)  # already token ids
        return "".join(_text_prompt(item) for item in prompt)
    return ""


def _chat_prompt(messages: object) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty list")
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):  # multi-part content: count the text parts
            parts.extend(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return "".join(parts)


def prompt_blocks(text: str, block_tokens: int) -> tuple[int, ...]:
    """Chained hashes of the whole blocks of ``block_tokens`` tokens at the prompt's start.

    Tokens are counted as the emulator counts them (``CHARS_PER_TOKEN`` characters each); each
    hash covers its block and everything before it, as vLLM keys its prefix cache, so two
    prompts share their first k hashes exactly when their first k blocks are the same.
    """
    block_chars = block_tokens * CHARS_PER_TOKEN
    chain = hashlib.blake2b(digest_size=8)
    hashes: list[int] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        chain.update(text[start : start + block_chars].encode("utf-8", "surrogatepass"))
        hashes.append(int.from_bytes(chain.copy().digest(), "big"))
    return tuple(hashes)


def _int_field(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError(f"'{name}' must be an integer, got {value!r}")
    return value


def parse_completion_request(
    body: object, kind: CompletionKind, config: EmulatorConfig
) -> CompletionRequest:
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    model = body.get("model", config.models[0])
    if not isinstance(model, str):
        raise BadRequestError(f"'model' must be a string, got {model!r}")
    max_tokens = _int_field(body, "max_completion_tokens", 0) or _int_field(
        body, "max_tokens", config.default_max_tokens
    )
    if max_tokens < 1:
        raise BadRequestError(f"max_tokens must be at least 1, got {max_tokens}")
    if config.max_new_tokens:
        max_tokens = min(max_tokens, config.max_new_tokens)
    stream_options = body.get("stream_options") or {}
    user = body.get("user")
    text = (
        _chat_prompt(body.get("messages"))
        if kind == "chat"
        else _text_prompt(body.get("prompt", ""))
    )
    return CompletionRequest(
        kind=kind,
        model=model,
        prompt_tokens=estimate_prompt_tokens(len(text)),
        max_tokens=max_tokens,
        priority=_int_field(body, "priority", 0),
        stream=bool(body.get("stream", False)),
        include_usage=bool(
            isinstance(stream_options, dict) and stream_options.get("include_usage")
        ),
        user=user if isinstance(user, str) else None,
        prefix_blocks=(
            prompt_blocks(text, config.block_tokens) if config.prefix_cache_blocks else ()
        ),
        prompt_text=text,
    )


# ----------------------------------------------------------------------------- rendering


class CompletionRenderer:
    """Response bytes of one request, preformatted once so each streamed token costs a copy."""

    def __init__(
        self,
        request: CompletionRequest,
        request_id: str,
        filler_word: str,
        *,
        report_cached_tokens: bool = False,
    ) -> None:
        self.request = request
        self.request_id = request_id
        self.filler_word = filler_word
        # vLLM reports prompt_tokens_details only with --enable-prompt-tokens-details; the
        # emulator reports it whenever its prefix cache is on.
        self.report_cached_tokens = report_cached_tokens
        self.created = int(time.time())
        is_chat = request.kind == "chat"
        self.object_name = "chat.completion" if is_chat else "text_completion"
        self.chunk_object_name = "chat.completion.chunk" if is_chat else "text_completion"
        # Every token event, all of one length, in order twice over: a run of them is a slice.
        self._token_cycle = self._variants(None) * 2
        self._token_event_bytes = len(self._token_cycle) // (2 * TOKEN_VARIANTS)
        self._last_token_events = self._variants("length")
        self._last_token_event_bytes = len(self._last_token_events) // TOKEN_VARIANTS
        self._tokens_sent = 0

    def _variants(self, finish_reason: str | None) -> bytes:
        # One JSON dump per request, the digit put in afterwards: a token costs a copy.
        template = self._sse(self._chunk_choice(self.filler_word + _VARIANT_MARK, finish_reason))
        head, tail = template.rsplit(b"\\u0000", 1)
        return b"".join(head + str(digit).encode() + tail for digit in range(TOKEN_VARIANTS))

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.request.model,
        }

    def _chunk_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        if self.request.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return {**self._envelope(self.chunk_object_name), "choices": [choice]}
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
            "stop_reason": None,
        }
        return {**self._envelope(self.chunk_object_name), "choices": [choice]}

    @staticmethod
    def _sse(payload: object) -> bytes:
        return f"data: {_dumps(payload)}\n\n".encode()

    def _usage(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        prompt_tokens = self.request.prompt_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if self.report_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        return usage

    def stream_start(self) -> bytes:
        """vLLM's chat stream opens with an empty assistant delta; completions have none."""
        if self.request.kind != "chat":
            return b""
        chunk = self._chunk_choice("", None)
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        return self._sse(chunk)

    def token_events(self, count: int, ends_stream: bool) -> bytes:
        """The next `count` token events; with `ends_stream`, the last carries finish_reason."""
        start = self._tokens_sent % TOKEN_VARIANTS
        self._tokens_sent += count
        size = self._token_event_bytes
        plain = count - 1 if ends_stream else count
        rounds, rest = divmod(plain, TOKEN_VARIANTS)
        one_round = self._token_cycle[start * size : (start + TOKEN_VARIANTS) * size]
        body = one_round * rounds + one_round[: rest * size]
        if ends_stream:
            last = (start + count - 1) % TOKEN_VARIANTS
            size = self._last_token_event_bytes
            body += self._last_token_events[last * size : (last + 1) * size]
        return body

    def stream_end(self, completion_tokens: int, cached_tokens: int = 0) -> bytes:
        if not self.request.include_usage:
            return SSE_DONE
        usage_chunk = {
            **self._envelope(self.chunk_object_name),
            "choices": [],
            "usage": self._usage(completion_tokens, cached_tokens),
        }
        return self._sse(usage_chunk) + SSE_DONE

    def full_response(self, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        text = "".join(token_text(self.filler_word, i) for i in range(completion_tokens))
        choice: dict[str, Any]
        if self.request.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        return {
            **self._envelope(self.object_name),
            "choices": [choice],
            "usage": self._usage(completion_tokens, cached_tokens),
        }


# ----------------------------------------------------------------------------- the response


class CompletionResponse:
    """ASGI response that runs one request through the engine.

    A watcher task reads ``receive`` for ``http.disconnect`` the whole time (while the request is
    delayed, queued, running or streaming) and aborts the sequence, which wakes the responder;
    ``finally`` aborts too, so an exception or cancellation can never leak a slot.
    """

    def __init__(
        self,
        engine: EmulatedEngine,
        request: CompletionRequest,
        renderer: CompletionRenderer,
        first_byte_delay_s: float,
        *,
        drop: bool = False,
    ) -> None:
        self._engine = engine
        self._request = request
        self._renderer = renderer
        self._first_byte_delay_s = first_byte_delay_s
        # A stream that breaks after its first tokens (`FaultSwitches.drop_prompt`).
        self._drop = drop
        self._client_gone = asyncio.Event()
        self._seq: Sequence | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.get_running_loop().create_task(self._watch_disconnect(receive))
        try:
            await self._respond(send)
        finally:
            watcher.cancel()
            if self._seq is not None:
                self._engine.abort(self._seq)
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    async def _watch_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        self._client_gone.set()
        if self._seq is not None:
            self._engine.abort(self._seq)

    async def _respond(self, send: Send) -> None:
        if self._first_byte_delay_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._client_gone.wait(), self._first_byte_delay_s)
        if self._client_gone.is_set():
            return
        request = self._request
        try:
            self._seq = self._engine.submit(
                self._renderer.request_id,
                request.model,
                request.prompt_tokens,
                request.max_tokens,
                request.priority,
                request.user,
                request.prefix_blocks,
            )
        except EngineClosedError:
            await error_response(503, "the engine is shutting down", "ServiceUnavailable")(
                {"type": "http"}, _never_receive, send
            )
            return
        if request.stream:
            await self._stream(self._seq, send)
        else:
            await self._respond_whole(self._seq, send)

    async def _stream(self, seq: Sequence, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        # Like vLLM, the opening chunk goes out with the first token, i.e. once the request is
        # scheduled, never while it waits in the queue.
        opening = self._renderer.stream_start()
        while count := await seq.next_tokens():
            if self._client_gone.is_set():
                return
            # next_tokens hands out everything generated so far: if finished, the last is here.
            body = opening + self._renderer.token_events(count, seq.state is SequenceState.FINISHED)
            opening = b""
            await send({"type": "http.response.body", "body": body, "more_body": True})
            if self._drop:
                # Returning mid-body makes the server close the connection: a broken stream.
                return
        if self._client_gone.is_set():
            return  # nobody to finish the stream for
        finished = seq.state is SequenceState.FINISHED
        # Closed by the engine's shutdown: end the body without [DONE], like a dropped stream.
        tail = self._renderer.stream_end(seq.generated, seq.cached_tokens) if finished else b""
        await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _respond_whole(self, seq: Sequence, send: Send) -> None:
        await seq.wait_done()
        if self._client_gone.is_set():
            return
        response: Response
        if seq.state is SequenceState.FINISHED:
            response = JSONResponse(self._renderer.full_response(seq.generated, seq.cached_tokens))
        else:
            response = error_response(503, "the engine is shutting down", "ServiceUnavailable")
        await response({"type": "http"}, _never_receive, send)


_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


async def _never_receive() -> Message:
    raise RuntimeError("a prepared response does not read the request")


# ----------------------------------------------------------------------------- the app


class Emulator:
    """One emulated engine with its HTTP app; ``emulator.app`` is the ASGI application."""

    def __init__(self, config: EmulatorConfig | None = None) -> None:
        self.config = config or EmulatorConfig()
        self.metrics = EngineMetrics(
            self.config.metrics_profile,
            self.config.models,
            self.config.kv_capacity_tokens,
            prefix_caching=self.config.prefix_cache_blocks > 0,
            success_counter=self.config.success_counter,
        )
        self.engine = EmulatedEngine(self.config, observer=self.metrics)
        # `/metrics` pages asked for (the filtered page included): how often gateways read us.
        self.metrics_requests = 0
        self._completion_requests = 0
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._completion_endpoint("chat"), methods=["POST"]),
                Route("/v1/completions", self._completion_endpoint("text"), methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.render_metrics, methods=["GET"]),
                Route("/metrics/", self.render_filtered_metrics, methods=["GET"]),
                Route("/emulator/faults", self.faults_endpoint, methods=["GET", "POST"]),
                Route("/emulator/stats", self.stats_endpoint, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.engine.aclose()

    def _completion_endpoint(self, kind: CompletionKind) -> Callable[[Request], Awaitable[Any]]:
        async def endpoint(request: Request) -> Any:
            return await self.handle_completion(request, kind)

        return endpoint

    async def handle_completion(self, request: Request, kind: CompletionKind) -> Any:
        try:
            completion = parse_completion_request(await request.json(), kind, self.config)
        except json.JSONDecodeError:
            return error_response(400, "the request body is not valid JSON", "BadRequestError")
        except BadRequestError as exc:
            return error_response(400, str(exc), "BadRequestError")
        if completion.model not in self.config.models:
            message = f"The model `{completion.model}` does not exist."
            return error_response(404, message, "NotFoundError")
        if completion.priority != 0 and self.config.policy != "priority":
            # vLLM refuses a priority unless started with --scheduling-policy priority.
            message = "Priority scheduling is not enabled (policy is 'fcfs')."
            return error_response(400, message, "BadRequestError")
        self._completion_requests += 1
        faults = self.engine.faults
        nth = faults.fail_every_nth_completion
        if (nth and self._completion_requests % nth == 0) or (
            faults.fail_prompt and faults.fail_prompt in completion.prompt_text
        ):
            return error_response(500, "injected failure", "InternalServerError")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        renderer = CompletionRenderer(
            completion,
            f"{prefix}-{uuid.uuid4().hex}",
            self.config.filler_word,
            report_cached_tokens=self.config.prefix_cache_blocks > 0,
        )
        return CompletionResponse(
            self.engine,
            completion,
            renderer,
            faults.first_byte_delay_s,
            drop=bool(faults.drop_prompt) and faults.drop_prompt in completion.prompt_text,
        )

    async def list_models(self, request: Request) -> JSONResponse:
        created = int(time.time())
        models = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": name,
                "parent": None,
            }
            for name in self.config.models
        ]
        return JSONResponse({"object": "list", "data": models})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def render_filtered_metrics(self, request: Request) -> Response:
        """`/metrics/?name[]=...`: only the named samples, as vLLM 0.32 serves them there (its
        `/metrics` ignores the query and renders the whole page, as ours does)."""
        if not self.engine.faults.metrics_filter:
            return PlainTextResponse("Not Found", status_code=404)
        return await self.render_metrics(request, request.query_params.getlist("name[]"))

    async def render_metrics(self, request: Request, names: list[str] | None = None) -> Response:
        self.metrics_requests += 1
        faults = self.engine.faults
        if faults.metrics_delay_s > 0:
            await asyncio.sleep(faults.metrics_delay_s)
        if faults.metrics_mode == "error":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if faults.metrics_mode == "missing":
            return PlainTextResponse("Not Found", status_code=404)
        if faults.metrics_mode == "garbage":
            return Response(GARBAGE_METRICS, media_type="text/plain; version=0.0.4")
        body = self.metrics.render(self.engine, names)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def faults_endpoint(self, request: Request) -> JSONResponse:
        if request.method == "POST":
            try:
                changes = await request.json()
                if not isinstance(changes, dict):
                    raise ValueError("the body must be a JSON object of fault switches")
                self.engine.faults.update(changes)
            except ValueError as exc:  # JSONDecodeError is a ValueError too
                return error_response(400, str(exc), "BadRequestError")
        return JSONResponse(dataclasses.asdict(self.engine.faults))

    async def stats_endpoint(self, request: Request) -> JSONResponse:
        return JSONResponse(self.engine.statistics()._asdict())


def create_app(config: EmulatorConfig | None = None) -> Starlette:
    """The ASGI app alone (the engine is reachable as ``app.state.emulator.engine``)."""
    emulator = Emulator(config)
    emulator.app.state.emulator = emulator
    return emulator.app
