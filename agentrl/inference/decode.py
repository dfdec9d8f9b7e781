"""One decoding step for many requests: rows, their left-padded batch, and the sampling.

Rows are left-padded into one KV cache (`Batch`), each with its own positions, params,
stop ids and RNG: a request samples the same tokens, and up to float noise the same
logprobs, alone or in a batch.

Sampling, per row and step: `logits / temperature`, softmax, then top-p keeps the
smallest set of most likely tokens whose mass reaches `top_p` and renormalises it. The
reported logprob is that of the sampled token under exactly this distribution. With
temperature 0 (greedy) the distribution is a point mass, so the logprob is 0.0.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import torch
from pydantic import ValidationError
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, FinishReason, SamplingParams


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Completion]
    cancelled: threading.Event = field(default_factory=threading.Event)  # the caller left


@dataclass
class Row:
    """Decoding state of one request inside the batch."""

    request: Request
    max_tokens: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    version: int  # weights version when it started (Completion.policy_version)
    position: int  # position id of the next token fed to the model
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: SamplerError | None = None  # sampling this row failed; the others go on
    searched: int = 0  # characters of decoded output already searched for stop strings
    settled: bool = False  # its caller has its answer (or error)

    @property
    def ended(self) -> bool:
        return (
            self.finish_reason is not None
            or self.error is not None
            or self.request.cancelled.is_set()
        )


@dataclass
class Batch:
    """The running rows and their KV cache, left-padded: every row's last token sits in
    the last column, and `mask_B_T` marks the columns each row really has."""

    rows: list[Row]
    cache: DynamicCache
    mask_B_T: torch.Tensor

    def join(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding the narrower of the two caches."""
        width = max(self.mask_B_T.shape[1], other.mask_B_T.shape[1])
        self.mask_B_T = torch.cat(
            [_left_pad(self.mask_B_T, width, 1), _left_pad(other.mask_B_T, width, 1)]
        )
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            (keys, values), (their_keys, their_values) = _kv(mine), _kv(theirs)
            mine.keys = torch.cat([_left_pad(keys, width, 2), _left_pad(their_keys, width, 2)])
            mine.values = torch.cat(
                [_left_pad(values, width, 2), _left_pad(their_values, width, 2)]
            )
        self.rows += other.rows

    def keep(self, kept: list[int], trim: bool) -> None:
        """Keep rows `kept`; `trim` (plain caches only) also drops the leading columns
        none of them attends to, so a batch that never empties does not grow forever."""
        index = torch.tensor(kept, device=self.mask_B_T.device)
        self.rows = [self.rows[i] for i in kept]
        self.mask_B_T = self.mask_B_T[index]
        if not trim:
            self.cache.batch_select_indices(index)
            return
        start = int(self.mask_B_T.any(dim=0).int().argmax())  # the first column in use
        self.mask_B_T = self.mask_B_T[:, start:]
        for layer in _layers(self.cache):
            keys, values = _kv(layer)
            layer.keys, layer.values = keys[index, :, start:], values[index, :, start:]


@dataclass(frozen=True)
class Decoder:
    """A causal LM and what decoding it needs: its stop ids, padding and context."""

    model: PreTrainedModel
    eos_token_ids: frozenset[int]
    pad_token_id: int  # any id works (it is masked out)
    context_length: int
    tokenizer: PreTrainedTokenizerBase | None  # needed only by requests with stop strings

    def new_row(self, request: Request, version: int) -> Row:
        params = request.params
        generator = torch.Generator(device=self.model.device)
        if params.seed is None:
            generator.seed()  # fresh entropy per request
        else:
            generator.manual_seed(params.seed)
        n = len(request.prompt_ids)
        return Row(
            request=request,
            # Generation also ends where the model's context does.
            max_tokens=min(params.max_tokens, self.context_length - n),
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            generator=generator,
            version=version,
            position=n,
        )

    def prefill(self, rows: list[Row], version: int) -> Batch:
        device = self.model.device
        # Left padding puts every row's last prompt token in the same column.
        width = max(len(row.request.prompt_ids) for row in rows)
        input_ids_B_T = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row.request.prompt_ids)
            input_ids_B_T[i, width - n :] = torch.tensor(row.request.prompt_ids)
            mask_B_T[i, width - n :] = 1
        input_ids_B_T, mask_B_T = input_ids_B_T.to(device), mask_B_T.to(device)
        cache = DynamicCache(config=self.model.config)  # filled in place by every forward
        out = self.model(
            input_ids=input_ids_B_T,
            attention_mask=mask_B_T,
            position_ids=(mask_B_T.cumsum(-1) - 1).clamp(min=0),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.sample(rows, out.logits[:, -1, :], version)
        return Batch(rows, cache, mask_B_T)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Feed every row its last token; the next-token logits (`logits_B_V`)."""
        device = self.model.device
        rows = batch.rows
        batch.mask_B_T = torch.cat([batch.mask_B_T, batch.mask_B_T.new_ones((len(rows), 1))], dim=1)
        out = self.model(
            input_ids=torch.tensor([[row.token_ids[-1]] for row in rows], device=device),
            attention_mask=batch.mask_B_T,
            position_ids=torch.tensor([[row.position] for row in rows], device=device),
            cache=batch.cache,
            use_cache=True,
        )
        for row in rows:
            row.position += 1
        logits_B_V: torch.Tensor = out.logits[:, -1, :]
        return logits_B_V

    def sample(self, rows: list[Row], logits_B_V: torch.Tensor, version: int) -> None:
        """Sample one token for every row; a row whose sampling fails ends with an error."""
        # Greedy rows take the argmax; their 1.0 only avoids dividing by zero.
        temperatures_B = torch.tensor(
            [row.request.params.temperature or 1.0 for row in rows], device=logits_B_V.device
        )
        logprobs_B_V = torch.log_softmax(logits_B_V.float() / temperatures_B[:, None], dim=-1)
        for row, logprobs_V in zip(rows, logprobs_B_V, strict=True):
            try:
                token, logprob = sample_token(logprobs_V, row.request.params, row.generator)
            except RuntimeError as e:  # e.g. a temperature so low the logits overflow
                row.error = SamplerError(
                    f"sampling token {len(row.token_ids) + 1} failed: {e}".splitlines()[0]
                )
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            row.versions.append(version)
            if token in row.stop_ids or self._stopped_on_string(row):
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.max_tokens:
                row.finish_reason = "length"

    def _stopped_on_string(self, row: Row) -> bool:
        """Whether the row's decoded output now contains one of its stop strings."""
        stops = row.request.params.stop
        if not stops:
            return False
        assert self.tokenizer is not None  # generate() checks
        text = str(self.tokenizer.decode(row.token_ids))
        # A match must end in text not searched before; it may start up to len-1 earlier.
        start = max(0, row.searched - max(len(s) for s in stops) + 1)
        row.searched = len(text)
        return any(s in text[start:] for s in stops)

    @staticmethod
    def result(row: Row) -> Completion | SamplerError:
        if row.error is not None:
            return row.error
        try:
            return Completion(
                token_ids=row.token_ids,
                logprobs=row.logprobs,
                finish_reason=row.finish_reason or "length",
                policy_version=row.version,
                token_versions=row.versions,
            )
        except ValidationError as e:  # e.g. the version was set back while it ran
            return SamplerError(f"local sampler: an inconsistent completion: {e}")


def sample_token(
    logprobs_V: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float]:
    """Draw one token from tempered log-probs with top-p; return it and its logprob."""
    if params.temperature == 0:
        return int(logprobs_V.argmax()), 0.0  # greedy: a point mass
    if params.top_p >= 1.0:
        token = int(torch.multinomial(logprobs_V.exp(), 1, generator=generator))
        return token, float(logprobs_V[token])
    sorted_V, order_V = logprobs_V.sort(descending=True)
    probs_V = sorted_V.exp()
    # Keep a token while the mass before it is below top_p: the smallest set reaching top_p.
    kept = int(((probs_V.cumsum(0) - probs_V) < params.top_p).sum())
    nucleus = sorted_V[:kept] - torch.logsumexp(sorted_V[:kept], dim=0)
    index = int(torch.multinomial(nucleus.exp(), 1, generator=generator))
    return int(order_V[index]), float(nucleus[index])


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`x` with zeros prepended along `dim` up to `width` (masked columns)."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    layers = list(cache.layers)
    assert all(isinstance(layer, DynamicLayer) for layer in layers)  # see `continuous`
    return layers  # type: ignore[return-value]


def _kv(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    assert layer.keys is not None and layer.values is not None  # filled by the prefill
    return layer.keys, layer.values
