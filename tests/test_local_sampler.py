"""LocalSampler on the real embedded SmolLM2 model: logprob fidelity, batching, seeds, errors.

Every check compares the batched, KV-cached, left-padded sampler against a separate plain
forward pass of the same model over prompt + sampled ids (batch of one, no padding).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from agentrl.errors import SamplerError
from agentrl.inference.base import Completion, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.local import LocalSampler

pytestmark = pytest.mark.model

QUESTIONS = [
    "Write a short story about a robot who learns to paint.",
    "Explain in detail how photosynthesis works in plants, step by step.",
    "List some fruits.",
    "Describe the water cycle to a ten year old child, using simple words and examples.",
]


@pytest.fixture(scope="module")
def sampler() -> Iterator[LocalSampler]:
    s = LocalSampler.embedded()
    yield s
    asyncio.run(s.close())


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return load_tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]
    assert len({len(p) for p in ids}) == len(ids), "prompt lengths must differ to force padding"
    return ids


def generate_all(
    sampler: LocalSampler, requests: list[tuple[list[int], SamplingParams]]
) -> list[Completion]:
    """Submit every request at once, so they land in the same batch(es)."""

    async def go() -> list[Completion]:
        return await asyncio.gather(*(sampler.generate(p, params) for p, params in requests))

    return asyncio.run(go())


def reference_logits(sampler: LocalSampler, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """Logits that predicted each of `ids`, from one unpadded, uncached forward pass."""
    with torch.inference_mode():
        logits = sampler.model(torch.tensor([prompt + ids])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)]


def test_logprobs_match_a_plain_forward_pass(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    before = sampler.stats
    max_tokens = [24, 28, 32, 24]
    params = [SamplingParams(max_tokens=n, temperature=1.0, top_p=1.0) for n in max_tokens]
    completions = generate_all(sampler, list(zip(prompts, params, strict=True)))
    assert sampler.stats.batches - before.batches < len(prompts)  # really batched

    diffs = []
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = completion.token_ids
        ref_T = torch.log_softmax(reference_logits(sampler, prompt, ids), dim=-1)
        ref = ref_T.gather(1, torch.tensor(ids)[:, None])[:, 0]
        diffs.append((ref - torch.tensor(completion.logprobs)).abs())
    mean_abs_diff = torch.cat(diffs).mean().item()
    print(f"logprob mean |diff| vs plain forward: {mean_abs_diff:.2e}")
    assert mean_abs_diff < 1e-4


def test_logprobs_follow_temperature_and_top_p(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    temperature, top_p = 0.7, 0.9
    params = SamplingParams(max_tokens=20, temperature=temperature, top_p=top_p, seed=3)
    completions = generate_all(sampler, [(p, params) for p in prompts[:2]])

    truncated_mass = []
    for prompt, completion in zip(prompts[:2], completions, strict=True):
        logits_T_V = reference_logits(sampler, prompt, completion.token_ids)
        for logits_V, token, logprob in zip(
            logits_T_V, completion.token_ids, completion.logprobs, strict=True
        ):
            logp_V = torch.log_softmax(logits_V / temperature, dim=-1)
            sorted_V, order_V = logp_V.sort(descending=True)
            # The nucleus: the fewest most-likely tokens whose mass reaches top_p.
            size = int(torch.searchsorted(sorted_V.exp().cumsum(0), top_p)) + 1
            nucleus = order_V[:size]
            log_mass = torch.logsumexp(sorted_V[:size], dim=0)
            assert token in nucleus.tolist()
            assert logprob == pytest.approx(float(logp_V[token] - log_mass), abs=1e-4)
            truncated_mass.append(-float(log_mass))
    assert max(truncated_mass) > 1e-3, "top_p never truncated anything: the test proves nothing"


def test_greedy_is_the_argmax_of_a_plain_forward_pass(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0)
    completions = generate_all(sampler, [(p, params) for p in prompts[:2]])
    for prompt, completion in zip(prompts[:2], completions, strict=True):
        argmax = reference_logits(sampler, prompt, completion.token_ids).argmax(dim=-1)
        assert completion.token_ids == argmax.tolist()
        assert completion.logprobs == [0.0] * len(completion.token_ids)  # a point mass


def test_finish_reason_length_and_stop(sampler: LocalSampler, prompts: list[list[int]]) -> None:
    greedy = generate_all(sampler, [(prompts[1], SamplingParams(max_tokens=8, temperature=0))])[0]
    assert greedy.finish_reason == "length"
    assert len(greedy.token_ids) == 8

    # Stop on the first greedy token that did not occur before it: greedy output is fixed.
    ids = greedy.token_ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(ids[k],))
    stopped = generate_all(sampler, [(prompts[1], params)])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ids[: k + 1]
    assert stopped.token_ids[-1] == ids[k]


def test_stop_strings_end_at_the_token_that_completes_them(
    sampler: LocalSampler, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]]
) -> None:
    free = generate_all(sampler, [(prompts[1], SamplingParams(max_tokens=24, temperature=0))])[0]
    ids = free.token_ids
    text = tokenizer.decode(ids)
    # A stop string that straddles a token boundary: the last 2 characters of token k and
    # the first 2 of token k+1, where both tokens are long enough. Greedy output is fixed.
    k = next(
        i
        for i in range(4, len(ids) - 1)
        if all(len(tokenizer.decode(ids[j : j + 1])) >= 3 for j in (i, i + 1))
    )
    end_k = len(tokenizer.decode(ids[: k + 1]))
    stop = text[end_k - 2 : end_k + 2]
    first = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    assert first == k + 2, "the chosen string first appears across tokens k and k+1"

    params = SamplingParams(max_tokens=24, temperature=0, stop=("never in this text", stop))
    stopped = generate_all(sampler, [(prompts[1], params)])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == ids[:first]  # the completing token kept, nothing after
    assert stopped.logprobs == free.logprobs[:first]

    # No decoder, no stop strings: a clear error, not a silent run to max_tokens.
    bare = LocalSampler(sampler.model, eos_token_ids=sampler.eos_token_ids)
    with pytest.raises(SamplerError, match="stop strings"):
        generate_all(bare, [(prompts[1], params)])
    asyncio.run(bare.close())


def test_seed_gives_the_same_tokens_alone_and_in_a_batch(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=1234)
    alone = generate_all(sampler, [(prompts[2], seeded)])[0]

    before = sampler.stats
    others = SamplingParams(max_tokens=10, temperature=1.0)
    # The seeded request goes last: it shares a batch with at least one longer prompt.
    batched = generate_all(
        sampler, [(prompts[0], others), (prompts[3], others), (prompts[2], seeded)]
    )
    assert sampler.stats.batches - before.batches < 3
    assert batched[2].token_ids == alone.token_ids
    assert batched[2].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_concurrent_requests_are_batched_and_stamped(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    local = LocalSampler(sampler.model, eos_token_ids=sampler.eos_token_ids)
    local.set_policy_version(5)
    requests = [(prompts[i % len(prompts)], SamplingParams(max_tokens=4, seed=i)) for i in range(8)]

    async def go() -> list[Completion]:
        try:
            return await asyncio.gather(*(local.generate(p, params) for p, params in requests))
        finally:
            await local.close()

    completions = asyncio.run(go())
    stats = local.stats
    assert stats.requests == 8
    assert stats.batches < 8
    assert stats.max_batch_size >= 2
    assert all(c.policy_version == 5 for c in completions)
    assert all(1 <= len(c.token_ids) <= 4 for c in completions)


def test_errors_and_close(sampler: LocalSampler, prompts: list[list[int]]) -> None:
    local = LocalSampler(sampler.model, eos_token_ids=sampler.eos_token_ids)
    params = SamplingParams(max_tokens=500, temperature=1.0)

    async def go() -> None:
        with pytest.raises(SamplerError, match="context"):
            await local.generate([1] * local.context_length, params)
        with pytest.raises(SamplerError, match="outside the vocabulary"):
            await local.generate([local.vocab_size], params)

        # close() fails a request that is still running instead of leaving it hanging.
        running = asyncio.create_task(local.generate(prompts[0], params))
        while local.stats.batches == 0:
            await asyncio.sleep(0.01)
        await local.close()
        with pytest.raises(SamplerError, match="closed"):
            await running

        with pytest.raises(SamplerError, match="closed"):
            await local.generate(prompts[0], params)
        await local.close()  # idempotent

    asyncio.run(asyncio.wait_for(go(), timeout=60))


def test_a_failing_batch_fails_its_requests_and_the_worker_survives(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    # A pad id outside the vocabulary makes the real prefill fail, but only when it pads.
    local = LocalSampler(sampler.model, eos_token_ids=sampler.eos_token_ids, pad_token_id=10**9)
    params = SamplingParams(max_tokens=2)

    async def go() -> Completion:
        try:
            results = await asyncio.gather(
                *(local.generate(p, params) for p in prompts[:2]), return_exceptions=True
            )
            assert local.stats.batches == 1
            for result in results:
                assert isinstance(result, SamplerError)
                assert "local sampler failed" in str(result)
            return await local.generate(prompts[0], params)  # alone: nothing to pad
        finally:
            await local.close()

    assert len(asyncio.run(asyncio.wait_for(go(), timeout=60)).token_ids) >= 1


# ---- pause / resume around a weight update (vLLM's three modes) ----------------------


def _publish_during(
    sampler: LocalSampler, prompts: list[list[int]], mode: str, max_tokens: int = 80
) -> tuple[list[Completion], int, int, bool]:
    """Start a batch, pause it with `mode`, publish the same weights as a new version,
    resume; returns the completions, the old and new versions, and whether a request sent
    while paused was still waiting when resume came."""
    old = sampler.policy_version
    new = old + 1
    params = [SamplingParams(max_tokens=max_tokens, seed=i) for i in range(len(prompts))]

    async def go() -> tuple[list[Completion], bool]:
        tasks = [
            asyncio.create_task(sampler.generate(p, q))
            for p, q in zip(prompts, params, strict=True)
        ]
        await asyncio.sleep(0.6)  # the batch is decoding
        await asyncio.to_thread(sampler.pause, mode)  # type: ignore[arg-type]
        assert sampler.is_paused
        late = asyncio.create_task(sampler.generate(prompts[0], SamplingParams(max_tokens=2)))
        state = {k: v.clone() for k, v in sampler.model.state_dict().items()}
        await asyncio.to_thread(sampler.update_weights, state, new)
        await asyncio.sleep(0.2)
        waited = not late.done()
        sampler.resume()
        done = await asyncio.gather(*tasks)
        after = await late
        assert after.token_versions == [new] * len(after.token_ids)  # sent while paused
        return done, waited

    done, waited = asyncio.run(go())
    return done, old, new, waited


def test_pause_keep_parks_the_batch_and_stamps_each_token_with_its_weights(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    done, old, new, waited = _publish_during(sampler, prompts[:3], "keep", max_tokens=32)
    assert waited, "a request sent while paused must wait for resume"
    assert all(c.finish_reason != "abort" for c in done)
    spanning = [c for c in done if old in c.token_versions and new in c.token_versions]
    assert spanning, "the update must land while the batch was parked mid-way"
    # Parked between two steps: every row that was still decoding switches at one index.
    switch = {c.token_versions.index(new) for c in spanning}
    assert len(switch) == 1, switch
    for c in done:
        assert c.policy_version == old
        assert c.token_versions == sorted(c.token_versions)


def test_update_weights_with_publish_pause_keep_lands_mid_reply(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    """The async trainer's publication: one update_weights call pauses (keep), swaps and
    resumes; the running batch decodes on under the new version."""
    old, new = sampler.policy_version, sampler.policy_version + 1
    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}

    async def go() -> list[Completion]:
        tasks = [
            asyncio.create_task(sampler.generate(p, SamplingParams(max_tokens=32, seed=i)))
            for i, p in enumerate(prompts[:2])
        ]
        await asyncio.sleep(0.6)  # the batch is decoding
        await asyncio.to_thread(sampler.update_weights, state, new)
        assert not sampler.is_paused  # resumed by the update itself
        return await asyncio.gather(*tasks)

    sampler.publish_pause = "keep"
    try:
        done = asyncio.run(go())
    finally:
        sampler.publish_pause = None
    assert any(old in c.token_versions and new in c.token_versions for c in done)
    assert all(c.finish_reason != "abort" and c.policy_version == old for c in done)


def test_pause_abort_cuts_the_batch_with_the_old_version(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    done, old, _new, waited = _publish_during(sampler, prompts[:3], "abort")
    assert waited
    aborted = [c for c in done if c.finish_reason == "abort"]
    assert aborted, "the running batch must end with finish_reason abort"
    for c in aborted:
        assert 0 < len(c.token_ids) < 80
        assert c.token_versions == [old] * len(c.token_ids)


def test_pause_wait_drains_the_batch_first(sampler: LocalSampler, prompts: list[list[int]]) -> None:
    done, old, _new, waited = _publish_during(sampler, prompts[:2], "wait", max_tokens=24)
    assert waited
    for c in done:  # finished before the update: one version, never cut
        assert c.finish_reason in ("stop", "length")
        assert c.token_versions == [old] * len(c.token_ids)


def test_load_weights_from_a_safetensors_folder(
    sampler: LocalSampler, prompts: list[list[int]], tmp_path: pytest.TempPathFactory
) -> None:
    from safetensors import safe_open

    from agentrl.inference.weight_transfer import save_weights

    original = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    changed = {k: v.clone() for k, v in original.items()}
    changed["model.norm.weight"] *= 0.5
    changed["model.embed_tokens.weight"] *= 0.5
    changed["lm_head.weight"] = changed["model.embed_tokens.weight"]  # tied, as trained
    folder = save_weights(changed, tmp_path / "v1")  # type: ignore[operator]
    # Every name is written, the tied lm_head too (vLLM reloads only what the files hold).
    assert sampler.model.config.tie_word_embeddings
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(changed)
        assert torch.equal(f.get_tensor("lm_head.weight"), changed["lm_head.weight"])
    version = sampler.policy_version + 1
    try:
        sampler.load_weights(folder, version)
        loaded = sampler.model.state_dict()
        assert torch.equal(loaded["model.norm.weight"], changed["model.norm.weight"])
        assert torch.equal(loaded["lm_head.weight"], changed["model.embed_tokens.weight"])
        assert sampler.model.lm_head.weight is sampler.model.model.embed_tokens.weight
        assert sampler.policy_version == version
    finally:
        sampler.update_weights(original, version + 1)
    with pytest.raises(SamplerError, match="no .safetensors"):
        sampler.load_weights(tmp_path, version + 2)  # type: ignore[arg-type]


# ---- continuous batching: joining, leaving, cancelling ---------------------------------


async def _until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait (polling the sampler's counters, which offer no event) until `condition`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_a_request_that_joins_a_running_batch_samples_as_if_alone(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    long_params = SamplingParams(max_tokens=40, temperature=0)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=77)
    long_alone = generate_all(sampler, [(prompts[1], long_params)])[0]
    alone = [generate_all(sampler, [(prompts[2], p)])[0] for p in (greedy, seeded)]

    async def go() -> tuple[list[Completion], Completion]:
        long = asyncio.create_task(sampler.generate(prompts[1], long_params))
        await _until(lambda: sampler.stats.active == 1)
        joined = await asyncio.gather(*(sampler.generate(prompts[2], p) for p in (greedy, seeded)))
        # Static batching would hold them until the long one ended.
        assert not long.done(), "the short requests must finish inside the long one"
        return joined, await long

    joined, long_joined = asyncio.run(go())
    # The short prompt is left-padded against the long row's cache; nothing may change.
    for a, b in zip(alone, joined, strict=True):
        assert b.token_ids == a.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    # The long row saw two rows join and leave (its cache columns trimmed): unchanged too.
    assert long_joined.token_ids == long_alone.token_ids
    assert long_joined.finish_reason == long_alone.finish_reason


def test_a_cancelled_request_leaves_the_batch_at_the_next_step(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    before = sampler.stats

    async def go() -> Completion:
        running = asyncio.create_task(sampler.generate(prompts[0], SamplingParams(max_tokens=500)))
        await _until(lambda: sampler.stats.active == 1)
        running.cancel()
        await _until(lambda: sampler.stats.active == 0)
        with pytest.raises(asyncio.CancelledError):
            await running
        return await sampler.generate(prompts[2], SamplingParams(max_tokens=2, temperature=0))

    after_cancel = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert sampler.stats.cancelled == before.cancelled + 1
    assert sampler.stats.tokens - before.tokens < 500 + 2  # it stopped well short of 500
    assert len(after_cancel.token_ids) == 2  # the worker goes on


def test_an_update_waits_for_running_rows_and_newcomers_wait_for_it(
    sampler: LocalSampler, prompts: list[list[int]]
) -> None:
    """publish_pause None: no request joins the rows the update waits for, so the
    update lands as soon as they end, and the newcomer runs under the new weights."""
    old, new = sampler.policy_version, sampler.policy_version + 1
    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}

    async def go() -> tuple[Completion, Completion]:
        running = asyncio.create_task(sampler.generate(prompts[0], SamplingParams(max_tokens=20)))
        await _until(lambda: sampler.stats.active == 1)
        update = asyncio.create_task(asyncio.to_thread(sampler.update_weights, state, new))
        await _until(lambda: sampler._engine._updates_waiting == 1)
        late = await sampler.generate(prompts[2], SamplingParams(max_tokens=2))
        assert running.done() and update.done(), "the newcomer ran before the update"
        return await running, late

    first, late = asyncio.run(asyncio.wait_for(go(), timeout=120))
    assert first.token_versions == [old] * len(first.token_ids)
    assert first.finish_reason != "abort"
    assert late.policy_version == new and late.token_versions == [new] * len(late.token_ids)
