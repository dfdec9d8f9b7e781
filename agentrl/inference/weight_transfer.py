"""Moving a trainer's weights into serving replicas, two ways.

- **checkpoint**: the trainer writes a folder of safetensors files (atomically: a
  temporary folder, then a rename) and every replica reloads from that path. Works
  anywhere the replicas can read the folder; costs a disk round trip.
- **collective**: vLLM's weight-transfer protocol. The trainer is rank 0 of a process
  group of its own with every replica (ranks 1..N), set up once through
  `POST /init_weight_transfer_engine`; each update then announces the tensors' names,
  dtypes and shapes in `POST /update_weights` while the trainer broadcasts them in that
  order (vLLM 0.33's routes and payloads). On a GPU node that is NCCL through vLLM's own
  trainer helpers
  (`VLLMNCCLTransport`, needs the `vllm` extra); `agentrl serve` receives over gloo
  (`GlooTransport` / `GlooReceiver`), so the same protocol runs on a CPU machine.

The HTTP side of both lives in the router's control plane (`router/control.py`); this module
holds only what moves tensors.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from agentrl.atomic import atomic_folder, fsync_dir
from agentrl.errors import ConfigError, SamplerError

CHUNK_BYTES = 256 << 20  # tensors announced per /update_weights call (about)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (vLLM's dtype_names)."""
    return str(dtype).removeprefix("torch.")


def save_weights(state: Mapping[str, torch.Tensor], folder: Path) -> Path:
    """Write `state` to `folder`/model.safetensors atomically; returns `folder`.

    Every name is written, a tensor that shares storage with one already written (a tied
    lm_head) as a copy of its own: vLLM's `reload_weights` (0.32) updates only the names
    in the files, so a tied lm_head left out keeps the weights it had before the reload
    while the embedding moves (tests/test_vllm.py caught it: the learner's logprobs
    drifted ~0.005 per token from vLLM's after the first update).
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    with atomic_folder(folder, replace=True) as tmp:
        seen: set[tuple[int, int]] = set()
        every: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
            out = tensor.detach().cpu().contiguous()
            # safetensors refuses two names over one storage: a twin gets its own copy.
            every[name] = out.clone() if key in seen else out
            seen.add(key)
        save_file(every, str(tmp / "model.safetensors"))
        fsync_dir(tmp)
    return folder


def chunks(state: Mapping[str, torch.Tensor], chunk_bytes: int = CHUNK_BYTES) -> list[list[str]]:
    """The names of `state` in order, cut into groups of about `chunk_bytes` each."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        n = tensor.numel() * tensor.element_size()
        if groups[-1] and size + n > chunk_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return [g for g in groups if g]


def update_info(state: Mapping[str, torch.Tensor], names: list[str]) -> dict[str, Any]:
    """The `update_info` of one `POST /update_weights` for `names`."""
    return {
        "names": names,
        "dtype_names": [dtype_name(state[n].dtype) for n in names],
        "shapes": [list(state[n].shape) for n in names],
    }


class TrainerTransport(Protocol):
    """The trainer's end (rank 0) of the collective."""

    backend: str  # what the replicas must have been started with
    init_extras: dict[str, Any]  # wire parameters both ends must agree on (init_info)

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the group as rank 0; blocks until every replica has joined."""
        ...

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        """Broadcast `tensors` in order (the order of the names announced)."""
        ...

    def close(self) -> None: ...


class _GlooGroup:
    """A gloo process group apart from torch.distributed's default one."""

    def __init__(
        self, address: str, port: int, rank: int, world_size: int, timeout_s: float
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = torch.distributed.TCPStore(
            address,
            port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        gloo: Any = torch.distributed.ProcessGroupGloo  # _Options is not in the stubs
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [gloo.create_device(hostname=address)]
        self.group: Any = gloo(self.store, rank, world_size, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()


class GlooTransport:
    """Rank 0 over gloo, for `agentrl serve` replicas (CPU, this host or a reachable one)."""

    backend = "gloo"
    init_extras: dict[str, Any] = {"packed": False}  # one broadcast per tensor

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._group: _GlooGroup | None = None

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        self._group = _GlooGroup(master_address, master_port, 0, world_size, self.timeout_s)

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        if self._group is None:
            raise SamplerError("the gloo transport was not initialised")
        for tensor in tensors:
            self._group.broadcast(tensor.detach().cpu().contiguous())

    def close(self) -> None:
        self._group = None


class VLLMNCCLTransport:
    """Rank 0 over NCCL with vLLM's own helpers (GPU node; `pip install agentrl[vllm]`).

    Written against vLLM 0.33 (`nccl_common.trainer_init`, the packed broadcast
    producer; packing is agreed in init_info). Replicas must run
    `VLLM_SERVER_DEV_MODE=1 vllm serve ... --weight-transfer-config '{"backend":"nccl"}'`.
    Not exercised by the CPU test suite: it needs GPUs.
    """

    backend = "nccl"
    init_extras: dict[str, Any] = {"packed": True}  # vLLM's default buffer geometry

    def __init__(self) -> None:
        try:
            from vllm.distributed.weight_transfer import nccl_common, packed_tensor
        except ImportError as e:
            raise ConfigError(
                "the nccl weight transfer needs vLLM on the trainer side",
                fix="pip install 'agentrl[vllm]' on the GPU node, or use transfer: checkpoint",
            ) from e
        self._open = nccl_common.trainer_init
        self._produce = packed_tensor.packed_nccl_broadcast_producer
        self._group: Any = None

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        info = {"master_address": master_address, "master_port": master_port}
        self._group = self._open({**info, "world_size": world_size})

    def send(self, tensors: Iterable[torch.Tensor]) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        pairs = (("", t.to(device, non_blocking=True)) for t in tensors)
        self._produce(pairs, self._group, 0, lambda item: item[1])

    def close(self) -> None:
        self._group = None


def make_transport(kind: str) -> TrainerTransport:
    if kind == "gloo":
        return GlooTransport()
    if kind == "nccl":
        return VLLMNCCLTransport()
    raise ConfigError(f"unknown collective backend {kind!r}", fix="use gloo or nccl")


class GlooReceiver:
    """A replica's end of the gloo collective (`agentrl serve`)."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._group: _GlooGroup | None = None

    def init(self, init_info: Mapping[str, Any]) -> None:
        """vLLM's init_info: master_address, master_port, rank_offset, world_size."""
        try:
            address = str(init_info["master_address"])
            port = int(init_info["master_port"])
            rank = int(init_info["rank_offset"])
            world = int(init_info["world_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise SamplerError(
                f"init_info needs master_address, master_port, rank_offset, world_size: {e}"
            ) from e
        if not 0 < rank < world:
            raise SamplerError(f"rank_offset {rank} must lie in 1..{world - 1}")
        if init_info.get("packed"):
            raise SamplerError("agentrl serve receives unpacked tensors only (packed: false)")
        self._group = _GlooGroup(address, port, rank, world, self.timeout_s)

    def receive(self, info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Receive the tensors `info` announces (vLLM's update_info, packed false)."""
        if self._group is None:
            raise SamplerError("no weight transfer group: POST /init_weight_transfer_engine first")
        if info.get("packed"):
            raise SamplerError("agentrl serve receives unpacked tensors only (packed: false)")
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise SamplerError("update_info needs names, dtype_names and shapes of one length")
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            kind = getattr(torch, str(dtype), None)
            if not isinstance(kind, torch.dtype):
                raise SamplerError(f"{name}: unknown dtype {dtype!r}")
            tensor = torch.empty([int(x) for x in shape], dtype=kind)
            self._group.broadcast(tensor)
            out[str(name)] = tensor
        return out

    def close(self) -> None:
        self._group = None
