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

HTTP requests arrive on ThreadingHTTPServer threads; each hands its generate() to one
asyncio loop in a background thread that owns the sampler, so concurrent requests
reach a LocalSampler together, which batches them continuously (a request joins the
running batch at the next decode step). Unlike vLLM, which logs and ignores unknown
body fields, it rejects them (a misspelled parameter must not sample silently under
defaults). Binds to 127.0.0.1 unless told otherwise.

Limits. `max_tokens` is vLLM's: omitted, 16; null, the room the context leaves after
the prompt; a prompt plus max_tokens that does not fit the context is a 400 ("This
model's maximum context length is ..."). A completion is cancelled (its row leaves the
batch at the next step) when its client disconnects, or when it runs past
`request_timeout_s` (then 504). Every connection must deliver each request, headers and
body, within `read_timeout_s` of its first byte (else 408), so a slow or stalled client
holds its thread for at most that long. A malformed request is a 4xx with a one-line
JSON message (`{"error": {"message": ...}}`); NaN and Infinity are not JSON here. A
client that goes away is one debug log line.

The HTTP layer (bounded reads, one-line JSON errors, the backlog, quiet disconnects) is
`agentrl.inference.httpd`, shared with `agentrl serve-tinker`.
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
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import parse_qs, urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError

from agentrl.errors import ConfigError, SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import EMBEDDED_NAME
from agentrl.inference.httpd import (
    READ_TIMEOUT_S,
    HTTPError,
    JSONRequestHandler,
    QuietHTTPServer,
    load_json,
)
from agentrl.inference.openai import POLICY_VERSION_HEADER
from agentrl.inference.weight_transfer import GlooReceiver

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentrl.inference.local import LocalSampler

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0  # a completion running longer is cancelled (the router's timeout)
POLL_S = 0.1  # how often a running completion checks that its client is still there


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


class _ClientGone(Exception):
    """The client disconnected while its completion ran: nobody to answer."""


class CompletionServer:
    """The running server: `url`, and an idempotent `close()` (the sampler stays open)."""

    def __init__(
        self,
        sampler: LocalSampler,
        tokenizer: PreTrainedTokenizerBase,
        host: str,
        port: int,
        model_name: str,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.sampler = sampler
        self.request_timeout_s = request_timeout_s
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
            self._httpd = _HTTPServer((host, port), _Handler, self, read_timeout_s)
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

    def complete(
        self, body: bytes, client_gone: Callable[[], bool]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """Serve one /v1/completions body; raises HTTPError for anything but a completion.

        While it runs, `client_gone` is polled: a client that left, or a request past
        `request_timeout_s`, cancels the generation (its row leaves the batch).
        """
        request = self._parse(body)
        params = self._params(request)
        if self._closed.is_set():
            raise HTTPError(503, "the server is shutting down")
        future = asyncio.run_coroutine_threadsafe(
            self.sampler.generate(request.prompt, params), self.loop
        )
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                completion = future.result(timeout=POLL_S)
                break
            except TimeoutError:
                pass
            except concurrent.futures.CancelledError:
                raise HTTPError(503, "the server shut down before this request finished") from None
            except SamplerError as e:
                raise HTTPError(400, str(e)) from e
            if client_gone():
                future.cancel()
                raise _ClientGone
            if time.monotonic() > deadline:
                future.cancel()
                raise HTTPError(
                    504, f"the completion ran past this server's {self.request_timeout_s:g} s limit"
                )
        return self._response(request, completion), {
            POLICY_VERSION_HEADER: str(completion.policy_version)
        }

    # ---- control: vLLM's dev-mode routes --------------------------------------------

    def control(self, method: str, path: str, query: dict[str, str], body: bytes) -> object:
        """Serve one control route; raises HTTPError for a bad or unknown one."""
        route = _CONTROL_ROUTES.get((method, path))
        if route is None:
            raise HTTPError(404, f"no route {method} {path}")
        data = _json_object(body) if method == "POST" else {}
        with self._control:
            try:
                return route(self, query, data)
            except SamplerError as e:
                raise HTTPError(400, str(e)) from e

    def _pause(self, query: dict[str, str], data: dict[str, Any]) -> object:
        mode = query.get("mode", "abort")  # vLLM's default
        if mode not in ("abort", "wait", "keep"):
            raise HTTPError(400, f"mode must be abort, wait or keep, not {mode!r}")
        self.sampler.pause(cast(Any, mode))
        return {"status": "paused"}

    def _resume(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if self._sleeping:
            raise HTTPError(409, "the server is asleep: POST /wake_up")
        self.sampler.resume()
        return {"status": "resumed"}

    def _sleep(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if query.get("level", "1") != "1":
            raise HTTPError(
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
            raise HTTPError(400, f"collective_rpc: only method reload_weights, not {method!r}")
        path = kwargs.get("weights_path") if isinstance(kwargs, dict) else None
        if not isinstance(path, str):
            raise HTTPError(400, "reload_weights needs kwargs.weights_path (a folder)")
        self._require_paused("reload weights")
        # The version stays until /update_weight_version: nothing samples while paused.
        self.sampler.load_weights(path, self.sampler.policy_version)
        return {"results": [None]}

    def _world_size(self, query: dict[str, str], data: dict[str, Any]) -> object:
        return {"world_size": 1}

    def _init_transfer(self, query: dict[str, str], data: dict[str, Any]) -> object:
        init_info = data.get("init_info")
        if not isinstance(init_info, dict):
            raise HTTPError(400, "Missing 'init_info' in request body")
        self._receiver.init(init_info)
        return {"message": "Weight transfer initialized"}

    def _start_update(self, query: dict[str, str], data: dict[str, Any]) -> object:
        self._require_paused("start a weight update")
        self._incoming = {}
        return {"message": "Weight update started"}

    def _update_weights(self, query: dict[str, str], data: dict[str, Any]) -> object:
        info = data.get("update_info")
        if not isinstance(info, dict):
            raise HTTPError(400, "Missing 'update_info' in request body")
        if self._incoming is None:
            raise HTTPError(409, "no weight update under way: POST /start_weight_update")
        self._incoming.update(self._receiver.receive(info))
        return {"message": "Weights updated"}

    def _finish_update(self, query: dict[str, str], data: dict[str, Any]) -> object:
        if self._incoming is None:
            raise HTTPError(409, "no weight update under way: POST /start_weight_update")
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
            raise HTTPError(
                409, f"cannot {what} while generating: POST /pause first (then /resume)"
            )

    def _tokenize(self, query: dict[str, str], data: dict[str, Any]) -> object:
        with self._tokenizer_lock:
            if "messages" in data:
                messages = data["messages"]
                if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                    raise HTTPError(400, "messages must be a list of objects")
                try:
                    text = self.tokenizer.apply_chat_template(
                        messages,
                        add_generation_prompt=bool(data.get("add_generation_prompt", True)),
                        tokenize=False,
                    )
                except Exception as e:  # whatever the template trips over is in the messages
                    message = f"the chat template cannot render these messages: {e}"
                    raise HTTPError(400, message) from e
                ids = self.tokenizer.encode(str(text), add_special_tokens=False)
            elif isinstance(data.get("prompt"), str):
                ids = self.tokenizer.encode(
                    data["prompt"], add_special_tokens=bool(data.get("add_special_tokens", True))
                )
            else:
                raise HTTPError(400, "tokenize needs prompt (text) or messages")
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
        vocab = len(self.tokenizer)
        if not isinstance(tokens, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in tokens
        ):
            raise HTTPError(400, f"detokenize needs tokens (a list of ints in 0..{vocab - 1})")
        with self._tokenizer_lock:
            return {"prompt": str(self.tokenizer.decode(tokens))}

    def _parse(self, body: bytes) -> CompletionRequest:
        data = _json_object(body)
        unknown = sorted(set(data) - set(CompletionRequest.model_fields))
        if unknown:
            raise HTTPError(400, f"unknown fields: {', '.join(unknown)}")
        prompt = data.get("prompt")
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and any(isinstance(p, str) for p in prompt)
        ):
            raise HTTPError(400, "prompt is text: send token ids (a list of ints)")
        if isinstance(prompt, list) and any(isinstance(p, list) for p in prompt):
            raise HTTPError(400, "prompt is a batch: send one list of token ids per request")
        if not isinstance(prompt, list) or not prompt:
            raise HTTPError(400, "prompt must be a non-empty list of token ids")
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 0 for p in prompt):
            raise HTTPError(400, "prompt token ids must be non-negative integers")
        try:
            request = CompletionRequest.model_validate(data)
        except ValidationError as e:
            raise HTTPError(400, _validation_message(e)) from e
        if request.model is not None and request.model != self.model_name:
            raise HTTPError(404, f"The model `{request.model}` does not exist.")
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
            raise HTTPError(
                400,
                f"unsupported values for {', '.join(bad)} (this server does n=1, no stream, "
                "no echo, logprobs 0, and no top_k/min_p/repetition_penalty)",
            )
        # vLLM's rule: null means the room the context leaves; more than that is a 400.
        room = self.sampler.context_length - len(r.prompt)
        max_tokens = room if r.max_tokens is None else r.max_tokens
        if room < 1 or max_tokens > room:
            asked = max(max_tokens, 0)
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.sampler.context_length} tokens. "
                f"However, you requested {len(r.prompt) + asked} tokens ({len(r.prompt)} in "
                f"the prompt, {asked} in the completion). Please reduce the length of the "
                "prompt or completion.",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=r.temperature if r.temperature is not None else 1.0,
                top_p=r.top_p if r.top_p is not None else 1.0,
                stop_token_ids=tuple(r.stop_token_ids or ()),
                stop=(r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ()),
                seed=r.seed,
            )
        except ValidationError as e:
            raise HTTPError(400, _validation_message(e)) from e

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
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> tuple[CompletionServer, str]:
    """Start serving `sampler` in background threads; returns the server and its /v1 URL."""
    server = CompletionServer(
        sampler,
        tokenizer,
        host,
        port,
        model_name,
        request_timeout_s=request_timeout_s,
        read_timeout_s=read_timeout_s,
    )
    log.info("serving %s at %s", model_name, server.url)
    return server, server.url


# ---- agentrl serve's routes -----------------------------------------------------------


class _HTTPServer(QuietHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        app: CompletionServer,
        read_timeout_s: float,
    ) -> None:
        self.app = app
        super().__init__(address, handler, read_timeout_s)


class _Handler(JSONRequestHandler):
    server_version = "agentrl-serve"

    @property
    def app(self) -> CompletionServer:
        return cast(_HTTPServer, self.server).app

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/health":
            self.send_body(200, b"", None)
        elif path == "/v1/models":
            self._json(200, self.app.models())
        else:
            self._control("GET", b"")

    def handle_post(self, body: bytes) -> None:
        if urlsplit(self.path).path.rstrip("/") != "/v1/completions":
            self._control("POST", body)
            return
        try:
            payload, headers = self.app.complete(body, self.client_gone)
        except _ClientGone:
            self.close_connection = True
            log.debug("%s went away: its completion was cancelled", self.address_string())
        except HTTPError as e:
            self.reply_error(e.status, e.message)
        except Exception as e:  # the request boundary: one failed request, not a dead server
            log.exception("completion request failed")
            self.reply_error(500, f"{type(e).__name__}: {e}")
        else:
            self._json(200, payload, headers)

    def _control(self, method: str, body: bytes) -> None:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            payload = self.app.control(method, parts.path.rstrip("/"), query, body)
        except HTTPError as e:
            self.reply_error(e.status, e.message)
        except Exception as e:  # one failed control call, not a dead server
            log.exception("%s %s failed", method, parts.path)
            self.reply_error(500, f"{type(e).__name__}: {e}")
        else:
            self._json(200, payload)

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(payload).encode(), headers=headers)

    def reply_error(self, status: int, message: str) -> None:
        """vLLM's (OpenAI's) error body, with a one-line message."""
        kind = "InternalServerError" if status == 500 else HTTPStatus(status).phrase
        error = {
            "message": " ".join(message.splitlines()),
            "type": kind.replace(" ", "").removesuffix("Error") + "Error",
            "param": None,
            "code": status,
        }
        self._json(status, {"error": error})


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _json_object(body: bytes) -> dict[str, Any]:
    if not body.strip():
        return {}
    data = load_json(body)
    if not isinstance(data, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return data


def _version(value: object, field: str) -> int:
    try:
        version = int(str(value).removeprefix("v"))
    except ValueError:
        version = -1
    if version < 0:
        raise HTTPError(400, f"{field} must be a non-negative integer, got {value!r}")
    return version


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors(include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
