"""The native trainer backend: a transformers causal LM sharded with torch FSDP2.

Gradients across ranks SUM. Each rank's loss is divided by the token and sequence counts
of the whole batch (not its share), so the per-rank losses add up to the full-batch
loss; FSDP2 would average the reduce-scatter over ranks, so every FSDP module gets a
gradient divide factor of 1 with sum-only collectives, making the reduced gradient the
gradient of that sum. Ranks run the same number of micro-batches (FSDP's all-gathers
are collective), padding with an empty one where a rank has fewer.

Process groups come from `agentrl.backends.process_group` (torchrun's, or a world of one
on loopback); checkpoints use the shared atomic layout of `agentrl.weights.checkpoint`.

With `lora` set, the base weights are frozen and only the adapters of
`agentrl.weights.lora` train (and are checkpointed); `publish` merges them into plain
weights, and the reference policy is the base model, computed with the adapters off.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from agentrl.algorithms import LossConfig, policy_loss
from agentrl.backends import base
from agentrl.backends.base import Sample, WeightSink
from agentrl.backends.config import FSDPConfig
from agentrl.backends.process_group import join_process_group, leave_process_group
from agentrl.errors import ConfigError
from agentrl.weights import checkpoint, lora

log = logging.getLogger(__name__)

_SUMMED_METRICS = frozenset({"loss", "pg_loss", "kl_loss", "tokens"})  # the rest: token means


class FSDPBackend:
    """TrainerBackend over FSDP2; every rank constructs one and calls every method."""

    def __init__(
        self, config: FSDPConfig, model_path: str | os.PathLike[str] | None = None
    ) -> None:
        self.config = config.check()
        self.step = 0
        self._closed = False
        join_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        cuda = torch.cuda.is_available()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        checkpoint.seed_rngs(config.seed)

        model = _load_model(model_path)
        spec = config.lora
        # The Linears that carry an adapter; none: full fine-tuning.
        self.adapted = [] if spec is None else lora.apply_lora(model, spec, config.seed)
        # A tied lm_head with an adapter: its merged weight is no longer the embedding's, so
        # the first publish checks that the sampler's model does not tie them.
        self._check_untied = spec is not None and spec.train_unembed and lora.output_is_tied(model)
        torch.nn.Module.to(model, self.device)  # transformers' `to` wrapper confuses mypy
        self.context_length = int(model.config.max_position_embeddings)
        self.vocab_size = int(model.config.vocab_size)
        pad_id = int(model.config.pad_token_id or 0)  # any id: padding is masked out
        self.pad_id = pad_id
        self._idle = Sample(  # what a rank with fewer micro-batches runs: no loss, no gradient
            trajectory_id="<idle>",
            tokens=[pad_id, pad_id],
            loss_mask=[0, 0],
            sampler_logprobs=[0.0, 0.0],
            advantage=0.0,
        )
        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = mp if config.dtype == "bfloat16" else MixedPrecisionPolicy()
        self.reference: PreTrainedModel | None = None
        if config.reference_model and spec is None:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            _shard(self.reference, mesh, policy)
        if config.gradient_checkpointing:
            enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.x
            (enable or model.gradient_checkpointing_enable)({"use_reentrant": False})
        self.model = _shard(model.train(), mesh, policy)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, config.lr_factor)

    def forward_backward(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        """Accumulate the gradient of `loss` over `samples` (this rank: samples[rank::world])."""
        self._check_open()
        self.config.validate_loss(loss)
        base.check_fits(samples, self.context_length, self.vocab_size)
        denominators = base.batch_denominators(samples)
        mine = samples[self.rank :: self.world]
        batches = base.pack_micro_batches(mine, self.config.micro_batch_tokens)
        rounds = int(self._all_reduce([float(len(batches))], maximum=True)[0])
        sums: dict[str, float] = defaultdict(float)
        for i in range(rounds):
            batch = batches[i] if i < len(batches) else [self._idle]  # pairs FSDP collectives
            for key, value in self._micro_batch(batch, loss, *denominators).items():
                sums[key] += value
        keys = sorted(sums)  # identical on every rank: each ran the same loss at least once
        total = dict(zip(keys, self._all_reduce([sums[k] for k in keys]), strict=True))
        out = {}
        for k in keys:
            if "|" not in k:
                weight = total.get(f"{k}|weight")  # None: a sum, not a mean
                out[k] = total[k] if weight is None else total[k] / weight if weight else 0.0
        out["logprob_mismatch"] = total["|mismatch|"] / denominators[0]
        out |= base.rewritten_mismatch(total["|later|"], total["|later tokens|"])
        out["sequences"] = denominators[1]
        out["micro_batches"] = float(rounds)
        return out

    def _micro_batch(
        self, batch: list[Sample], loss: LossConfig, total_tokens: float, total_seqs: float
    ) -> dict[str, float]:
        """Forward and backward one micro-batch; returns weighted sums of its metrics."""
        ids_B_T, attn_B_T, mask_B_T, old_B_T, adv_B_T = self._collate(batch)
        temperature = self.config.temperature
        ref_B_T = None
        if self.config.reference_model:  # before the policy pass, whose graph goes to backward
            with torch.no_grad(), lora.adapters_disabled(self.model):  # with lora: the base
                reference = self.model if self.reference is None else self.reference
                ref_B_T = token_logprobs(reference, ids_B_T, attn_B_T, temperature, mask_B_T)
        lp_B_T = token_logprobs(self.model, ids_B_T, attn_B_T, temperature, mask_B_T)
        value, metrics = policy_loss(
            lp_B_T,
            old_B_T,
            adv_B_T,
            mask_B_T,
            loss,
            total_tokens=total_tokens,
            total_seqs=total_seqs,
            ref_logprobs_B_T=ref_B_T,
        )
        value.backward()
        gap_B_T = torch.where(mask_B_T > 0, (lp_B_T.detach() - old_B_T).abs(), 0.0)
        later_B = torch.tensor([float(x.segment > 0) for x in batch])  # a rewrite began them
        sums = {"|mismatch|": float(gap_B_T.sum()), "|later|": float(gap_B_T.sum(1) @ later_B)}
        sums["|later tokens|"] = float((mask_B_T > 0).float().sum(1) @ later_B)
        for key, v in metrics.items():
            # Losses already carry the batch denominators: they add up. The rest are
            # means over this micro-batch's tokens: weight them by those tokens.
            if key in _SUMMED_METRICS:
                sums[key] = v
            else:
                sums[key], sums[f"{key}|weight"] = v * metrics["tokens"], metrics["tokens"]
        return sums

    def optim_step(self) -> dict[str, float]:
        """Clip, step AdamW, advance the schedule, zero gradients. A non-finite gradient
        norm skips the update (and the schedule) and says so in `skipped`."""
        self._check_open()
        max_norm = self.config.max_grad_norm or math.inf
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        lr = float(self.scheduler.get_last_lr()[0])
        finite = math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0 if finite else 1.0}

    def train_step(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        """forward_backward, then optim_step; their metrics merged."""
        return self.forward_backward(samples, loss) | self.optim_step()

    def save_checkpoint(
        self, root: Path, extra: dict[str, Any], *, step: int | None = None
    ) -> Path:
        """Write model, optimizer, schedule, per-rank RNG, step and `extra` atomically, as
        `root/step-N`, N = `step` (the caller's count, e.g. trainer steps, some of which
        may have had nothing to learn) or else the optimizer steps taken."""
        self._check_open()
        spec = None if self.config.lora is None else self.config.lora.model_dump()
        meta = checkpoint.encode_json(
            {"step": self.step, "world_size": self.world, "lora": spec, "extra": extra}, "extra"
        )
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only
        model_sd = get_model_state_dict(self.model, options=full)
        if spec is not None:  # the frozen base is the model folder's: keep the adapters only
            model_sd = {k: v for k, v in model_sd.items() if lora.is_adapter(k)}
        optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=full)
        paths = (
            list(checkpoint.begin_checkpoint(root, self.step if step is None else step))
            if self.rank == 0
            else [None, None]
        )
        dist.broadcast_object_list(paths, src=0)
        tmp, final = Path(str(paths[0])), Path(str(paths[1]))
        try:
            if self.rank == 0:
                checkpoint.save_torch(model_sd, tmp / "model.pt")
                checkpoint.save_torch(optim_sd, tmp / "optimizer.pt")
                checkpoint.save_torch(self.scheduler.state_dict(), tmp / "scheduler.pt")
            checkpoint.save_torch(checkpoint.rng_state(), tmp / f"rng-rank{self.rank}.pt")
            dist.barrier()
            if self.rank == 0:
                checkpoint.write_durably(tmp / "meta.json", meta)
                checkpoint.commit_checkpoint(tmp, final)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        dist.barrier()
        return final

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """Restore a checkpoint of `save_checkpoint`; training continues bit-identically."""
        self._check_open()
        if not (path / "meta.json").is_file():
            raise ConfigError(f"{path}: not a complete checkpoint (no meta.json)")
        meta = json.loads((path / "meta.json").read_text())
        lora.check_checkpoint(meta.get("lora"), self.config.lora, str(path))
        model_sd: dict[str, Any] = {}
        optim_sd: dict[str, Any] = {}
        if self.rank == 0:  # read once, broadcast: ranks need not share a filesystem
            model_sd = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
            optim_sd = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        if self.config.lora is not None:  # loaded non-strictly below: check the names here
            verdict = [lora.adapters_differ(model_sd, self.model) if self.rank == 0 else None]
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None:
                raise ConfigError(
                    f"checkpoint {path}: {verdict[0]}", fix="resume on the model it was trained on"
                )
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        partial = StateDictOptions(  # with lora: the adapters only
            full_state_dict=True, broadcast_from_rank0=True, strict=self.config.lora is None
        )
        set_model_state_dict(self.model, model_sd, options=partial)
        set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=options)
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng = path / f"rng-rank{self.rank}.pt"
        if rng.is_file():
            checkpoint.set_rng_state(torch.load(rng, weights_only=True))
        else:
            log.warning(
                "%s: no RNG state for rank %d (saved by %d ranks)",
                path,
                self.rank,
                meta["world_size"],
            )
        self.step = int(meta["step"])
        extra: dict[str, Any] = meta["extra"]
        return extra

    def publish(self, sampler: WeightSink | None, version: int | None = None) -> int:
        """Gather full weights on rank 0 and hand them to its sampler; returns the new version.

        Ranks other than 0 may pass None: only rank 0 holds the full weights. With lora,
        they are merged (W + alpha/r B A) under the original names.
        """
        self._check_open()
        if self._check_untied:
            lora.check_untied(sampler)
            self._check_untied = False  # a local model stays untied; a server: warned once
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only
        state = cast(dict[str, torch.Tensor], get_model_state_dict(self.model, options=options))
        if self.config.lora is not None and self.rank == 0:
            state = lora.merged_state_dict(state, self.config.lora)
        published = [0]
        if self.rank == 0:
            if sampler is None:
                raise ConfigError("publish on rank 0 needs a sampler to receive the weights")
            published[0] = sampler.policy_version + 1 if version is None else version
            sampler.update_weights(state, published[0])
        dist.broadcast_object_list(published, src=0)
        return int(published[0])

    def close(self) -> None:
        """Release the process group if this process created it; safe to call twice."""
        if not self._closed:
            self._closed = True
            leave_process_group()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this FSDP backend is closed", fix="build a new backend")

    def _all_reduce(self, values: list[float], *, maximum: bool = False) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.SUM)
        return [float(v) for v in t.tolist()]

    def _collate(
        self, batch: list[Sample]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-pad a micro-batch: ids, attention mask, loss mask, sampler logprobs, and
        advantages (per sequence, or per token when a sample's turns carry their own)."""
        width = max(len(s.tokens) for s in batch)
        ids_B_T = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attn_B_T = torch.zeros((len(batch), width), dtype=torch.long)
        mask_B_T = torch.zeros((len(batch), width))
        old_B_T = torch.zeros((len(batch), width))
        for i, s in enumerate(batch):
            n = len(s.tokens)
            ids_B_T[i, :n] = torch.tensor(s.tokens)
            attn_B_T[i, :n] = 1
            mask_B_T[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
            old_B_T[i, :n] = torch.tensor(s.sampler_logprobs, dtype=torch.float32)
        if all(s.token_advantages is None for s in batch):
            adv = torch.tensor([s.advantage for s in batch])
        else:
            adv = torch.zeros((len(batch), width))
            for i, s in enumerate(batch):
                adv[i, : len(s.tokens)] = torch.tensor(s.advantages_T(), dtype=torch.float32)
        d = self.device
        return ids_B_T.to(d), attn_B_T.to(d), mask_B_T.to(d), old_B_T.to(d), adv.to(d)


def token_logprobs(
    model: torch.nn.Module,
    ids_B_T: torch.Tensor,
    attn_B_T: torch.Tensor,
    temperature: float,
    mask_B_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """logprob of ids[:, t] given ids[:, :t] at temperature, as [B, T]; column 0 is 0.0.

    The logits at position t - 1 predict token t, hence the shift; the result is aligned
    with the tokens, so the loss mask applies to it unshifted. With `mask_B_T`, only the
    positions that predict a masked token go through the vocabulary projection (the
    rest of the result is 0.0): prompts and observations are most of an agent's tokens,
    and the projection onto ~49k words is the largest single matmul of a small model.
    """
    if mask_B_T is None:
        logits_B_T_V = model(input_ids=ids_B_T, attention_mask=attn_B_T, use_cache=False).logits
        logits_B_T_V = logits_B_T_V[:, :-1].float() / temperature
        targets_B_T = ids_B_T[:, 1:, None]
        picked_B_T = logits_B_T_V.gather(-1, targets_B_T).squeeze(-1)
        lp_B_T = picked_B_T - logits_B_T_V.logsumexp(-1)
        return torch.nn.functional.pad(lp_B_T, (1, 0))
    keep_B_T = torch.zeros_like(mask_B_T, dtype=torch.bool)
    keep_B_T[:, :-1] = mask_B_T[:, 1:] > 0  # position t - 1 predicts masked token t
    out = model(
        input_ids=ids_B_T, attention_mask=attn_B_T, use_cache=False, logits_to_keep=keep_B_T
    )
    logits_N_V = out.logits.reshape(-1, out.logits.shape[-1]).float() / temperature
    targets_N = ids_B_T[:, 1:][keep_B_T[:, :-1]]
    picked_N = logits_N_V.gather(-1, targets_N[:, None]).squeeze(-1)
    lp_B_T = torch.zeros(ids_B_T.shape, dtype=logits_N_V.dtype, device=ids_B_T.device)
    lp_B_T[:, 1:][keep_B_T[:, :-1]] = picked_N - logits_N_V.logsumexp(-1)
    return lp_B_T


def _load_model(model_path: str | os.PathLike[str] | None) -> PreTrainedModel:
    if model_path is None:
        from agentrl.inference.embedded import load_model

        return load_model()
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model


def _shard(
    model: PreTrainedModel, mesh: DeviceMesh, policy: MixedPrecisionPolicy
) -> PreTrainedModel:
    """fully_shard each decoder layer, then the root; make reductions plain sums."""
    layer_types = set(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
