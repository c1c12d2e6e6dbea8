"""The OpenAI API's request fields this server reads, their checks, and its error shape.

Only what a static NPU graph can honour is accepted: one choice (``n`` = 1), text content (and images, as ``data:`` URLs, on an image variant), the sampling fields
(``temperature`` 0 is greedy), ``stop``, ``seed``, ``max_tokens`` / ``max_completion_tokens``. Anything else that is
set to a value other than its default is refused by name rather than ignored.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass
from typing import Any

import numpy as np


class ApiError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.kind = status, message, code, param, kind
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Fields a client may send that change nothing here (their defaults, or hints without effect on one NPU).
_IGNORED = {"model", "messages", "prompt", "stream", "stream_options", "user", "max_tokens", "max_completion_tokens",
            "temperature", "top_p", "stop", "seed", "n", "frequency_penalty", "presence_penalty", "logprobs", "echo",
            "metadata", "store", "parallel_tool_calls", "service_tier"}
_NEUTRAL = {"n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logprobs": False, "echo": False}


@dataclass
class Request:
    """A checked completion request."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    options: dict[str, Any]  # `generate` options: do_sample, temperature, top_p, generator
    stop: list[str]


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number in [{low}, {high}]; got {value!r}", param=name)
    return float(value)


def parse(body: Any, *, chat: bool) -> Request:
    """Check the fields of a ``/v1/chat/completions`` (``chat``) or ``/v1/completions`` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the id that GET /v1/models lists", param="model")
    for name, neutral in _NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"{name}={body[name]!r} is not supported: this server returns one choice, without "
                           "penalties or logprobs", param=name)
    for name in sorted(set(body) - _IGNORED):
        if name in ("tools", "tool_choice", "functions", "response_format", "logit_bias", "suffix", "best_of",
                    "top_logprobs", "audio", "modalities", "prediction", "reasoning_effort") and body[name] is not None:
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be true or false; got {stream!r}", param="stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(400, f"{name} must be an integer >= 1; got {value!r}", param=name)
            max_tokens = value if max_tokens is None else max_tokens
    temperature = _number(body, "temperature", 0.0, 2.0, 1.0)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer; got {seed!r}", param="seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a string or a list of up to 4 non-empty strings", param="stop")
    # Only what differs from the neutral value reaches `generate`: a plain request (temperature 1, top_p 1, no seed)
    # asks for nothing that a backend might not have (ExecuTorch's runner has no top-p filter and no seed).
    options: dict[str, Any] = {"do_sample": temperature > 0}
    if temperature > 0:
        options["temperature"] = temperature
        if top_p < 1:
            options["top_p"] = top_p if top_p > 0 else 1e-6
        if seed is not None:
            options["generator"] = np.random.default_rng(seed)
    return Request(model, stream, bool(stream_options.get("include_usage")), max_tokens, options, stops)


def chat_messages(body: dict, images: bool = False) -> tuple[list[dict[str, str]], list[list[bytes]]]:
    """The ``messages`` of a chat request as role/content strings (text parts joined), and each message's images
    (``image_url`` parts of user messages, as ``data:`` URLs; ``images``: the server takes them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    out, pictures = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"messages[{i}] needs a role of system, developer, user or assistant", param="messages")
        content, found = m.get("content"), []
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind == "image_url" and images and m["role"] == "user":
                    found.append(_image_bytes(part.get("image_url"), f"messages[{i}].content[{j}]"))
                elif kind == "image_url":
                    why = ("image parts go in user messages only" if m["role"] != "user" else
                           "this server's variant takes no images: serve an image variant (exported with --task "
                           "image-text-to-text) with `serve --images`")
                    raise ApiError(400, f"messages[{i}]: {why}", param="messages")
                else:
                    raise ApiError(400, f"messages[{i}]: only text and image_url content parts are supported",
                                   param="messages")
            content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of content parts", param="messages")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        pictures.append(found)
    return out, pictures


def _image_bytes(image_url: Any, where: str) -> bytes:
    """The bytes of an ``image_url`` part's ``data:`` URL; any other URL is refused (the server fetches nothing)."""
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ApiError(400, f"{where}: image_url needs a url", param="messages")
    if not url.startswith("data:"):
        raise ApiError(400, f"{where}: only data: URLs are read (this server fetches nothing from the network); send "
                       "the image inline, e.g. data:image/png;base64,...", param="messages", code="invalid_image_url")
    header, _, payload = url.partition(",")
    if not header.endswith(";base64") or not payload:
        raise ApiError(400, f"{where}: a data: URL of an image is base64 (data:image/png;base64,...)",
                       param="messages", code="invalid_image_url")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the data: URL's base64 does not decode", param="messages",
                       code="invalid_image_url") from None


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string (one prompt per request)", param="prompt")
    return prompt
