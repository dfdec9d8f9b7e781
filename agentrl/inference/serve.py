"""A small vLLM-compatible server over the local sampler, from the stdlib alone.

It speaks the part of vLLM's API that agentrl uses, so the HTTP path, the router and
weight publication run here without a GPU:

- `POST /v1/completions`: token ids in, `token_ids` + `logprobs.token_logprobs` out
  (`vllm_api.py`). The policy version travels in the `x-agentrl-policy-version`
  header, and each sampled token's version in `choices[0].token_versions` (an agentrl
  extension: vLLM sends neither). `GET /v1/models`, `GET /health`, `POST /tokenize`,
  `POST /detokenize`.
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

Each route's request is a pydantic model, validated by the HTTP layer
(`agentrl.http`, shared with every agentrl server). Requests arrive on
server threads; each hands its generate() to one asyncio loop in a background thread
that owns the sampler, so concurrent requests reach a LocalSampler together, which
batches them continuously. Binds to 127.0.0.1 unless told otherwise.

Limits. `max_tokens` is vLLM's: omitted, 16; null, the room the context leaves after
the prompt; more than fits is a 400. A completion is cancelled (its row leaves the
batch at the next step) when its client disconnects, or when it runs past
`request_timeout_s` (then 504). Every request must arrive whole within
`read_timeout_s` of its first byte (else 408). An error is a 4xx (5xx: a bug) with
vLLM's body, `{"error": {"message": <one line>, "type", "param", "code"}}`; NaN and
Infinity are not JSON here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from agentrl.http import (
    READ_TIMEOUT_S,
    App,
    HTTPError,
    Listener,
    Request,
    Response,
    Route,
    json_response,
    wait_while_connected,
)
from agentrl.inference.embedded import EMBEDDED_NAME
from agentrl.inference.openai import POLICY_VERSION_HEADER
from agentrl.inference.vllm_api import (
    CollectiveRPC,
    CompletionRequest,
    Detokenize,
    FinishUpdate,
    InitTransfer,
    NewVersion,
    PauseQuery,
    SleepQuery,
    Tokenize,
    UpdateWeights,
    completion_body,
    sampling_params,
)
from agentrl.inference.weight_transfer import GlooReceiver

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from agentrl.inference.local import LocalSampler

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0  # a completion running longer is cancelled (the router's timeout)


class CompletionServer(App):
    """The running server: `url` (…/v1), and an idempotent `close()` (the sampler stays
    open)."""

    name = "agentrl-serve"

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
        super().__init__()
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
        self.routes = {
            ("GET", "/health"): Route(lambda r, _: Response(200, b"", None)),
            ("GET", "/v1/models"): Route(self._models),
            ("POST", "/v1/completions"): Route(self._complete, CompletionRequest),
            ("POST", "/tokenize"): Route(self._tokenize, Tokenize),
            ("POST", "/detokenize"): Route(self._detokenize, Detokenize),
        }
        control: dict[tuple[str, str], Route] = {
            ("POST", "/pause"): Route(self._pause, PauseQuery, from_query=True),
            ("POST", "/resume"): Route(self._resume),
            ("GET", "/is_paused"): Route(lambda r, _: {"is_paused": self.sampler.is_paused}),
            ("POST", "/sleep"): Route(self._sleep, SleepQuery, from_query=True),
            ("POST", "/wake_up"): Route(self._wake_up),
            ("GET", "/is_sleeping"): Route(lambda r, _: {"is_sleeping": self._sleeping}),
            # token_versions: this server stamps each token (pause mode keep is exact).
            ("GET", "/weight_info"): Route(
                lambda r, _: {
                    "weight_version": str(self.sampler.policy_version),
                    "token_versions": True,
                }
            ),
            ("POST", "/update_weight_version"): Route(self._update_weight_version, NewVersion),
            ("POST", "/collective_rpc"): Route(self._collective_rpc, CollectiveRPC),
            ("GET", "/get_world_size"): Route(lambda r, _: {"world_size": 1}),
            ("POST", "/init_weight_transfer_engine"): Route(self._init_transfer, InitTransfer),
            ("POST", "/start_weight_update"): Route(self._start_update),
            ("POST", "/update_weights"): Route(self._update_weights, UpdateWeights),
            ("POST", "/finish_weight_update"): Route(self._finish_update, FinishUpdate),
            # vLLM's route; this server caches no prefixes across requests: nothing to drop.
            ("POST", "/reset_prefix_cache"): Route(lambda r, _: {"reset": True}),
        }
        for key, route in control.items():
            self.routes[key] = replace(route, handler=self._one_at_a_time(route.handler))
        self._listener = Listener(self, host, port, read_timeout_s)
        self.url = f"{self._listener.url}/v1"
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self.loop.run_forever, name="agentrl-serve-loop", daemon=True
        )
        self._loop_thread.start()

    def __enter__(self) -> CompletionServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting, fail in-flight requests with 503, stop the loop; safe twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._listener.close()
        cancel = asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self.loop)
        cancel.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)
        if not self._loop_thread.is_alive():
            self.loop.close()

    def error(self, status: int, message: str) -> Response:
        """vLLM's (OpenAI's) error body."""
        kind = "InternalServerError" if status == 500 else HTTPStatus(status).phrase
        error = {
            "message": message,
            "type": kind.replace(" ", "").removesuffix("Error") + "Error",
            "param": None,
            "code": status,
        }
        return json_response({"error": error}, status)

    # ---- completions --------------------------------------------------------------------

    def _models(self, request: Request, _: None) -> object:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "agentrl",
            "root": self.model_name,
        }
        return {"object": "list", "data": [model]}

    def _complete(self, request: Request, body: CompletionRequest) -> Response:
        """One completion. While it runs, a client that left, or a request past
        `request_timeout_s`, cancels the generation (its row leaves the batch)."""
        if body.model is not None and body.model != self.model_name:
            raise HTTPError(404, f"The model `{body.model}` does not exist.")
        params = sampling_params(body, self.sampler.context_length)
        if self._closed.is_set():
            raise HTTPError(503, "the server is shutting down")
        future = asyncio.run_coroutine_threadsafe(
            self.sampler.generate(body.prompt, params), self.loop
        )
        try:
            completion = wait_while_connected(request, future, timeout=self.request_timeout_s)
        except concurrent.futures.CancelledError:
            raise HTTPError(503, "the server shut down before this request finished") from None
        except TimeoutError:
            raise HTTPError(
                504, f"the completion ran past this server's {self.request_timeout_s:g} s limit"
            ) from None
        with self._tokenizer_lock:
            answer = completion_body(body, completion, self.tokenizer, self.model_name)
        return json_response(
            answer, headers={POLICY_VERSION_HEADER: str(completion.policy_version)}
        )

    def _tokenize(self, request: Request, body: Tokenize) -> object:
        with self._tokenizer_lock:
            if body.messages is not None:
                try:
                    text = self.tokenizer.apply_chat_template(
                        body.messages,
                        add_generation_prompt=body.add_generation_prompt,
                        tokenize=False,
                    )
                except Exception as e:  # whatever the template trips over is in the messages
                    message = f"the chat template cannot render these messages: {e}"
                    raise HTTPError(400, message) from e
                ids = self.tokenizer.encode(str(text), add_special_tokens=False)
            elif body.prompt is not None:
                ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                raise HTTPError(400, "tokenize needs prompt (text) or messages")
            tokens = [int(t) for t in ids]
            strs = self.tokenizer.convert_ids_to_tokens(tokens)
        return {
            "count": len(tokens),
            "max_model_len": self.sampler.context_length,
            "tokens": tokens,
            "token_strs": strs,
        }

    def _detokenize(self, request: Request, body: Detokenize) -> object:
        vocab = len(self.tokenizer)
        if not all(0 <= t < vocab for t in body.tokens):
            raise HTTPError(400, f"detokenize needs tokens (a list of ints in 0..{vocab - 1})")
        with self._tokenizer_lock:
            return {"prompt": str(self.tokenizer.decode(body.tokens))}

    # ---- control: vLLM's dev-mode routes ------------------------------------------------

    def _one_at_a_time(self, handler: Callable[[Request, Any], object]) -> Callable[..., object]:
        def locked(request: Request, body: Any) -> object:
            with self._control:
                return handler(request, body)

        return locked

    def _pause(self, request: Request, query: PauseQuery) -> object:
        self.sampler.pause(query.mode)
        return {"status": "paused"}

    def _resume(self, request: Request, _: None) -> object:
        if self._sleeping:
            raise HTTPError(409, "the server is asleep: POST /wake_up")
        self.sampler.resume()
        return {"status": "resumed"}

    def _sleep(self, request: Request, query: SleepQuery) -> object:
        if query.level != "1":
            raise HTTPError(
                400, "agentrl serve sleeps at level 1 only (the weights stay in CPU memory)"
            )
        self.sampler.pause(query.mode)
        self._sleeping = True
        return {"status": "sleeping"}

    def _wake_up(self, request: Request, _: None) -> object:
        self._sleeping = False
        self.sampler.resume()
        return {"status": "awake"}

    def _update_weight_version(self, request: Request, body: NewVersion) -> object:
        if body.new_version is None:
            raise HTTPError(400, "new_version: must be a non-negative integer, got None")
        self._require_paused("set the weight version")
        self.sampler.set_policy_version(body.new_version)
        return {"success": True, "new_version": str(body.new_version)}

    def _collective_rpc(self, request: Request, body: CollectiveRPC) -> object:
        if body.method != "reload_weights":
            raise HTTPError(400, f"collective_rpc: only method reload_weights, not {body.method!r}")
        path = (body.kwargs or {}).get("weights_path")
        if not isinstance(path, str):
            raise HTTPError(400, "reload_weights needs kwargs.weights_path (a folder)")
        self._require_paused("reload weights")
        # The version stays until /update_weight_version: nothing samples while paused.
        self.sampler.load_weights(path, self.sampler.policy_version)
        return {"results": [None]}

    def _init_transfer(self, request: Request, body: InitTransfer) -> object:
        self._receiver.init(body.init_info)
        return {"message": "Weight transfer initialized"}

    def _start_update(self, request: Request, _: None) -> object:
        self._require_paused("start a weight update")
        self._incoming = {}
        return {"message": "Weight update started"}

    def _update_weights(self, request: Request, body: UpdateWeights) -> object:
        if self._incoming is None:
            raise HTTPError(409, "no weight update under way: POST /start_weight_update")
        self._incoming.update(self._receiver.receive(body.update_info))
        return {"message": "Weights updated"}

    def _finish_update(self, request: Request, body: FinishUpdate) -> object:
        if self._incoming is None:
            raise HTTPError(409, "no weight update under way: POST /start_weight_update")
        incoming, self._incoming = self._incoming, None
        version = body.weight_version
        self._require_paused("finish a weight update")
        # All or nothing: update_weights checks every name.
        self.sampler.update_weights(
            incoming, self.sampler.policy_version + 1 if version is None else version
        )
        return {"message": "Weight update finished"}

    def _require_paused(self, what: str) -> None:
        if not self.sampler.is_paused:
            raise HTTPError(
                409, f"cannot {what} while generating: POST /pause first (then /resume)"
            )


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


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
