# Over 400 lines: the Tinker API's operations over one learner's state (futures, models, sampling).
"""The Tinker service behind the HTTP routes: client sessions, training models, sampling
sessions and checkpoints. Each route is one method taking the SDK's own request model
(or the decoded protobuf) and returning the JSON the SDK expects.

A training model is `"{session_id}:train:{model_seq_id}"` (the SDK computes that id
itself after create_training_client_from_state). Its operations run on the learner
thread in seq_id order; every one of them is a future. save_state writes under
--state-dir (`checkpoints`).

At most --max-models training models live at once. A client session that has sent
nothing (the SDK heartbeats every 10 s) for SESSION_TIMEOUT_S is gone: its models are
released when a new one needs the room, and at once when the client closes it.

One unit past 400 lines on purpose: sessions, training models and sampling sessions
share one lock and one lifecycle (closing a session releases its models and samplers;
a new model may reap silent sessions for room), so split apart they would hand that
state back and forth.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker import types

from agentrl.http import HTTPError
from agentrl.tinker_server.checkpoints import StateDir
from agentrl.tinker_server.futures import Future, Futures, Job, Sequencer, Worker
from agentrl.tinker_server.learner import TinkerLearner, parse_loss
from agentrl.tinker_server.sampling import Samplers
from agentrl.tinker_server.wire import (
    ForwardBackwardRequest,
    UserError,
    datums,
    encode_forward_backward_output,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SESSION_TIMEOUT_S = 60.0
MAX_NUM_SAMPLES = 1024  # per sample request: each one is a row in the sampler's queue
MAX_LORA_RANK = 1024  # beyond any useful adapter; a huge rank would exhaust memory


@dataclass(frozen=True)
class ServiceConfig:
    """What `agentrl serve-tinker` serves, and its limits."""

    model_dir: Path  # a transformers model folder
    name: str  # the base_model name clients ask for
    state_dir: Path  # where save_state writes
    max_models: int = 2
    keep_samplers: int = 2
    arch: str = "llama"
    context_length: int = 2048
    tokenizer_dir: Path | None = None  # reported as tokenizer_id when set


@dataclass
class _Session:
    last_seen: float = field(default_factory=time.monotonic)
    models: set[str] = field(default_factory=set)


@dataclass
class _Model:
    id: str
    session_id: str
    lora: types.LoraConfig | None
    sequencer: Sequencer
    learner: TinkerLearner | None = None
    gone: str | None = None  # why it can no longer train (release, failed creation)


class TinkerService:
    """Sessions, models and sampling sessions of one server process."""

    def __init__(
        self,
        config: ServiceConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        eos_ids: list[int],
        pad_id: int,
        device: torch.device,
    ) -> None:
        self.config = config
        self.futures = Futures()
        self.state = StateDir(config.state_dir)
        self.worker = Worker()
        self.samplers = Samplers(
            config.model_dir, tokenizer, eos_ids, pad_id, config.keep_samplers, device
        )
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}
        self._models: dict[str, _Model] = {}

    def close(self, timeout: float = 60.0) -> None:
        """Let the running operation finish (a checkpoint is never left half-written
        anyway), fail the rest, release every model and sampler."""
        idle = self.worker.close(timeout)
        self.futures.fail_unfinished("the server shut down before this request finished")
        self.samplers.close()
        if not idle:
            log.warning("the learner was still busy after %.0f s; exiting without it", timeout)
            return
        with self._lock:
            models, self._models = list(self._models.values()), {}
        for model in models:
            if model.learner is not None:
                model.learner.close()

    # ---- sessions ---------------------------------------------------------------------

    def create_session(self, req: types.CreateSessionRequest) -> dict[str, Any]:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._sessions[session_id] = _Session()
        log.info("session %s created (sdk %s)", session_id, req.sdk_version)
        return {"type": "create_session", "session_id": session_id}

    def heartbeat(self, req: types.SessionHeartbeatRequest) -> dict[str, Any]:
        self._touch(req.session_id)
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str) -> dict[str, Any]:
        with self._lock:
            session = self._sessions.pop(session_id, None)
            models = (
                [self._models[m] for m in session.models if m in self._models] if session else []
            )
        for model in models:
            self._release(model, f"its session {session_id} was closed")
        self.samplers.release_owner(f"{session_id}:base")
        log.info("session %s finished", session_id)
        return {}

    def _touch(self, session_id: str) -> _Session:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise HTTPError(
                    410, f"unknown session {session_id} (closed, or the server restarted)"
                )
            session.last_seen = time.monotonic()
            return session

    # ---- models -----------------------------------------------------------------------

    def create_model(self, req: types.CreateModelRequest) -> dict[str, Any]:
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        self._touch(req.session_id)
        future, new = self.futures.create("create_model", (model_id, 0))
        if new:
            try:
                self._check_base_model(req.base_model)
                _check_adamw(req.optimizer_config)
                lora = req.lora_config if req.lora_config and req.lora_config.rank > 0 else None
                if lora is not None and lora.rank > MAX_LORA_RANK:
                    raise UserError(f"lora rank {lora.rank} is above {MAX_LORA_RANK}")
                model = self._add_model(model_id, req.session_id, lora)
            except UserError as e:
                future.fail(str(e))
            else:
                reply = {"type": "create_model", "model_id": model_id}
                self.worker.put(future, lambda: self._build(model, None, reply))
        return {"request_id": future.request_id, "model_id": model_id}

    def load_weights(self, req: types.LoadWeightsRequest) -> dict[str, Any]:
        """create_training_client_from_state[_with_optimizer]: a new model, loaded; or
        (legacy addressing, model_id + seq_id) a load into an existing model."""
        if req.model_id is not None:
            model = self._model(req.model_id)
            return self._submit(model, req.seq_id, "load_weights", lambda: self._load(model, req))
        if req.session_id is None or req.model_seq_id is None:
            raise HTTPError(400, "load_weights needs session_id and model_seq_id (or model_id)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        self._touch(req.session_id)
        future, new = self.futures.create("load_weights", (model_id, 0))
        if new:
            try:
                path, meta = self.state.find(req.path)
                self._check_base_model(req.base_model or meta["base_model"])
                _check_adamw(req.optimizer_config)
                lora = types.LoraConfig.model_validate(meta["lora"]) if meta["lora"] else None
                model = self._add_model(model_id, req.session_id, lora)
            except UserError as e:
                future.fail(str(e))
            else:
                reply = {"type": "load_weights", "path": req.path, "model_id": model_id}
                load = (path, req.optimizer)
                self.worker.put(future, lambda: self._build(model, load, reply))
        return {"request_id": future.request_id, "model_id": model_id}

    def get_info(self, req: types.GetInfoRequest) -> dict[str, Any]:
        model = self._model(req.model_id)
        tokenizer = self.config.tokenizer_dir
        return {
            "type": "get_info",
            "model_id": model.id,
            "model_data": {
                "arch": self.config.arch,
                "model_name": self.config.name,
                "tokenizer_id": str(tokenizer) if tokenizer else self.config.name,
            },
            "is_lora": model.lora is not None,
            "lora_rank": model.lora.rank if model.lora else None,
        }

    def forward_backward(self, req: ForwardBackwardRequest) -> dict[str, Any]:
        model = self._model(req.model_id)
        kind = "forward" if req.forward_only else "forward_backward"

        def job() -> bytes:
            loss = parse_loss(req.loss_fn, req.loss_fn_config)
            data = datums(req.data)
            start = time.perf_counter()
            out = self._learner(model).forward_backward(data, loss, backward=not req.forward_only)
            log.info(
                "%s %s seq %d: %s over %d datums, %d tokens, loss:sum %.6g (%.2f s)",
                kind,
                model.id,
                req.seq_id,
                req.loss_fn,
                len(data),
                sum(len(d.tokens) for d in data),
                out.loss_sum,
                time.perf_counter() - start,
            )
            metrics = {"loss:sum": out.loss_sum}
            return encode_forward_backward_output(out.logprobs_D, out.losses_D, metrics)

        return self._submit(model, req.seq_id, kind, job)

    def optim_step(self, req: types.OptimStepRequest) -> dict[str, Any]:
        model = self._model(req.model_id)
        params = req.optim_params

        def job() -> dict[str, Any]:
            if not isinstance(params, types.AdamParams):
                raise UserError("optim_step takes AdamParams only (the optimizer is adamw)")
            learner = self._learner(model)
            metrics = learner.optim_step(params)
            log.info(
                "optim_step %s seq %d: step %d, lr %g, grad_norm %.4g",
                model.id,
                req.seq_id,
                learner.step,
                params.learning_rate,
                metrics["grad_norm:mean"],
            )
            return {"metrics": metrics}

        return self._submit(model, req.seq_id, "optim_step", job)

    def save_weights(self, req: types.SaveWeightsRequest) -> dict[str, Any]:
        model = self._model(req.model_id)

        def job() -> dict[str, Any]:
            learner = self._learner(model)
            extra = {
                "base_model": self.config.name,
                "lora": model.lora.model_dump() if model.lora else None,
                "user_metadata": req.user_metadata,
            }
            name = req.path or f"step-{learner.step}"
            path, saved = self.state.save(learner, model.id, name, extra, overwrite=req.overwrite)
            log.info("save_state %s -> %s (%s)", model.id, path, saved)
            return {"type": "save_weights", "path": path}

        return self._submit(model, req.seq_id, "save_weights", job)

    def save_weights_for_sampler(self, req: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        model = self._model(req.model_id)

        def job() -> dict[str, Any]:
            if req.path is not None or req.sampling_session_seq_id is None:
                raise UserError(
                    "named sampler weights (save_weights_for_sampler(name)) are not supported "
                    "by this server: use save_weights_and_get_sampling_client()"
                )
            learner = self._learner(model)
            sampler = self.samplers.new_sampler(untie=bool(model.lora and model.lora.train_unembed))
            learner.publish(sampler)
            session_id = f"{model.session_id}:sample:{req.sampling_session_seq_id}"
            self.samplers.add(session_id, model.id, sampler)
            return {"type": "save_weights_for_sampler", "sampling_session_id": session_id}

        return self._submit(model, req.seq_id, "save_weights_for_sampler", job)

    # ---- sampling ---------------------------------------------------------------------

    def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> dict[str, Any]:
        self._touch(req.session_id)
        if req.model_path is not None or req.base_model is None:
            raise HTTPError(
                400,
                "this server samples the base model (create_sampling_client(base_model=...)) "
                "or a training client's weights (save_weights_and_get_sampling_client()); "
                "sampling a saved path is not supported",
            )
        self._check_base_model(req.base_model)  # a UserError here is a 400
        session_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        self.samplers.add(session_id, f"{req.session_id}:base", self.samplers.new_sampler())
        return {"type": "create_sampling_session", "sampling_session_id": session_id}

    def get_sampler(self, session_id: str) -> dict[str, Any]:
        try:
            self.samplers.owner(session_id)
        except UserError as e:
            raise HTTPError(404, str(e)) from e
        return {"sampler_id": session_id, "base_model": self.config.name, "model_path": None}

    def asample(self, req: types.SampleRequest) -> dict[str, Any]:
        if not 1 <= req.num_samples <= MAX_NUM_SAMPLES:
            raise HTTPError(400, f"num_samples must be 1..{MAX_NUM_SAMPLES}, got {req.num_samples}")
        key = None
        if req.sampling_session_id is not None and req.seq_id is not None:
            key = (req.sampling_session_id, req.seq_id)
        future, new = self.futures.create("sample", key)
        if new:
            self.samplers.submit(future, req)
        ids = [f"{future.request_id}:{i}" for i in range(req.num_samples)]
        return {"request_id": future.request_id, "sample_sequence_ids": ids}

    def capabilities(self) -> dict[str, Any]:
        model = {
            "model_name": self.config.name,
            "max_context_length": self.config.context_length,
            "trainable": True,
            "sampleable": True,
        }
        return {"supported_models": [model]}

    # ---- plumbing ---------------------------------------------------------------------

    def _submit(self, model: _Model, seq_id: int | None, kind: str, job: Job) -> dict[str, Any]:
        if seq_id is None or seq_id < 1:
            raise HTTPError(400, f"{kind} needs a seq_id >= 1, got {seq_id}")
        self._touch(model.session_id)
        future, new = self.futures.create(kind, (model.id, seq_id))
        if new:
            model.sequencer.submit(seq_id, future, job)
        return {"request_id": future.request_id, "model_id": model.id}

    def _model(self, model_id: str) -> _Model:
        with self._lock:
            model = self._models.get(model_id)
        if model is None:
            raise HTTPError(404, f"unknown model {model_id} (never created, or released)")
        return model

    def _learner(self, model: _Model) -> TinkerLearner:
        if model.learner is None:
            raise UserError(f"model {model.id} cannot train: {model.gone or 'not built yet'}")
        return model.learner

    def _add_model(self, model_id: str, session_id: str, lora: types.LoraConfig | None) -> _Model:
        """Register a model (its slot counts at once), releasing dead sessions for room."""
        self._reap_if_full()
        with self._lock:
            if len(self._models) >= self.config.max_models:
                raise UserError(
                    f"this server holds at most {self.config.max_models} training models "
                    "(--max-models); close clients you are done with (service.close())"
                )
            model = _Model(model_id, session_id, lora, Sequencer(self.worker))
            self._models[model_id] = model
            self._sessions.setdefault(session_id, _Session()).models.add(model_id)
        return model

    def _build(
        self, model: _Model, load: tuple[Path, bool] | None, reply: dict[str, Any]
    ) -> dict[str, Any]:
        """On the learner thread: build the model's learner, loading `load` if given."""
        start = time.perf_counter()
        try:
            learner = TinkerLearner(self.config.model_dir, model.lora)
            if load is not None:
                learner.load(load[0], optimizer=load[1])
        except Exception as e:
            self._release(model, f"it could not be created: {e}")
            raise
        model.learner = learner
        what = f"LoRA rank {model.lora.rank}" if model.lora else "full weights"
        source = f", loaded from {load[0]}" if load else ""
        log.info(
            "model %s ready (%s%s) in %.1f s",
            model.id,
            what,
            source,
            time.perf_counter() - start,
        )
        return reply

    def _load(self, model: _Model, req: types.LoadWeightsRequest) -> dict[str, Any]:
        path, meta = self.state.find(req.path)
        lora = meta["lora"]
        if lora != (model.lora.model_dump() if model.lora else None):
            raise UserError(f"{req.path} was saved with lora_config {lora}, unlike {model.id}")
        self._learner(model).load(path, optimizer=req.optimizer)
        return {"type": "load_weights", "path": req.path, "model_id": model.id}

    def _release(self, model: _Model, why: str) -> None:
        """Forget `model`: fail what waits for it, close it on the learner thread."""
        with self._lock:
            self._models.pop(model.id, None)
            session = self._sessions.get(model.session_id)
            if session is not None:
                session.models.discard(model.id)
        model.gone = why
        model.sequencer.fail_waiting(f"model {model.id} was released: {why}")
        self.samplers.release_owner(model.id)

        def close() -> dict[str, Any]:
            learner, model.learner = model.learner, None
            if learner is not None:
                learner.close()
                log.info("model %s released: %s", model.id, why)
            return {}

        self.worker.put(Future("release"), close)

    def _reap_if_full(self) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._models) < self.config.max_models:
                return
            dead = [
                sid for sid, s in self._sessions.items() if now - s.last_seen > SESSION_TIMEOUT_S
            ]
        for session_id in dead:
            log.info("session %s silent for %.0f s: releasing it", session_id, SESSION_TIMEOUT_S)
            self.finish_session(session_id)

    def _check_base_model(self, base_model: str) -> None:
        if base_model != self.config.name:
            raise UserError(
                f"this server serves base model {self.config.name!r}, not {base_model!r}"
            )


def _check_adamw(config: types.OptimizerConfig | None) -> None:
    if config is not None and config.type != "adamw":
        raise UserError(f"optimizer {config.type} is not supported by this server: only adamw")
