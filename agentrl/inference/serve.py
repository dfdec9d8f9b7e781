"""A small vLLM-compatible server over the local sampler, from the stdlib alone.

It speaks the part of vLLM's API that agentrl uses, so the HTTP path, the router and
weight publication run here without a GPU:

- `POST /v1/completions`: token ids in, `token_ids` + `logprobs.token_logprobs` out. The
  policy version travels in the `x-agentrl-policy-version` header, and each sampled
  token's version in `choices[0].token_versions` (an agentrl extension: vLLM sends
  neither). `GET /v1/models`, `GET /health`, `POST /tokenize`, `POST /detokenize`.
- vLLM's dev-mode control routes: `POST /pause?mode=abort|wait|keep`, `/resume`,
  `GET /is_paused`, `POST /sleep?level=1`, `/wake_up`, `GET /is_sleeping`,
  `GET /weight_info`, `POST /update_weight_version`, `GET /get_world_size`, the
  weight-transfer protocol (`/init_weight_transfer_engine`, `/start_weight_update`,
  `/update_weights`, `/finish_weight_update`; received over gloo), and
  `POST /collective_rpc` with method `reload_weights` (`kwargs.weights_path`: a folder of
  safetensors), `POST /reset_prefix_cache` (a no-op: no prefix cache here; `cache_salt`
  in a completion body is accepted for the same reason). Weights change only while
  paused (HTTP 409 otherwise), so no token is ever stamped with a version it was not
  sampled under.

HTTP
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
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import EMBEDDED_NAME
from agentrl.inference.openai import POLICY_VERSION_HEADER
from agentrl.inference.weight_transfer import GlooReceiver

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentrl.inference.local import LocalSampler

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
    cache_salt: str | None = None  # accepted: this server keeps no prefix cache to salt


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class CompletionServer:
    """The running server: `url`, and an idempotent `close()` (the sampler stays open)."""

    def __init__(
        self,
        sampler: LocalSampler,
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
        self._control = threading.Lock()  # one control operation at a time
        self._sleeping = False
        self._receiver = GlooReceiver()
        self._incoming: dict[str, torch.Tensor] | None = None  # between start and finish
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

    # ---- control: vLLM's dev-mode routes --------------------------------------------

    def control(self, method: str, path: str, query: dict[str, str], body: bytes) -> object:
        """Serve one control route; raises _HTTPError for a bad or unknown one."""
        route = _CONTROL_ROUTES.get((method, path))
        if route is None:
            raise _HTTPError(404, f"no route {method} {path}")
        data = _json_object(body) if method == "POST" else {}
        with self._control:
            try:
                return route(self, query, data)
            except SamplerError as e:
                raise _HTTPError(400, str(e)) from e

    def _pause(self, query: dict[str, str], data: dict[str, Any]) -> object:
        mode = query.get("mode", "abort")  # vLLM's default
        if mode not in ("abort", "wait", "keep"):
            raise _HTTPError(400, f"mode must be abort, wait or keep, not {mode!r}")
        self.sampler.pause(cast(Any, mode))
        return {"status": "paused"}

    def _resume(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if self._sleeping:
            raise _HTTPError(409, "the server is asleep: POST /wake_up")
        self.sampler.resume()
        return {"status": "resumed"}

    def _sleep(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if query.get("level", "1") != "1":
            raise _HTTPError(
                400, "agentrl serve sleeps at level 1 only (the weights stay in CPU memory)"
            )
        self._pause({"mode": query.get("mode", "abort")}, data)
        self._sleeping = True
        return {"status": "sleeping"}

    def _wake_up(self, query: dict[str, str], data: dict[str, Any]) -> object:
        self._sleeping = False
        self.sampler.resume()
        return {"status": "awake"}

    def _weight_info(self, query: dict[str, str], data: dict[str, Any]) -> object:
        # token_versions: this server reports each token's version (pause mode keep is exact).
        return {"weight_version": str(self.sampler.policy_version), "token_versions": True}

    def _update_weight_version(self, query: dict[str, str], data: dict[str, Any]) -> object:
        version = _version(data.get("new_version"), "new_version")
        self._require_paused("set the weight version")
        self.sampler.set_policy_version(version)
        return {"success": True, "new_version": str(version)}

    def _collective_rpc(self, query: dict[str, str], data: dict[str, Any]) -> object:
        method, kwargs = data.get("method"), data.get("kwargs") or {}
        if method != "reload_weights":
            raise _HTTPError(400, f"collective_rpc: only method reload_weights, not {method!r}")
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        if not isinstance(path, str):
            raise _HTTPError(400, "reload_weights needs kwargs.weights_path (a folder)")
        self._require_paused("reload weights")
        # The version stays until /update_weight_version: nothing samples while paused.
        self.sampler.load_weights(path, self.sampler.policy_version)
        return {"results": [None]}

    def _world_size(self, query: dict[str, str], data: dict[str, Any]) -> object:
        return {"world_size": 1}

    def _init_transfer(self, query: dict[str, str], data: dict[str, Any]) -> object:
        init_info = data.get("init_info")
        if not isinstance(init_info, dict):
            raise _HTTPError(400, "Missing 'init_info' in request body")
        self._receiver.init(init_info)
        return {"message": "Weight transfer initialized"}

    def _start_update(self, query: dict[str, str], data: dict[str, Any]) -> object:
        self._require_paused("start a weight update")
        self._incoming = {}
        return {"message": "Weight update started"}

    def _update_weights(self, query: dict[str, str], data: dict[str, Any]) -> object:
        info = data.get("update_info")
        if not isinstance(info, dict):
            raise _HTTPError(400, "Missing 'update_info' in request body")
        if self._incoming is None:
            raise _HTTPError(409, "no weight update under way: POST /start_weight_update")
        self._incoming.update(self._receiver.receive(info))
        return {"message": "Weights updated"}

    def _finish_update(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if self._incoming is None:
            raise _HTTPError(409, "no weight update under way: POST /start_weight_update")
        incoming, self._incoming = self._incoming, None
        raw = data.get("weight_version")
        version = (
            self.sampler.policy_version + 1 if raw is None else _version(raw, "weight_version")
        )
        self._require_paused("finish a weight update")
        self.sampler.update_weights(incoming, version)  # all or nothing: checks every name
        return {"message": "Weight update finished"}

    def _require_paused(self, what: str) -> None:
        if not self.sampler.is_paused:
            raise _HTTPError(
                409, f"cannot {what} while generating: POST /pause first (then /resume)"
            )

    def _tokenize(self, query: dict[str, str], data: dict[str, Any]) -> object:
        with self._tokenizer_lock:
            if "messages" in data:
                text = self.tokenizer.apply_chat_template(
                    data["messages"],
                    add_generation_prompt=bool(data.get("add_generation_prompt", True)),
                    tokenize=False,
                )
                ids = self.tokenizer.encode(str(text), add_special_tokens=False)
            elif isinstance(data.get("prompt"), str):
                ids = self.tokenizer.encode(
                    data["prompt"], add_special_tokens=bool(data.get("add_special_tokens", True))
                )
            else:
                raise _HTTPError(400, "tokenize needs prompt (text) or messages")
            tokens = [int(t) for t in cast(list[int], ids)]
            strs = self.tokenizer.convert_ids_to_tokens(tokens)
        return {
            "count": len(tokens),
            "max_model_len": self.sampler.context_length,
            "tokens": tokens,
            "token_strs": strs,
        }

    def _detokenize(self, query: dict[str, str], data: dict[str, Any]) -> object:
        tokens = data.get("tokens")
        if not isinstance(tokens, list) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in tokens
        ):
            raise _HTTPError(400, "detokenize needs tokens (a list of ints)")
        with self._tokenizer_lock:
            return {"prompt": str(self.tokenizer.decode(tokens))}

    def _parse(self, body: bytes) -> CompletionRequest:
        data = _json_object(body)
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
            "token_versions": c.token_versions,  # agentrl's extension
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


_Route = Callable[[CompletionServer, dict[str, str], dict[str, Any]], object]
_CONTROL_ROUTES: dict[tuple[str, str], _Route] = {
    ("POST", "/pause"): CompletionServer._pause,
    ("POST", "/resume"): CompletionServer._resume,
    ("GET", "/is_paused"): lambda app, q, d: {"is_paused": app.sampler.is_paused},
    ("POST", "/sleep"): CompletionServer._sleep,
    ("POST", "/wake_up"): CompletionServer._wake_up,
    ("GET", "/is_sleeping"): lambda app, q, d: {"is_sleeping": app._sleeping},
    ("GET", "/weight_info"): CompletionServer._weight_info,
    ("POST", "/update_weight_version"): CompletionServer._update_weight_version,
    ("POST", "/collective_rpc"): CompletionServer._collective_rpc,
    ("GET", "/get_world_size"): CompletionServer._world_size,
    ("POST", "/init_weight_transfer_engine"): CompletionServer._init_transfer,
    ("POST", "/start_weight_update"): CompletionServer._start_update,
    ("POST", "/update_weights"): CompletionServer._update_weights,
    ("POST", "/finish_weight_update"): CompletionServer._finish_update,
    # vLLM's route; this server caches no prefixes across requests, so nothing to drop.
    ("POST", "/reset_prefix_cache"): lambda app, q, d: {"reset": True},
    ("POST", "/tokenize"): CompletionServer._tokenize,
    ("POST", "/detokenize"): CompletionServer._detokenize,
}


def serve(
    sampler: LocalSampler,
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
            self._control("GET", b"")

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
            self._control("POST", body)
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

    def _control(self, method: str, body: bytes) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            payload = self.app.control(method, parts.path.rstrip("/"), query, body)
        except _HTTPError as e:
            self._error(e.status, e.message)
        except Exception as e:  # one failed control call, not a dead server
            log.exception("%s %s failed", method, parts.path)
            self._error(500, f"{type(e).__name__}: {e}")
        else:
            self._json(200, payload)

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode()
        self._send(status, body, {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, message: str) -> None:
        kind = {
            400: "BadRequestError",
            404: "NotFoundError",
            409: "ConflictError",
            503: "ServiceUnavailableError",
        }
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


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _HTTPError(400, f"the body is not JSON: {e}") from e
    if not isinstance(data, dict):
        raise _HTTPError(400, "the body must be a JSON object")
    return data


def _version(value: object, field: str) -> int:
    try:
        version = int(str(value).removeprefix("v"))
    except ValueError:
        version = -1
    if version < 0:
        raise _HTTPError(400, f"{field} must be a non-negative integer, got {value!r}")
    return version


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
