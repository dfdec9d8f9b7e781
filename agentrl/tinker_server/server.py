"""HTTP for `agentrl serve-tinker`: the Tinker API under /api/v1 on the stdlib
ThreadingHTTPServer (HTTP/1.1, keep-alive), with `agentrl serve`'s HTTP layer
(`QuietHTTPServer`, `JSONRequestHandler`: a deep listen backlog, a request that must
arrive within `read_timeout_s` of its first byte, quiet about clients that left). Binds
127.0.0.1 unless told otherwise.

Every answer has a Content-Length. Results are JSON, except the forward_backward and
sample results, which are protobuf. A body that is no request (not JSON, NaN, a wrong
type, too large, cut short) gets a 4xx with `{"detail": "<one line>"}` and
`x-should-retry: false` (the SDK raises at once); an unknown model 404; a closed
session 410. A failed *operation* is not an HTTP error:
its future answers `{"error", "category"}` and the SDK raises RequestFailedError.
retrieve_future holds the request up to LONG_POLL_S, then answers 408, on which the
SDK polls again at once. With an API key set, every route but healthz needs it in
X-API-Key.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError
from tinker import types

from agentrl.errors import ConfigError
from agentrl.inference.httpd import (
    READ_TIMEOUT_S,
    HTTPError,
    JSONRequestHandler,
    QuietHTTPServer,
    load_json,
)
from agentrl.tinker_server.service import ServiceConfig, TinkerService
from agentrl.tinker_server.wire import RequestError, UserError, decode_forward_backward

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LONG_POLL_S = 25.0  # below the SDK's 45 s read timeout for retrieve_future
MAX_BODY_BYTES = 64 << 20  # the SDK cuts forward_backward into ~5 MB chunks
PROTO = "application/x-protobuf"
PREFIX = "/api/v1/"

# Plain HTTP/1.1 transport, uncompressed protobuf: what this stdlib server speaks.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
}


def _constant(reply: dict[str, Any]) -> Callable[[TinkerService, Any], dict[str, Any]]:
    return lambda service, request: reply


# POST route -> (the SDK's request model, or None to accept any JSON; the handler)
_Route = tuple[type[BaseModel] | None, Callable[[TinkerService, Any], dict[str, Any]]]
_POST_ROUTES: dict[str, _Route] = {
    "client/config": (None, _constant(CLIENT_CONFIG)),
    "client/dynamic_config": (
        None,
        _constant({"refresh_interval_sec": 3600, "sample_cancel_enabled": False}),
    ),
    "create_session": (types.CreateSessionRequest, TinkerService.create_session),
    "session_heartbeat": (types.SessionHeartbeatRequest, TinkerService.heartbeat),
    "telemetry": (None, _constant({"status": "accepted"})),  # accepted and dropped
    "cancel_future": (None, _constant({})),  # sampling runs to the end here
    "create_model": (types.CreateModelRequest, TinkerService.create_model),
    "get_info": (types.GetInfoRequest, TinkerService.get_info),
    "load_weights": (types.LoadWeightsRequest, TinkerService.load_weights),
    "optim_step": (types.OptimStepRequest, TinkerService.optim_step),
    "save_weights": (types.SaveWeightsRequest, TinkerService.save_weights),
    "save_weights_for_sampler": (
        types.SaveWeightsForSamplerRequest,
        TinkerService.save_weights_for_sampler,
    ),
    "create_sampling_session": (
        types.CreateSamplingSessionRequest,
        TinkerService.create_sampling_session,
    ),
    "asample": (types.SampleRequest, TinkerService.asample),
}


class TinkerServer:
    """The running server: `url`, and an idempotent `close()` that also closes `service`."""

    def __init__(
        self,
        service: TinkerService,
        host: str,
        port: int,
        api_key: str | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.service = service
        self.api_key = api_key
        self._closed = threading.Event()
        try:
            self._httpd = _HTTPServer((host, port), _Handler, self, read_timeout_s)
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {host}:{port}: {e.strerror or e}; pick a free port with "
                "--port (0 picks one for you)"
            ) from e
        bound_host, bound_port = self._httpd.server_address[:2]
        self.url = f"http://{bound_host!s}:{bound_port}"
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tinker-http", daemon=True
        )
        self._thread.start()
        log.info("serving the Tinker API for %s at %s", service.config.name, self.url)

    def __enter__(self) -> TinkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, finish the running operation, release everything; safe twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)
        self.service.close()
        log.info("stopped")


class _HTTPServer(QuietHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        app: TinkerServer,
        read_timeout_s: float,
    ) -> None:
        self.app = app
        super().__init__(address, handler, read_timeout_s)


class _Handler(JSONRequestHandler):
    server_version = "agentrl-serve-tinker"
    timeout = 120  # an idle keep-alive connection frees its thread after this long
    max_body_bytes = MAX_BODY_BYTES

    @property
    def app(self) -> TinkerServer:
        return cast(_HTTPServer, self.server).app

    def do_GET(self) -> None:
        self._answer("GET", b"")

    def handle_post(self, body: bytes) -> None:
        self._answer("POST", body)

    def reply_error(self, status: int, message: str) -> None:
        """Tinker's error body: one line, and the SDK should not retry it."""
        detail = {"detail": " ".join(message.splitlines())}
        self._json(status, detail, {"x-should-retry": "false"})

    def _answer(self, method: str, body: bytes) -> None:
        path = urlsplit(self.path).path
        try:
            encoding = self.headers.get("Content-Encoding", "identity").lower()
            if method == "POST" and encoding != "identity":
                raise RequestError(f"Content-Encoding {encoding} is not supported: send it plain")
            if path != PREFIX + "healthz":
                self._authorize()
            self._route(
                method, path.removeprefix(PREFIX) if path.startswith(PREFIX) else None, body
            )
        except (RequestError, HTTPError) as e:
            self.reply_error(e.status, e.message)
        except UserError as e:
            self.reply_error(400, e.message)
        except Exception as e:  # the request boundary: one failed request, not a dead server
            log.exception("%s %s failed", method, path)
            self._json(500, {"detail": " ".join(f"{type(e).__name__}: {e}".splitlines())})

    def _route(self, method: str, route: str | None, body: bytes) -> None:
        service = self.app.service
        if method == "GET" and route == "healthz":
            self._json(200, {"status": "ok"})
        elif method == "GET" and route == "get_server_capabilities":
            self._json(200, service.capabilities())
        elif method == "GET" and route is not None and route.startswith("samplers/"):
            self._json(200, service.get_sampler(route.removeprefix("samplers/")))
        elif method == "POST" and route == "retrieve_future":
            self._retrieve(_validate(types.FutureRetrieveRequest, body))
        elif method == "POST" and route == "forward_backward":
            if not self.headers.get("Content-Type", "").startswith(PROTO):
                raise RequestError(f"forward_backward takes a protobuf body ({PROTO})")
            self._json(200, service.forward_backward(decode_forward_backward(body)))
        elif method == "POST" and route is not None and _is_finish(route):
            self._json(200, service.finish_session(route.split("/")[1]))
        elif method == "POST" and route in _POST_ROUTES:
            model, handler = _POST_ROUTES[route]
            request = _json(body) if model is None else _validate(model, body)
            self._json(200, handler(service, request))
        else:
            raise RequestError(f"no route {method} {self.path} in agentrl serve-tinker", 404)

    def _retrieve(self, request: types.FutureRetrieveRequest) -> None:
        future = self.app.service.futures.get(request.request_id)
        if future is None:
            raise RequestError(f"unknown request_id {request.request_id}", 404)
        if not future.wait(LONG_POLL_S):
            self._json(408, {"detail": "still running", "queue_state": "active"})
        elif future.error is not None:
            message, category = future.error
            self._json(200, {"error": message, "category": category})
        elif isinstance(future.result, bytes):
            self.send_body(200, future.result, PROTO)
        else:
            self._json(200, future.result or {})

    def _authorize(self) -> None:
        expected = self.app.api_key
        given = self.headers.get("X-API-Key") or ""
        if expected is not None and not hmac.compare_digest(given.encode(), expected.encode()):
            raise RequestError("wrong or missing X-API-Key", 401)

    def _json(self, status: int, payload: object, headers: dict[str, str] | None = None) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json", headers)


def _is_finish(route: str) -> bool:
    parts = route.split("/")
    return len(parts) == 3 and parts[0] == "sessions" and parts[2] == "finish"


def _json(body: bytes) -> object:
    return load_json(body) if body.strip() else {}


def _validate(model: type[BaseModel], body: bytes) -> Any:
    """The body as the SDK's request model; RequestError names the first bad field."""
    data = _json(body)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in err["loc"]) or "body"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise RequestError(f"{model.__name__}: {where}: {err['msg']}{more}") from e


EMBEDDED_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def serve(
    model: str = "embedded",
    *,
    name: str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    state_dir: Path | None = None,
    max_models: int = 2,
    keep_samplers: int = 2,
    api_key: str | None = None,
    read_timeout_s: float = READ_TIMEOUT_S,
) -> TinkerServer:
    """Start serving `model` (`embedded` or a transformers model folder) in background
    threads; learners and samplers are built when clients ask for them.

    `name` is the base_model clients ask for (default: SmolLM2's hub id for the embedded
    model, else the folder's name); `state_dir` is where save_state writes (default
    `<agentrl cache>/tinker-state`, so a restarted server finds its checkpoints).
    """
    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from agentrl.inference.embedded import cache_root

    hf_logging.disable_progress_bar()  # every sampling session loads the model folder

    if max_models < 1 or keep_samplers < 1:
        raise ConfigError("--max-models and --keep-samplers must be >= 1")
    model_dir = _model_dir(model)
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = _tokenizer(model_dir)
    eos = {*_ids(hf_config.eos_token_id), *_ids(tokenizer.eos_token_id if tokenizer else None)}
    pad = tokenizer.pad_token_id if tokenizer else None
    pad = pad if pad is not None else hf_config.pad_token_id
    config = ServiceConfig(
        model_dir=model_dir,
        name=name or (EMBEDDED_BASE_MODEL if model == "embedded" else model_dir.name),
        state_dir=(state_dir or cache_root() / "tinker-state").resolve(),
        max_models=max_models,
        keep_samplers=keep_samplers,
        arch=str(hf_config.model_type),
        context_length=int(hf_config.max_position_embeddings),
        tokenizer_dir=model_dir if tokenizer is not None else None,
    )
    cuda = torch.cuda.is_available()  # where FSDPBackend puts the learners
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    pad_id = int(pad if pad is not None else min(eos, default=0))  # any id: it is masked
    service = TinkerService(config, tokenizer, sorted(eos), pad_id, device)
    try:
        return TinkerServer(service, host, port, api_key, read_timeout_s)
    except BaseException:
        service.close()
        raise


def _model_dir(model: str) -> Path:
    if model == "embedded":
        from agentrl.inference.embedded import model_dir

        return model_dir()
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--model {model}: not a model folder (no config.json); pass `embedded` or a "
            "folder written by save_pretrained"
        )
    return path


def _tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, if it has one (stop strings and get_tokenizer need it)."""
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
