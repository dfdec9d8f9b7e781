"""`agentrl train`, along its flow: `launch` (the Trainer: Ray, torchrun, rank 0's
sampler and sandboxes) -> `loop` (resume, eval and checkpoint cadence, summary) -> a
schedule, `sync` or `asynchronous` (with `admission`, its staleness budget) -> `run`
(what every step does: episodes, rollout, learn) -> `records` (metrics.jsonl, typed) and
`plots`. `data` holds the prompts and their seeded order; `sampler` the train sampler.
"""

from agentrl.train.launch import Trainer

__all__ = ["Trainer"]
