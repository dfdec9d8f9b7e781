"""HTTP for `agentrl serve-tinker`: the Tinker API under /api/v1 on `agentrl serve`'s
HTTP layer (`agentrl.http`: stdlib, HTTP/1.1 keep-alive, a deep listen
backlog, a request that must arrive within `read_timeout_s` of its first byte, quiet
about clients that left). Binds 127.0.0.1 unless told otherwise.

Every answer has a Content-Length. Each JSON route's body is validated into the SDK's
own request model. Results are JSON, except the forward_backward and sample results,
which are protobuf. A body that is no request (not JSON, NaN, a wrong type, too large,
cut short) gets a 4xx with `{"detail": "<one line>"}` and `x-should-retry: false` (the
SDK raises at once); an unknown model 404; a closed session 410. A failed *operation*
is not an HTTP error: its future answers `{"error", "category"}` and the SDK raises
RequestFailedError. retrieve_future holds the request up to LONG_POLL_S, then answers
408, on which the SDK polls again at once. With an API key set, every route but
healthz needs it in X-API-Key.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from agentrl.errors import ConfigError
from agentrl.http import (
    READ_TIMEOUT_S,
    App,
    HTTPError,
    Listener,
    Request,
    Response,
    Route,
    json_response,
)

if TYPE_CHECKING:
    from tinker import types
    from transformers import PreTrainedTokenizerBase

    from agentrl.tinker_server.service import TinkerService

log = logging.getLogger(__name__)

LONG_POLL_S = 25.0  # below the SDK's 45 s read timeout for retrieve_future
MAX_BODY_BYTES = 64 << 20  # the SDK cuts forward_backward into ~5 MB chunks
PROTO = "application/x-protobuf"
PREFIX = "/api/v1"

# Plain HTTP/1.1 transport, uncompressed protobuf: what this stdlib server speaks.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
}


class TinkerServer(App):
    """The running server: `url`, and an idempotent `close()` that also closes `service`."""

    name = "agentrl-serve-tinker"
    max_body_bytes = MAX_BODY_BYTES
    idle_timeout_s = 120.0

    def __init__(
        self,
        service: TinkerService,
        host: str,
        port: int,
        api_key: str | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        from tinker import types

        super().__init__()
        self.service = service
        self.api_key = api_key
        self._closed = False
        s = service

        def call(method: Any, model: type[BaseModel]) -> Route:
            return Route(lambda request, body: method(body), model)

        def constant(reply: dict[str, Any]) -> Route:
            return Route(lambda request, body: reply)

        post: dict[str, Route] = {
            "client/config": constant(CLIENT_CONFIG),
            "client/dynamic_config": constant(
                {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}
            ),
            "telemetry": constant({"status": "accepted"}),  # accepted and dropped
            "cancel_future": constant({}),  # sampling runs to the end here
            "create_session": call(s.create_session, types.CreateSessionRequest),
            "session_heartbeat": call(s.heartbeat, types.SessionHeartbeatRequest),
            "sessions/{id}/finish": Route(lambda r, _: s.finish_session(r.params["id"])),
            "create_model": call(s.create_model, types.CreateModelRequest),
            "get_info": call(s.get_info, types.GetInfoRequest),
            "forward_backward": Route(self._forward_backward),
            "optim_step": call(s.optim_step, types.OptimStepRequest),
            "load_weights": call(s.load_weights, types.LoadWeightsRequest),
            "save_weights": call(s.save_weights, types.SaveWeightsRequest),
            "save_weights_for_sampler": call(
                s.save_weights_for_sampler, types.SaveWeightsForSamplerRequest
            ),
            "create_sampling_session": call(
                s.create_sampling_session, types.CreateSamplingSessionRequest
            ),
            "asample": call(s.asample, types.SampleRequest),
            "retrieve_future": Route(self._retrieve, types.FutureRetrieveRequest),
        }
        get: dict[str, Route] = {
            "healthz": Route(lambda r, _: {"status": "ok"}),
            "get_server_capabilities": Route(lambda r, _: s.capabilities()),
            "samplers/{id}": Route(lambda r, _: s.get_sampler(r.params["id"])),
        }
        self.routes = {
            **{("POST", f"{PREFIX}/{path}"): route for path, route in post.items()},
            **{("GET", f"{PREFIX}/{path}"): route for path, route in get.items()},
        }
        self._listener = Listener(self, host, port, read_timeout_s)
        self.url = self._listener.url
        log.info("serving the Tinker API for %s at %s", service.config.name, self.url)

    def __enter__(self) -> TinkerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, finish the running operation, release everything; safe twice."""
        if self._closed:
            return
        self._closed = True
        self._listener.close()
        self.service.close()
        log.info("stopped")

    def error(self, status: int, message: str) -> Response:
        """Tinker's error body; below 500 the SDK should not retry it."""
        headers = {"x-should-retry": "false"} if status < 500 else {}
        return json_response({"detail": message}, status, headers)

    def before(self, request: Request) -> None:
        encoding = request.headers.get("Content-Encoding", "identity").lower()
        if request.method == "POST" and encoding != "identity":
            raise HTTPError(400, f"Content-Encoding {encoding} is not supported: send it plain")
        if request.path != f"{PREFIX}/healthz" and self.api_key is not None:
            given = request.headers.get("X-API-Key") or ""
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise HTTPError(401, "wrong or missing X-API-Key")

    def _forward_backward(self, request: Request, _: None) -> object:
        from agentrl.tinker_server.wire import decode_forward_backward

        if not request.headers.get("Content-Type", "").startswith(PROTO):
            raise HTTPError(400, f"forward_backward takes a protobuf body ({PROTO})")
        return self.service.forward_backward(decode_forward_backward(request.body))

    def _retrieve(self, request: Request, body: types.FutureRetrieveRequest) -> object:
        future = self.service.futures.get(body.request_id)
        if future is None:
            raise HTTPError(404, f"unknown request_id {body.request_id}")
        if not future.wait(LONG_POLL_S):
            return json_response({"detail": "still running", "queue_state": "active"}, 408)
        if future.error is not None:
            message, category = future.error
            return {"error": message, "category": category}
        if isinstance(future.result, bytes):
            return Response(200, future.result, PROTO)
        return future.result or {}


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
    if max_models < 1 or keep_samplers < 1:
        raise ConfigError("--max-models and --keep-samplers must be >= 1")
    model_dir = _model_dir(model)  # before the heavy imports: a bad --model fails at once

    import torch
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from agentrl.cache import cache_root
    from agentrl.tinker_server.service import ServiceConfig, TinkerService

    hf_logging.disable_progress_bar()  # every sampling session loads the model folder
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
