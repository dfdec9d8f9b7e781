"""The pipeline's generation slots and the simulated sampler the dispatch benchmark uses.

Pure asyncio (no Docker): who gets a contended slot, what a cancelled waiter gives back,
and that the simulated engine decodes the scripted tokens no faster than its model.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from agentrl.dispatch.pipeline import PrioritySlots
from agentrl.inference.base import SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler


def test_a_contended_slot_goes_to_the_smallest_key_then_in_request_order() -> None:
    async def main() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with slots.hold((0, 0)):
                await release.wait()

        async def waiter(name: str, key: tuple[int, int]) -> None:
            async with slots.hold(key):
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        waiters = [
            asyncio.create_task(waiter("three turns", (3, 0))),
            asyncio.create_task(waiter("one turn, admitted late", (1, 9))),
            asyncio.create_task(waiter("one turn, admitted early", (1, 2))),
            asyncio.create_task(waiter("one turn, admitted early, asked later", (1, 2))),
        ]
        await asyncio.sleep(0)
        release.set()
        await asyncio.gather(first, *waiters)
        return order

    assert asyncio.run(main()) == [
        "one turn, admitted early",
        "one turn, admitted early, asked later",
        "one turn, admitted late",
        "three turns",
    ]


def test_a_waiter_cancelled_while_waiting_or_just_handed_a_slot_gives_it_back() -> None:
    async def main() -> int:
        slots = PrioritySlots(1)
        async with slots.hold((0, 0)):
            waiting = asyncio.create_task(slots.hold((1, 0)).__aenter__())
            await asyncio.sleep(0)
            waiting.cancel()  # cancelled in the queue
            handed = asyncio.create_task(slots.hold((1, 0)).__aenter__())
            await asyncio.sleep(0)
        # The slot was handed to `handed`; cancel it before it ever runs.
        handed.cancel()
        await asyncio.gather(waiting, handed, return_exceptions=True)
        async with slots.hold((0, 0)):  # would wait forever if the slot leaked
            return slots.free

    assert asyncio.run(asyncio.wait_for(main(), timeout=5)) == 0


@pytest.mark.model
def test_the_simulated_engine_decodes_the_script_no_faster_than_its_model() -> None:
    tokenizer: Any = load_tokenizer()
    latency = LatencyModel(base_s=0.002, per_request_s=0.001, chunk_steps=4)
    tokens = [40, 80, 120, 160]
    scripts = {f"s{k}": Script(replies=[f"reply {k}"], tokens=[n]) for k, n in enumerate(tokens)}
    sampler = SimulatedSampler(scripts, tokenizer, latency)

    async def main() -> tuple[float, list[Any]]:
        started = time.monotonic()
        params = SamplingParams(max_tokens=64)
        outs = await asyncio.gather(
            *(sampler.generate([1, 2, 3], params, session_id=s) for s in scripts)
        )
        await sampler.close()
        return time.monotonic() - started, outs

    elapsed, outs = asyncio.run(main())
    assert sampler.decoded_tokens == sum(tokens)
    # Four together for 40 steps, three for 40, two for 40, one for 40.
    modelled = sum(40 * latency.step_s(b) for b in (4, 3, 2, 1))
    assert elapsed >= modelled
    for k, out in enumerate(outs):
        assert tokenizer.decode(out.token_ids, skip_special_tokens=True) == f"reply {k}"
        assert out.finish_reason == "stop"
