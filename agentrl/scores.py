"""How well a policy did on tasks, as benchmarks state it: per instance, then pass@1 with
its interval and pass@k, and the paired comparison of two evaluations.

An attempt is one episode of an instance. It is *graded* when its outcome is the agent's
(not an infrastructure failure, which is counted apart and never scored as a failure)
and *solved* when its reward is at least 1. With n graded attempts of an instance, c of
them solved:

- pass@1 of the instance is c/n; of a task, the mean over its instances. Its 95% interval
  is the normal one over the instances (each instance's pass@1 one value), so it widens
  with the spread between instances as well as with few attempts; with a single instance
  it is over that instance's attempts.
- pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models
  Trained on Code"): 1 - C(n-c, k) / C(n, k), the chance that k attempts drawn without
  replacement from the n hold at least one success. An instance with fewer than k graded
  attempts has none; a task's pass@k is the mean over the instances that have one, and
  says how many those are.
- A comparison pairs the instances two evaluations share: the difference of their pass@1
  means, a 95% interval from a paired bootstrap at two levels (the instances, then each
  chosen instance's attempts), and the instances whose pass@1 rose or fell.

Nothing here imports torch: `agentrl eval --compare` reads two folders and does only this.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from agentrl.trajectory import Trajectory

SOLVED_AT = 1.0  # a graded attempt with reward >= this is a success
Z95 = 1.96


def mean_interval(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% normal interval (0 with fewer than 2 values)."""
    if not values:
        return float("nan"), 0.0
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, Z95 * statistics.stdev(values) / math.sqrt(len(values))


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """The unbiased pass@k of one instance with `c` successes in `n` attempts (None when
    n < k: k attempts were never made)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and k >= 1")
    if n < k:
        return None
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """The k reported for up to `n` attempts: 1, 2, 4, ... and `n` itself."""
    ks = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return ks + ([n] if n and ks[-1] != n else [])


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Outcome(_Model):
    """What scoring needs of one attempt: a few numbers, not its tokens (an evaluation of
    thousands of long episodes holds these, never the trajectories)."""

    task: str
    instance: str
    attempt: int
    graded: bool = Field(description="the outcome was the agent's (no infrastructure failure)")
    reward: float | None
    stop_reason: str
    turns: int = Field(description="action turns")
    sampled_tokens: int
    total_tokens: int = Field(description="prompt + response tokens over every segment")
    seconds: float | None = Field(description="wall seconds, INIT to grade")
    error: str | None = None
    fix: str | None = None

    @property
    def key(self) -> tuple[str, str, int]:
        return self.task, self.instance, self.attempt

    @property
    def solved(self) -> bool:
        return self.graded and self.reward is not None and self.reward >= SOLVED_AT

    @classmethod
    def of(cls, t: Trajectory) -> Outcome:
        """Attempt `a` of instance `i` is the trajectory `i_a` (its `group_id` is `i`)."""
        return cls(
            task=t.task,
            instance=t.group_id,
            attempt=int(t.trajectory_id.rsplit("_", 1)[1]),
            graded=t.trainable and t.reward is not None,
            reward=t.reward,
            stop_reason=t.stop_reason.value,
            turns=sum(u.kind == "action" for u in t.turns),
            sampled_tokens=t.num_sampled,
            total_tokens=sum(len(g.prompt_ids) + len(g.response_ids) for g in t.ledgers()),
            seconds=round(sum(t.seconds.values()), 3) if t.seconds else None,
            error=t.error,
            fix=t.fix,
        )


class InstanceScore(_Model):
    """One instance's attempts."""

    task: str
    instance: str
    attempts: int = Field(description="episodes recorded, infrastructure failures included")
    graded: int = Field(description="attempts whose outcome was the agent's (n)")
    solved: int = Field(description="graded attempts with reward >= 1 (c)")
    infra_failures: int
    pass_at_1: float | None = Field(description="solved / graded (None: nothing graded)")
    reward_mean: float | None
    turns_mean: float | None = Field(description="action turns per graded attempt")
    sampled_tokens_mean: float | None = Field(description="sampled tokens per graded attempt")
    total_tokens_mean: float | None = Field(description="prompt + response tokens, every segment")
    seconds_mean: float | None = Field(description="wall seconds per attempt (INIT to grade)")
    stop_reasons: dict[str, int]


class TaskScore(_Model):
    """A task's instances together (or every task's: `task` is `all`)."""

    task: str
    instances: int
    attempts: int
    graded: int
    solved: int
    infra_failures: int
    infra_share: float = Field(description="infra_failures / attempts")
    pass_at_1: float | None = Field(description="mean over instances with a graded attempt")
    pass_at_1_ci95: float = Field(description="half-width of pass@1's 95% interval")
    pass_at_k: dict[str, float] = Field(description="k -> mean pass@k over instances with >= k")
    pass_at_k_instances: dict[str, int] = Field(description="k -> instances with >= k graded")
    reward_mean: float | None
    reward_ci95: float
    stop_reasons: dict[str, int]
    first_infra_error: str | None = None
    first_infra_fix: str | None = None


class Scores(_Model):
    """An evaluation's numbers: every task, all of them together, every instance."""

    overall: TaskScore
    tasks: list[TaskScore]
    instances: list[InstanceScore]


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def score_instance(task: str, instance: str, outcomes: Sequence[Outcome]) -> InstanceScore:
    graded = [o for o in outcomes if o.graded]
    solved = sum(o.solved for o in graded)
    return InstanceScore(
        task=task,
        instance=instance,
        attempts=len(outcomes),
        graded=len(graded),
        solved=solved,
        infra_failures=len(outcomes) - len(graded),
        pass_at_1=solved / len(graded) if graded else None,
        reward_mean=_mean([o.reward for o in graded if o.reward is not None]),
        turns_mean=_mean([o.turns for o in graded]),
        sampled_tokens_mean=_mean([o.sampled_tokens for o in graded]),
        total_tokens_mean=_mean([o.total_tokens for o in graded]),
        seconds_mean=_mean([o.seconds for o in outcomes if o.seconds is not None]),
        stop_reasons=dict(Counter(o.stop_reason for o in outcomes)),
    )


def score_task(
    task: str, instances: Sequence[InstanceScore], outcomes: Sequence[Outcome]
) -> TaskScore:
    """`instances` of one task (or of all), `outcomes` their attempts."""
    scored = [i for i in instances if i.pass_at_1 is not None]
    if len(scored) == 1:  # one instance: the interval is over its attempts
        only = scored[0]
        values = [1.0] * only.solved + [0.0] * (only.graded - only.solved)
    else:
        values = [i.pass_at_1 for i in scored if i.pass_at_1 is not None]
    p1, p1_half = mean_interval(values)
    pass_k: dict[str, float] = {}
    counted: dict[str, int] = {}
    most = max((i.graded for i in instances), default=0)
    for k in ks_up_to(most):
        per = [p for i in instances if (p := pass_at_k(i.graded, i.solved, k)) is not None]
        if per:
            pass_k[str(k)], counted[str(k)] = statistics.fmean(per), len(per)
    rewards = [o.reward for o in outcomes if o.graded and o.reward is not None]
    reward, reward_half = mean_interval(rewards)
    infra = [o for o in outcomes if not o.graded]
    return TaskScore(
        task=task,
        instances=len(instances),
        attempts=len(outcomes),
        graded=len(outcomes) - len(infra),
        solved=sum(i.solved for i in instances),
        infra_failures=len(infra),
        infra_share=len(infra) / len(outcomes) if outcomes else 0.0,
        pass_at_1=p1 if values else None,
        pass_at_1_ci95=p1_half,
        pass_at_k=pass_k,
        pass_at_k_instances=counted,
        reward_mean=reward if rewards else None,
        reward_ci95=reward_half,
        stop_reasons=dict(Counter(o.stop_reason for o in outcomes)),
        first_infra_error=infra[0].error if infra else None,
        first_infra_fix=infra[0].fix if infra else None,
    )


def score(attempts: Iterable[Outcome | Trajectory]) -> Scores:
    """Every instance's attempts (trajectories or their outcomes), each task, and all."""
    outcomes = [a if isinstance(a, Outcome) else Outcome.of(a) for a in attempts]
    by_instance: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_instance[(o.task, o.instance)].append(o)
    instances = [score_instance(task, inst, os) for (task, inst), os in by_instance.items()]
    tasks = []
    for name in dict.fromkeys(task for task, _ in by_instance):
        mine = [i for i in instances if i.task == name]
        tasks.append(score_task(name, mine, [o for o in outcomes if o.task == name]))
    overall = score_task("all", instances, outcomes)
    return Scores(overall=overall, tasks=tasks, instances=instances)


class Change(_Model):
    """An instance whose pass@1 differs between the two evaluations."""

    task: str
    instance: str
    a: float
    b: float


class Comparison(_Model):
    """B against A on the instances both graded: pass@1(B) - pass@1(A), paired."""

    a: str
    b: str
    instances: int = Field(description="instances both evaluations graded")
    only_a: int = Field(description="instances graded in A alone (left out)")
    only_b: int
    pass_at_1_a: float | None
    pass_at_1_b: float | None
    difference: float | None = Field(description="pass@1 of B minus A, over shared instances")
    ci95: tuple[float, float] | None = Field(
        description="95% interval: paired bootstrap over instances, then their attempts"
    )
    resamples: int
    gained: list[Change] = Field(description="pass@1 higher in B (one attempt each: flipped)")
    lost: list[Change] = Field(description="pass@1 lower in B")

    @property
    def significant(self) -> bool:
        """Whether the interval excludes 0."""
        return self.ci95 is not None and (self.ci95[0] > 0 or self.ci95[1] < 0)


def compare(
    a: Scores,
    b: Scores,
    *,
    names: tuple[str, str] = ("A", "B"),
    resamples: int = 10_000,
    seed: int = 0,
) -> Comparison:
    """Pair `a` and `b` by (task, instance); bootstrap the mean difference of pass@1 at
    both levels the numbers were sampled at: the instances (with replacement), then each
    chosen instance's attempts in each evaluation (a binomial draw at its observed rate).
    Resampling instances alone reads a pass@1 from 3 attempts as exact, and with few
    instances near 0 or 1 calls chance a difference; the second level keeps that noise."""
    import numpy as np

    ia = {(i.task, i.instance): i for i in a.instances if i.pass_at_1 is not None}
    ib = {(i.task, i.instance): i for i in b.instances if i.pass_at_1 is not None}
    shared = [key for key in ia if key in ib]
    pa = {key: i.solved / i.graded for key, i in ia.items()}
    pb = {key: i.solved / i.graded for key, i in ib.items()}
    xa = np.array([pa[key] for key in shared], dtype=float)
    xb = np.array([pb[key] for key in shared], dtype=float)
    diff = xb - xa
    ci: tuple[float, float] | None = None
    if shared:
        rng = np.random.default_rng(seed)
        picks = rng.integers(0, len(shared), size=(resamples, len(shared)))
        na = np.array([ia[key].graded for key in shared])[picks]
        nb = np.array([ib[key].graded for key in shared])[picks]
        draws = rng.binomial(nb, xb[picks]) / nb - rng.binomial(na, xa[picks]) / na
        low, high = np.percentile(draws.mean(axis=1), [2.5, 97.5])
        ci = (float(low), float(high))
    changes = [
        Change(task=task, instance=inst, a=pa[(task, inst)], b=pb[(task, inst)])
        for task, inst in shared
        if pa[(task, inst)] != pb[(task, inst)]
    ]
    by_size = lambda c: (-abs(c.b - c.a), c.task, c.instance)  # noqa: E731
    return Comparison(
        a=names[0],
        b=names[1],
        instances=len(shared),
        only_a=len(pa) - len(shared),
        only_b=len(pb) - len(shared),
        pass_at_1_a=float(xa.mean()) if shared else None,
        pass_at_1_b=float(xb.mean()) if shared else None,
        difference=float(diff.mean()) if shared else None,
        ci95=ci,
        resamples=resamples,
        gained=sorted((c for c in changes if c.b > c.a), key=by_size),
        lost=sorted((c for c in changes if c.b < c.a), key=by_size),
    )
