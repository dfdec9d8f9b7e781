"""A small OpenAI-compatible completions server over any Sampler, from the stdlib alone.

It speaks the part of vLLM's `/v1/completions` that OpenAISampler uses (token ids in,
`token_ids` + `logprobs.token_logprobs` out, the policy version in the
`x-agentrl-policy-version` header), so the HTTP path runs here without a GPU. HTTP
requests arrive on ThreadingHTTPServer threads; each hands its generate() to one
asyncio loop in a background thread that owns the sampler, so concurrent requests
reach a LocalSampler together and are batched. Unlike vLLM, which logs and ignores
unknown body fields, it rejects them (a misspelled parameter must not sample silently
under defaults). Binds to 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, Sampler, SamplingParams
from agentrl.inference.embedded import EMBEDDED_NAME
from agentrl.inference.openai import POLICY_VERSION_HEADER

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20


class CompletionRequest(BaseModel):
    """The /v1/completions body this server accepts (vLLM's names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: list[int]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    stop_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    return_token_ids: bool | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    echo: bool | None = False
    user: str | None = None


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class CompletionServer:
    """The running server: `url`, and an idempotent `close()` (the sampler stays open)."""

    def __init__(
        self,
        sampler: Sampler,
        tokenizer: PreTrainedTokenizerBase,
        host: str,
        port: int,
        model_name: str,
    ) -> None:
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        self._tokenizer_lock = threading.Lock()
        self._closed = threading.Event()
        try:
            self._httpd = _HTTPServer((host, port), _Handler, self)
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {e.strerror or e}",
                fix="pick a free port with --port (0 picks one for you)",
            ) from e
        bound_host, bound_port = self._httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}/v1"
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="agentrl-serve-loop", daemon=True
        )
        self._http_thread = threading.Thread(
            target=self._httpd.serve_forever, name="agentrl-serve-http", daemon=True
        )
        self._loop_thread.start()
        self._http_thread.start()

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, fail in-flight requests with 503, stop the loop; safe twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        cancel = asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self.loop)
        cancel.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
        self._http_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self.loop.close()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "agentrl",
                    "root": self.model_name,
                }
            ],
        }

    def complete(self, body: bytes) -> tuple[dict[str, Any], dict[str, str]]:
        """Serve one /v1/completions body; raises _HTTPError for anything but a completion."""
        request = self._parse(body)
        params = self._params(request)
        if self._closed.is_set():
            raise _HTTPError(503, "the server is shutting down")
        future = asyncio.run_coroutine_threadsafe(
            self.sampler.generate(request.prompt, params), self.loop
        )
        try:
            completion = future.result()
        except concurrent.futures.CancelledError:
            raise _HTTPError(503, "the server shut down before this request finished") from None
        except SamplerError as e:
            raise _HTTPError(400, str(e)) from e
        return self._response(request, completion), {
            POLICY_VERSION_HEADER: str(completion.policy_version)
        }

    def _parse(self, body: bytes) -> CompletionRequest:
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise _HTTPError(400, f"the body is not JSON: {e}") from e
        if not isinstance(data, dict):
            raise _HTTPError(400, "the body must be a JSON object")
        unknown = sorted(set(data) - set(CompletionRequest.model_fields))
        if unknown:
            raise _HTTPError(400, f"unknown fields: {', '.join(unknown)}")
        prompt = data.get("prompt")
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and any(isinstance(p, str) for p in prompt)
        ):
            raise _HTTPError(400, "prompt is text: send token ids (a list of ints)")
        if isinstance(prompt, list) and any(isinstance(p, list) for p in prompt):
            raise _HTTPError(400, "prompt is a batch: send one list of token ids per request")
        if not isinstance(prompt, list) or not prompt:
            raise _HTTPError(400, "prompt must be a non-empty list of token ids")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in prompt):
            raise _HTTPError(400, "prompt token ids must be non-negative integers")
        try:
            request = CompletionRequest.model_validate(data)
        except ValidationError as e:
            raise _HTTPError(400, _validation_message(e)) from e
        if request.model is not None and request.model != self.model_name:
            raise _HTTPError(404, f"The model `{request.model}` does not exist.")
        return request

    def _params(self, r: CompletionRequest) -> SamplingParams:
        unsupported = {
            "n": r.n != 1,
            "stream": bool(r.stream),
            "echo": bool(r.echo),
            "logprobs": r.logprobs not in (None, 0),
            "top_k": r.top_k not in (None, -1, 0),
            "min_p": r.min_p not in (None, 0.0),
            "repetition_penalty": r.repetition_penalty not in (None, 1.0),
        }
        bad = [name for name, is_bad in unsupported.items() if is_bad]
        if bad:
            raise _HTTPError(
                400,
                f"unsupported values for {', '.join(bad)} (this server does n=1, no stream, "
                "no echo, logprobs 0, and no top_k/min_p/repetition_penalty)",
            )
        try:
            return SamplingParams(
                max_tokens=r.max_tokens if r.max_tokens is not None else 16,
                temperature=r.temperature if r.temperature is not None else 1.0,
                top_p=r.top_p if r.top_p is not None else 1.0,
                stop_token_ids=tuple(r.stop_token_ids or ()),
                stop=(r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ()),
                seed=r.seed,
            )
        except ValidationError as e:
            raise _HTTPError(400, _validation_message(e)) from e

    def _response(self, r: CompletionRequest, c: Completion) -> dict[str, Any]:
        ids = c.token_ids
        stop_ids = set(r.stop_token_ids or ())
        stop_strings = [r.stop] if isinstance(r.stop, str) else list(r.stop or ())
        stopped_on: int | str | None = None
        text_ids = ids
        if c.finish_reason == "stop" and ids:
            stopped_on = ids[-1]
            # vLLM leaves the stop token out of the text (never out of token_ids) unless asked.
            if not r.include_stop_str_in_output:
                text_ids = ids[:-1]
        with self._tokenizer_lock:
            text = str(self.tokenizer.decode(text_ids, skip_special_tokens=r.skip_special_tokens))
            tokens = self.tokenizer.convert_ids_to_tokens(ids) if r.logprobs is not None else []
            full = (
                str(self.tokenizer.decode(ids, skip_special_tokens=r.skip_special_tokens))
                if stop_strings and c.finish_reason == "stop"
                else ""
            )
        matches = [(full.find(stop), stop) for stop in stop_strings if stop in full]
        if matches:
            # It stopped on a string: vLLM cuts the text there (after it if asked to include
            # it); token_ids keep every sampled id, including the one that completed it.
            at, stopped_on = min(matches)
            text = full[: at + (len(stopped_on) if r.include_stop_str_in_output else 0)]
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": (
                {"tokens": tokens, "token_logprobs": c.logprobs} if r.logprobs is not None else None
            ),
            "finish_reason": c.finish_reason,
            # A string, or a requested stop id; EOS is null as in vLLM.
            "stop_reason": stopped_on
            if isinstance(stopped_on, str) or stopped_on in stop_ids
            else None,
            "token_ids": ids if r.return_token_ids else None,
            "prompt_token_ids": r.prompt if r.return_token_ids else None,
        }
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(r.prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(r.prompt) + len(ids),
            },
        }


def serve(
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    model_name: str = EMBEDDED_NAME,
) -> tuple[CompletionServer, str]:
    """Start serving `sampler` in background threads; returns the server and its /v1 URL."""
    server = CompletionServer(sampler, tokenizer, host, port, model_name)
    log.info("serving %s at %s", model_name, server.url)
    return server, server.url


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], app: CompletionServer
    ) -> None:
        self.app = app
        super().__init__(address, handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn in front of vLLM does
    server_version = "agentrl-serve"
    timeout = 60  # an idle keep-alive connection frees its thread after this long

    @property
    def app(self) -> CompletionServer:
        return cast(_HTTPServer, self.server).app

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            self._send(200, b"", {})
        elif path == "/v1/models":
            self._json(200, self.app.models())
        else:
            self._error(404, f"no route GET {path}")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            self._error(400, f"Content-Length must be 0..{MAX_BODY_BYTES}")
            return
        body = self.rfile.read(length)
        if path != "/v1/completions":
            self._error(404, f"no route POST {path}")
            return
        try:
            payload, headers = self.app.complete(body)
        except _HTTPError as e:
            self._error(e.status, e.message)
        except Exception as e:  # the request boundary: one failed request, not a dead server
            log.exception("completion request failed")
            self._error(500, f"{type(e).__name__}: {e}")
        else:
            self._json(200, payload, headers)

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, message: str) -> None:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
        error = {"message": message, "type": kind.get(status, "InternalServerError")}
        self._json(status, {"error": {**error, "param": None, "code": status}})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
