"""The Tinker backend: the learner runs on a Tinker service, driven by the `tinker` SDK.

The service is the hosted Tinker (base_url unset, TINKER_API_KEY set) or any server
speaking its protocol, e.g. `agentrl serve-tinker` on your own machine. The trainer does
not change: samples in, an optimizer step, weights out to the sampler.

A `Sample` becomes one Datum token for token: model_input = tokens[:-1], target_tokens =
tokens[1:], and the sampler logprobs and per-token advantages shifted the same way.
Tinker's losses take no mask and reduce by a plain sum over tokens, so prompt and
observation positions get advantage (or weight) 0, and the native backend's aggregation
is folded into the per-token advantages: token-mean divides by the batch's sampled
tokens, seq-mean-token-sum by its sequences, seq-mean-token-mean by the sequence's
sampled tokens times the sequences. Every loss here is linear in the advantage (and
the scales are positive), so the summed loss and its gradient equal the native
backend's on the same batch. Loss types map as:

- ppo -> Tinker `ppo`, clip thresholds 1 - clip_low and 1 + clip_high (no dual clip)
- tis -> Tinker `cispo` with thresholds (0, tis_cap): the same truncated-IS gradient
- importance_sampling -> Tinker `importance_sampling`
- cross_entropy -> Tinker `cross_entropy`, the weights carrying the aggregation

What Tinker cannot express (a KL term, a dual clip, a temperature other than 1 — its
learner scores at temperature 1) is rejected when the config is loaded.

Weights are published with `save_weights_and_get_sampling_client`: the returned
sampling client becomes the `TinkerSampler`'s, whose version goes up by exactly one.
Checkpoints are `save_state` on the service plus a local `step-N/meta.json` naming it;
resuming calls `create_training_client_from_state_with_optimizer`.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.backends import base
from agentrl.backends.base import Sample, WeightSink
from agentrl.backends.config import TinkerConfig
from agentrl.errors import ConfigError, first_line
from agentrl.weights import checkpoint

if TYPE_CHECKING:
    import tinker

    from agentrl.algorithms import LossConfig
    from agentrl.inference.tinker import TinkerSampler

log = logging.getLogger(__name__)


def loss_call(loss: LossConfig) -> tuple[str, dict[str, float]]:
    """Tinker's loss function name and config for an agentrl loss."""
    if loss.type == "ppo":
        return "ppo", {
            "clip_low_threshold": 1.0 - loss.clip_low,
            "clip_high_threshold": 1.0 + loss.clip_high,
        }
    if loss.type == "tis":
        return "cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": loss.tis_cap}
    return loss.type, {}  # importance_sampling, cross_entropy: no options


def token_scales(samples: Sequence[Sample], loss: LossConfig) -> list[float]:
    """Per sample, what each sampled token's advantage (or weight) is multiplied by, so
    that Tinker's summed loss is the native backend's aggregated one."""
    tokens, seqs = base.batch_denominators(samples)
    if loss.aggregation == "token-mean":
        return [1.0 / tokens] * len(samples)
    if loss.aggregation == "seq-mean-token-sum":
        return [1.0 / seqs] * len(samples)
    return [1.0 / (max(s.num_sampled, 1) * seqs) for s in samples]


def to_datums(samples: Sequence[Sample], loss: LossConfig) -> list[tinker.Datum]:
    """The samples as Tinker datums, next-token aligned, the aggregation folded in."""
    import tinker

    datums = []
    for s, scale in zip(samples, token_scales(samples, loss), strict=True):
        mask_T = s.loss_mask[1:]
        inputs: dict[str, Any] = {"target_tokens": s.tokens[1:]}
        if loss.type == "cross_entropy":
            inputs["weights"] = [m * scale for m in mask_T]
        else:
            inputs["logprobs"] = s.sampler_logprobs[1:]
            adv_T = s.advantages_T()[1:]
            inputs["advantages"] = [m * scale * a for m, a in zip(mask_T, adv_T, strict=True)]
        model_input = tinker.ModelInput.from_ints(s.tokens[:-1])
        datums.append(tinker.Datum(model_input=model_input, loss_fn_inputs=inputs))
    return datums


def fb_metrics(
    samples: Sequence[Sample], loss: LossConfig, output: tinker.ForwardBackwardOutput
) -> dict[str, float]:
    """The native backend's metrics, from Tinker's summed loss and learner logprobs."""
    if len(output.loss_fn_outputs) != len(samples):
        raise ConfigError(
            f"the Tinker service returned {len(output.loss_fn_outputs)} outputs for "
            f"{len(samples)} datums"
        )
    _, options = loss_call(loss)
    lo, hi = options.get("clip_low_threshold"), options.get("clip_high_threshold")
    n = mismatch = ratio_sum = clip_high = clip_low = capped = 0.0
    rewritten_n = rewritten_mismatch = 0.0
    for s, out in zip(samples, output.loss_fn_outputs, strict=True):
        learner_T = [float(x) for x in out["logprobs"].tolist()]
        if len(learner_T) != len(s.tokens) - 1:
            raise ConfigError(
                f"the Tinker service returned {len(learner_T)} logprobs for sample "
                f"{s.trajectory_id!r}, which has {len(s.tokens) - 1} targets"
            )
        adv_T = s.advantages_T()[1:]
        for lp, q, m, a in zip(
            learner_T, s.sampler_logprobs[1:], s.loss_mask[1:], adv_T, strict=True
        ):
            if not m:
                continue
            n += 1
            mismatch += abs(lp - q)
            if s.segment:
                rewritten_n += 1
                rewritten_mismatch += abs(lp - q)
            ratio = math.exp(lp - q)
            ratio_sum += ratio
            if loss.type == "ppo" and lo is not None and hi is not None:
                clip_high += a > 0 and ratio > hi
                clip_low += a < 0 and ratio < lo
            capped += loss.type == "tis" and ratio > loss.tis_cap
    value = float(output.metrics.get("loss:sum", float("nan")))
    metrics = {
        "loss": value,
        "pg_loss": value,
        "tokens": n,
        "sequences": float(sum(1 for s in samples if s.num_sampled)),
        "logprob_mismatch": mismatch / max(n, 1.0),
        "ratio_mean": ratio_sum / max(n, 1.0),
    }
    metrics |= base.rewritten_mismatch(rewritten_mismatch, rewritten_n)
    if loss.type == "ppo":
        metrics |= {"clip_high_frac": clip_high / max(n, 1), "clip_low_frac": clip_low / max(n, 1)}
    if loss.type == "tis":
        metrics["tis_capped_frac"] = capped / max(n, 1)
    return metrics


class TinkerBackend:
    """TrainerBackend over the `tinker` SDK: one training client on one service."""

    def __init__(self, config: TinkerConfig) -> None:
        import tinker

        self.config = config.check()
        self.step = 0
        self._closed = False
        self.service = tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key())
        try:
            self.client = self._wait(
                self.service.create_lora_training_client(
                    base_model=config.base_model, rank=config.lora_rank, seed=config.seed
                ),
                "create the training client",
            )
        except BaseException:
            self.close()
            raise
        info = self.client.get_info()
        log.info(
            "tinker: training %s (%s) on %s",
            config.base_model,
            f"LoRA rank {info.lora_rank}" if info.is_lora else "full weights",
            config.base_url or os.environ.get("TINKER_BASE_URL", "the hosted service"),
        )

    def _wait(self, future: Any, what: str) -> Any:
        """The future's result, or one line saying which call failed and why."""
        import tinker

        try:
            return future.result(timeout=self.config.timeout)
        except tinker.TinkerError as e:
            raise ConfigError(f"tinker: {what} failed: {first_line(e)}") from e
        except TimeoutError as e:
            raise ConfigError(
                f"tinker: {what} took more than {self.config.timeout:.0f} s",
                fix="check the service, or raise backend.timeout",
            ) from e

    def _submit_fb(self, samples: Sequence[Sample], loss: LossConfig) -> Any:
        self._check_open()
        self.config.validate_loss(loss)
        name, options = loss_call(loss)
        return self.client.forward_backward(to_datums(samples, loss), name, options or None)

    def _submit_optim(self) -> Any:
        import tinker

        c = self.config
        params = tinker.AdamParams(
            learning_rate=c.lr * c.lr_factor(self.step),
            beta1=c.betas[0],
            beta2=c.betas[1],
            eps=c.eps,
            weight_decay=c.weight_decay,
            grad_clip_norm=c.max_grad_norm or 0.0,
        )
        return self.client.optim_step(params), params.learning_rate

    def _optim_metrics(self, response: Any, lr: float) -> dict[str, float]:
        self.step += 1
        metrics = {"lr": lr, "skipped": 0.0}
        for key, value in (response.metrics or {}).items():
            name = key.split(":")[0]  # "grad_norm:mean" -> grad_norm
            if isinstance(value, (int, float)):
                metrics[name] = float(value)
        return metrics

    def forward_backward(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        """Accumulate gradients of `loss` over `samples` on the service."""
        output = self._wait(self._submit_fb(samples, loss), "forward_backward")
        return fb_metrics(samples, loss, output)

    def optim_step(self) -> dict[str, float]:
        """One AdamW step with this step's scheduled learning rate and clipping."""
        self._check_open()
        future, lr = self._submit_optim()
        return self._optim_metrics(self._wait(future, "optim_step"), lr)

    def train_step(self, samples: Sequence[Sample], loss: LossConfig) -> dict[str, float]:
        """forward_backward and optim_step submitted back to back, then awaited: the service
        runs them in order without a round trip between."""
        fb = self._submit_fb(samples, loss)
        optim, lr = self._submit_optim()
        metrics = fb_metrics(samples, loss, self._wait(fb, "forward_backward"))
        return metrics | self._optim_metrics(self._wait(optim, "optim_step"), lr)

    def publish(self, sampler: WeightSink | None, version: int | None = None) -> int:
        """Snapshot the weights into a new sampling client and hand it to `sampler`."""
        from agentrl.inference.tinker import TinkerSampler

        self._check_open()
        if not isinstance(sampler, TinkerSampler):
            raise ConfigError(
                f"the tinker backend publishes to a TinkerSampler, not {type(sampler).__name__}",
                fix="remove servers: from the train config (Tinker samples its own weights)",
            )
        client = self._wait(
            self.client.save_weights_and_get_sampling_client(), "publish the weights"
        )
        version = sampler.policy_version + 1 if version is None else version
        sampler.swap(client, version)
        return version

    def sampler(self) -> TinkerSampler:
        """A sampler for this backend's publications (it samples nothing before the first)."""
        from agentrl.inference.tinker import TinkerSampler

        return TinkerSampler()

    def save_checkpoint(
        self, root: Path, extra: dict[str, Any], *, step: int | None = None
    ) -> Path:
        """save_state on the service; root/step-N/meta.json names the state, atomically."""
        self._check_open()
        n = self.step if step is None else step
        saved = self._wait(self.client.save_state(f"step-{n:06d}"), "save_state")
        meta = checkpoint.encode_json(
            {
                "step": self.step,
                "extra": extra,
                "tinker_path": saved.path,
                "base_model": self.config.base_model,
                "lora_rank": self.config.lora_rank,
            },
            "extra",
        )
        tmp, final = checkpoint.begin_checkpoint(root, n)
        try:
            checkpoint.write_durably(tmp / "meta.json", meta)
            return checkpoint.commit_checkpoint(tmp, final)
        except BaseException:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def load_checkpoint(self, path: Path) -> dict[str, Any]:
        """A new training client from the saved state, optimizer included."""
        self._check_open()
        if not (path / "meta.json").is_file():
            raise ConfigError(f"{path}: not a complete checkpoint (no meta.json)")
        meta = json.loads((path / "meta.json").read_text())
        if "tinker_path" not in meta:
            raise ConfigError(
                f"{path}: a checkpoint of another backend, not of tinker",
                fix="resume with the backend that wrote it",
            )
        for key in ("base_model", "lora_rank"):
            if meta[key] != getattr(self.config, key):
                raise ConfigError(
                    f"{path}: saved with {key} {meta[key]!r}, the config says "
                    f"{getattr(self.config, key)!r}",
                    fix=f"resume with the {key} the run was trained with",
                )
        self.client = self._wait(
            self.service.create_training_client_from_state_with_optimizer(meta["tinker_path"]),
            f"load {meta['tinker_path']}",
        )
        self.step = int(meta["step"])
        extra: dict[str, Any] = meta["extra"]
        return extra

    def close(self) -> None:
        """End the session on the service; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self.service.close("success").result(timeout=30)
        except Exception as e:  # a dead service must not hide the error that ended the run
            log.warning("tinker: closing the session failed: %s", first_line(e))

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this tinker backend is closed", fix="build a new backend")
