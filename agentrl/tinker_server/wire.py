"""The protobuf payloads of the Tinker protocol, and the two ways a request can be wrong.

Three payloads travel as protobuf (`tinker.proto.tinker_public_pb2`, the SDK's own
schema): the forward_backward request, and the forward_backward and sample results.
Every other body is JSON, validated with the SDK's pydantic request models.

A body that is not a request at all (no model id, not protobuf) is an `HTTPError`:
answered at once, 400 unless its `status` says otherwise. A request that is well formed
but asks for something this server cannot do is a `UserError`: its future fails with
category "user", which the SDK raises as `RequestFailedError` without retrying; the
model's later requests still run (raised while answering the request itself, it is a
400).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from agentrl.errors import AgentRLError
from agentrl.http import HTTPError

_DTYPES: dict[int, np.dtype[Any]] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT32: np.dtype("<i4"),
}


class UserError(AgentRLError, ValueError):
    """A request this server cannot carry out; its future fails with category user."""


@dataclass(frozen=True)
class Datum:
    """One training example: the model's input tokens and its per-token loss inputs."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]  # name -> 1-D array aligned with tokens


@dataclass(frozen=True)
class ForwardBackwardRequest:
    """A decoded /forward_backward body; `data` stays raw until the learner reads it."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: Sequence[pb.Datum]


@dataclass(frozen=True)
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]


def decode_forward_backward(body: bytes) -> ForwardBackwardRequest:
    """Parse a protobuf ForwardBackwardRequest; HTTPError 400 when it names no model op."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise HTTPError(400, f"the body is not a protobuf ForwardBackwardRequest: {e}") from e
    if not msg.model_id:
        raise HTTPError(400, "ForwardBackwardRequest has no model_id")
    if msg.seq_id < 1:
        raise HTTPError(400, f"ForwardBackwardRequest seq_id must be >= 1, got {msg.seq_id}")
    config: dict[str, float | str] = dict(msg.loss_fn_config)
    for key, value in msg.loss_fn_config_v2.items():  # preferred: it also carries text
        kind = value.WhichOneof("value")
        config[key] = value.text if kind == "text" else value.number
    return ForwardBackwardRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=list(msg.data),
    )


def datums(raw: Sequence[pb.Datum]) -> list[Datum]:
    """Token-only datums with 1-D loss inputs; UserError names the first that is not."""
    if not raw:
        raise UserError("forward_backward got no data")
    out = []
    for i, d in enumerate(raw):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise UserError(
                    f"datum {i}: model_input has a {kind} chunk; this server trains on "
                    "token chunks (EncodedTextChunk) only"
                )
            tokens += np.frombuffer(chunk.encoded_text.tokens, dtype="<i4").tolist()
        inputs = {name: _tensor(i, name, t) for name, t in d.loss_fn_inputs.items()}
        out.append(Datum(tokens=tokens, inputs=inputs))
    return out


def _tensor(i: int, name: str, t: pb.Tensor) -> np.ndarray:
    where = f"datum {i}: loss_fn_inputs[{name!r}]"
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise UserError(f"{where} has dtype {pb.DType.Name(t.dtype)}; send float32 or int64")
    if t.WhichOneof("encoding") != "dense":
        raise UserError(f"{where} is not dense; this server reads 1-D dense tensors only")
    values = np.frombuffer(t.dense, dtype=dtype)
    if len(t.shape) > 1 or (t.shape and t.shape[0] != values.size):
        raise UserError(f"{where} has shape {list(t.shape)}; it must be 1-D, one per token")
    return values


def encode_forward_backward_output(
    logprobs_D: Sequence[np.ndarray], losses_D: Sequence[np.ndarray], metrics: dict[str, float]
) -> bytes:
    """One ArrayRecord with each datum's float32 `logprobs` and `elementwise_loss`.

    Metric keys must read `name:reduction` (the SDK splits them when merging chunks).
    """
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add(num_datums=len(logprobs_D))
    for field, arrays in (("logprobs", logprobs_D), ("elementwise_loss", losses_D)):
        parts = [np.asarray(a, dtype="<f4").tobytes() for a in arrays]
        offsets = np.cumsum([0, *(len(p) for p in parts)], dtype="<i8")
        tensor = record.fields[field]
        tensor.dtype = pb.DTYPE_FLOAT32
        tensor.data = b"".join(parts)
        tensor.offsets = offsets.tobytes()
    for key, value in metrics.items():
        out.metrics[key] = value
    return out.SerializeToString()


def encode_sample_response(
    sequences: Sequence[SampledSequence], prompt_logprobs: np.ndarray | None = None
) -> bytes:
    """A SampleResponse; `prompt_logprobs` (float32, NaN at position 0) when asked for."""
    out = pb.SampleResponse()
    for s in sequences:
        out.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(s.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(s.logprobs, dtype="<f4").tobytes(),
        )
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
