"""`python -m optimum_qnn serve`: an OpenAI-compatible HTTP endpoint (Starlette on uvicorn) for one loaded variant.

``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream: true`` as server-sent events
in OpenAI's chunk format), ``GET /health``. One generation at a time with a bounded queue (`engine.Engine`): a
full queue is a 429 with ``Retry-After``. Prompts reuse the cache of the previous request where they begin with it,
and ``usage.prompt_tokens_details.cached_tokens`` says how many tokens were not prefilled again.

Every backend serves: a request asks the backend for nothing beyond the neutral values unless the client sets them
(`protocol.parse`), a parameter the backend cannot honour is a 400 naming it and the backend (`check_sampling`), a
prompt longer than the backend takes is a 400 ``context_length_exceeded`` (`limits.Limits`), and any other failure is
an OpenAI-shaped error, never a traceback: `api_error` maps it, a stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from optimum_qnn.errors import ContextOverflowError, InvalidInputError, OptimumQnnError, UnsupportedParameterError
from optimum_qnn.runtime.generation import Sampling
from optimum_qnn.runtime.image_prompts import IMAGE_MARK, encode_marked, marked
from optimum_qnn.runtime.limits import limits_of
from optimum_qnn.runtime.server.engine import Engine, Job, QueueFull
from optimum_qnn.runtime.server.protocol import ApiError, Request, chat_messages, completion_prompt, parse
from optimum_qnn.runtime.stops import conversation_stop_ids

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 1 << 20  # bytes; a longer body is a 413
IMAGE_MAX_BODY = 32 << 20  # bytes, for a server of an image variant: photographs come inline, base64 (4/3 their size)


_STOPPING = ApiError(503, "The server is stopping; the generation was cancelled", code="server_shutdown",
                     kind="server_error")


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# What a client sends for each `generate` option a backend may refuse.
_REQUEST_FIELD = {"generator": "seed", "top_p": "top_p", "top_k": "top_k"}


def api_error(e: BaseException) -> ApiError:
    """An exception from a request's handling or its backend as the OpenAI-shaped error the client gets: the user's
    errors are 400s, a backend that failed a 500 with the first line of its message (the log has the rest)."""
    if isinstance(e, ApiError):
        return e
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, UnsupportedParameterError):
        field = _REQUEST_FIELD.get(e.param, e.param)
        return ApiError(400, f"{field} is not supported by the {e.backend} backend, which samples with a temperature "
                        f"only (its top-p is fixed and it seeds itself): leave {field} out, or serve with --device host",
                        code="unsupported_parameter", param=field)
    if isinstance(e, ContextOverflowError):
        return ApiError(400, str(e), code="context_length_exceeded", param="messages")
    if isinstance(e, InvalidInputError):
        return ApiError(400, str(e))
    if isinstance(e, OptimumQnnError):
        return ApiError(500, f"The model's backend failed: {first}", code="backend_error", kind="server_error")
    return ApiError(500, f"The server failed unexpectedly ({type(e).__name__}); its log has the details",
                    code="internal_error", kind="server_error")


class Service:
    """The endpoints over one model: request checks, prompt building, the engine, the response shapes."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str, api_key: str | None, queue_size: int,
                 max_body: int):
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.api_key, self.max_body = api_key, max_body
        self.engine = Engine(model, tokenizer, queue_size=queue_size)
        self.limits = limits_of(model)
        self.capacity = self.limits.context_len
        self.eos = conversation_stop_ids(model.manifest.tokenizer.eos_ids, tokenizer)
        self.check_sampling = getattr(model.backend, "check_sampling", None)  # a backend that samples only partly
        self.takes_images = getattr(model, "takes_images", False)  # `QNNModelForImageTextToText`: image_url parts
        self.created = int(time.time())
        self.stopping = False  # set when the server stops: cancelled generations then say why

    def stop_generations(self) -> None:
        """The server is stopping and its grace period is over: cancel the running generation and the waiting ones."""
        self.stopping = True
        self.engine.cancel_all()

    # --- plumbing -------------------------------------------------------------------------------------------------

    def _check_key(self, request: HttpRequest) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", kind="authentication_error")

    async def _body(self, request: HttpRequest) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"The request body has {length} bytes; the limit is {self.max_body}", code="body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body:
                raise ApiError(413, f"The request body exceeds the limit of {self.max_body} bytes", code="body_too_large")
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from None

    def _check_model(self, name: str) -> None:
        if name != self.name:
            raise ApiError(404, f"The model {name!r} does not exist here; this server serves {self.name!r}",
                           code="model_not_found", param="model")

    def _check_sampling(self, options: dict[str, Any]) -> None:
        """Refuse, before the request is queued, a sampling parameter the backend cannot honour (a 400 naming it)."""
        if self.check_sampling is not None:
            self.check_sampling(Sampling(options["do_sample"], options.get("temperature", 1.0), options.get("top_k"),
                                         options.get("top_p"), options.get("generator")))

    def _ids(self, body: dict, chat: bool) -> tuple[list[int], dict[str, Any] | None]:
        """The prompt's ids, and its images' processed inputs (None without images)."""
        pictures, counts = None, []
        if chat:
            messages, images = chat_messages(body, self.takes_images)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ApiError(400, "This model's tokenizer has no chat template: use /v1/completions")
            if any(images):
                if any(IMAGE_MARK in m["content"] for m in messages):
                    raise ApiError(400, "A message holds the reserved sequence \\x00image\\x00", param="messages")
                pictures, counts = self._images([b for found in images for b in found])
                messages = [{**m, "content": marked(m["content"], len(found))} for m, found in zip(messages, images)]
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template's own refusal (e.g. roles that do not alternate)
                raise ApiError(400, f"The chat template refused these messages: {e}", param="messages") from None
            ids = encode_marked(self.tokenizer, text, counts, self.model.manifest.contract.images)
        else:
            ids = self.tokenizer(completion_prompt(body), add_special_tokens=True)["input_ids"]
        if self.limits.room(len(ids)) < 1:
            fits = "" if self.limits.max_prompt >= self.capacity else (
                f" (on {self.model.device_name}, a prompt may hold at most {self.limits.max_prompt})")
            raise ApiError(
                400, f"This model's maximum context length is {self.capacity} tokens{fits}. However, your "
                f"{'messages' if chat else 'prompt'} resulted in {len(ids)} tokens, with none left to generate. "
                "Shorten them, or export with a larger --max-seq-len.",
                code="context_length_exceeded", param="messages" if chat else "prompt",
            )
        return list(ids), pictures

    def _images(self, images: list[bytes]) -> tuple[dict[str, Any], list[int]]:
        """The images' processed inputs (Gemma 4's processing at the variant's budget) and soft-token counts; an image
        that cannot be read is a 400 naming why."""
        try:
            pictures = self.model.image_inputs(images)
        except OptimumQnnError as e:
            raise ApiError(400, f"An image of the messages cannot be read: {e}", param="messages",
                           code="invalid_image") from None
        return pictures, [int(n) for n in pictures["num_soft_tokens_per_image"]]

    # --- endpoints ------------------------------------------------------------------------------------------------

    async def models(self, request: HttpRequest) -> Response:
        try:
            self._check_key(request)
            if "model" in request.path_params:
                self._check_model(request.path_params["model"])
                return JSONResponse(self._model_card())
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "optimum-qnn"}

    async def health(self, request: HttpRequest) -> Response:
        m = self.model
        return JSONResponse({
            "status": "ok", "model": self.name, "device": m.device_name, "soc": m.manifest.target.soc,
            "context_len": self.capacity, "busy": self.engine.busy, "queue_size": self.engine.queue_size,
            "last_generation": self.engine.last,
        })

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: HttpRequest, chat: bool) -> Response:
        try:
            return await self._answer(request, chat)
        except Exception as e:  # never a traceback to the client: an OpenAI-shaped error, logged once here
            error = api_error(e)
            if error.status >= 500:
                logger.exception("A request failed")
            return _error(error)

    async def _answer(self, request: HttpRequest, chat: bool) -> Response:
        try:
            self._check_key(request)
            body = await self._body(request)
            req = parse(body, chat=chat)
            self._check_model(req.model)
            self._check_sampling(req.options)
            ids, pictures = self._ids(body, chat)
            n = len(ids)
            asked = self.limits.default_max_new_tokens(n) if req.max_tokens is None else min(req.max_tokens, self.limits.room(n))
            options = dict(req.options, max_new_tokens=asked, eos_token_id=self.eos)
            job = Job(ids, options, req.stop, images=pictures)
            try:
                done = self.engine.submit(job)
            except QueueFull:
                wait = self.engine.retry_after()
                raise ApiError(429, f"The NPU is busy and its queue of {self.engine.queue_size} is full; retry in "
                               f"about {wait} s", code="rate_limit_exceeded", kind="rate_limit_error",
                               headers={"Retry-After": str(wait)}) from None
        except ApiError as e:
            return _error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            return StreamingResponse(self._stream(request, job, done, req, rid, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await self._wait(request, job, done)
        if job.error is not None:
            return _error(api_error(job.error))
        if job.finish_reason == "cancelled":
            return _error(_STOPPING)
        choice: dict[str, Any] = {"index": 0, "finish_reason": job.finish_reason, "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": job.text}
        else:
            choice["text"] = job.text
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.name, "choices": [choice], "usage": self._usage(job),
        })

    async def _wait(self, request: HttpRequest, job: Job, done: asyncio.Future) -> None:
        """Wait for ``job``, cancelling it if the client goes away meanwhile."""
        while True:
            finished, _ = await asyncio.wait({done}, timeout=0.25)
            if finished:
                done.result()
                return
            if await request.is_disconnected():
                job.cancel()

    def _usage(self, job: Job) -> dict[str, Any]:
        s = job.stats
        cached = s.reused_tokens if s is not None else 0
        prompt = len(job.ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(job.tokens), "total_tokens": prompt + len(job.tokens),
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def _stream(self, request: HttpRequest, job: Job, done: asyncio.Future, req: Request, rid: str, chat: bool):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                content: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice: dict[str, Any] = {"index": 0, "delta": content, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            out = {"id": rid, "object": kind, "created": created, "model": self.name, "choices": [choice]}
            if req.include_usage:
                out["usage"] = None
            return f"data: {json.dumps(out)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            while (piece := await job.pieces.get()) is not None:
                yield chunk(piece)
            await done  # the end mark comes from the worker just before its future completes
            if job.error is not None:  # an error event, as OpenAI's streams send one (the client raises APIError)
                yield f"data: {json.dumps(api_error(job.error).body())}\n\n"
                return
            if job.finish_reason == "cancelled":  # the server stops (a client that left reads nothing more)
                if self.stopping:  # an error event, as OpenAI's streams send one: the client learns why it ended
                    yield f"data: {json.dumps(_STOPPING.body())}\n\n"
                return
            yield chunk(None, job.finish_reason)
            if req.include_usage:
                yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': created, 'model': self.name, 'choices': [], 'usage': self._usage(job)})}\n\n"
            yield "data: [DONE]\n\n"
        except Exception as e:  # the stream has begun: end it with an error event rather than a cut connection
            logger.exception("A stream failed")
            yield f"data: {json.dumps(api_error(e).body())}\n\n"
        finally:
            if not done.done():  # the client went away (or the server stops): stop at the next token
                job.cancel()
                logger.info("A client left during its stream; its generation stops")


def build_app(model: Any, tokenizer: Any = None, *, name: str | None = None, api_key: str | None = None,
              queue_size: int = 8, max_body: int | None = None) -> Starlette:
    """The ASGI app serving ``model`` (a loaded `QNNModelForCausalLM`) under ``name`` (default: ``model.name``, the
    artifact folder's or Hub repo's name). ``max_body``: bytes of a request body (default `DEFAULT_MAX_BODY`, or
    `IMAGE_MAX_BODY` for a `QNNModelForImageTextToText`, whose requests carry images)."""
    if max_body is None:
        max_body = IMAGE_MAX_BODY if getattr(model, "takes_images", False) else DEFAULT_MAX_BODY
    service = Service(model, tokenizer if tokenizer is not None else model.tokenizer(),
                      name=name or model.name, api_key=api_key, queue_size=queue_size, max_body=max_body)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        service.engine.close()  # a stopping server cancels the running generation at its next token

    app = Starlette(routes=[
        Route("/health", service.health, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{model:path}", service.models, methods=["GET"]),
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
    ], lifespan=lifespan)
    app.state.service = service
    return app


GRACE_SECONDS = 10  # on SIGTERM/SIGINT, a running generation has this long to finish before it is cancelled
_CLOSE_SECONDS = 5  # then its response has this long to send its last event before uvicorn drops the connection


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server, which also cancels the running generation once the grace period is over, so its
        response ends with an event that says why instead of a connection cut mid-stream."""

        def __init__(self, config: "uvicorn.Config", service: Service, grace: float):
            super().__init__(config)
            self.service, self.grace, self.timer = service, grace, None

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            if self.timer is None:
                self.timer = threading.Timer(self.grace, self.service.stop_generations)
                self.timer.daemon = True
                self.timer.start()

    return _Server


def serve(model: Any, tokenizer: Any = None, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, queue_size: int = 8,
          name: str | None = None, verbose: bool = False, grace: float = GRACE_SECONDS) -> None:
    """Serve ``model`` until SIGINT/SIGTERM: new connections are refused, the running generation has ``grace``
    seconds to finish, then it is cancelled (its stream ends with an error event) and the server stops."""
    import uvicorn

    app = build_app(model, tokenizer, name=name, api_key=api_key, queue_size=queue_size)
    config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                            access_log=verbose, timeout_graceful_shutdown=grace + _CLOSE_SECONDS, lifespan="on")
    service = app.state.service
    server = _server_class()(config, service, grace)
    print(f"Serving {service.name!r} ({model.manifest.target.soc}, {model.manifest.quantization.scheme}, context "
          f"{service.capacity}, on {model.device_name}) at http://{host}:{port}/v1"
          + (" (API key required)" if api_key else "") + ". Ctrl-C stops.", flush=True)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM and then raises the signal again to the handler that was there
    # before it: with these, that ends here, and the command exits 0 after a clean stop.
    stopped_by: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stopped_by.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        if server.timer is not None:
            server.timer.cancel()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    why = f" ({signal.Signals(stopped_by[0]).name})" if stopped_by else ""
    print(f"Server stopped{why}.", flush=True)
