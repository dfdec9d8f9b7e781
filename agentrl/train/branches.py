"""Branch credit in training: continuations of finished groups, run by the dispatcher.

With `algorithm.advantage.estimator: branch`, every training episode commits the states
its branches need and holds its snapshots at close. When a group's episodes are all back
(`collect_group`), `Branches.plan` picks the states to branch from (`branch_turns`) and makes
`k` continuations of each: episodes whose INIT restores the snapshot before the turn and
whose chat and turns before it are the parent's. They go into the same feed as fresh
episodes, so they share the dispatcher's generation slots and sandbox limit, and its
sandbox nodes on a cluster (a restore goes to the node holding the snapshot). The group
is done when its continuations are back; `reclaim` then removes the snapshots the replay
policy would not have kept and strips them from the records. The values, the per-turn
advantages and their metrics follow from the trajectories (`agentrl.algorithms.branch_credit`,
`branch_metrics`); continuations are stored in trajectories.jsonl with their `branch_of`.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentrl.algorithms import sample_std, state_keys
from agentrl.batch import sandbox_seconds
from agentrl.episode import Episode
from agentrl.errors import ConfigError
from agentrl.snapshots import Snapshots, recorded, without_snapshots

if TYPE_CHECKING:
    from agentrl.algorithm_config import BranchConfig
    from agentrl.algorithms import BranchCredit
    from agentrl.dispatch.core import Feed
    from agentrl.inference.base import Sampler
    from agentrl.train.admission import Group
    from agentrl.train.run import TrainRun
    from agentrl.trajectory import Trajectory

log = logging.getLogger(__name__)


def branch_turns(traj: Trajectory, cfg: BranchConfig) -> list[int]:
    """The turns t of `traj` whose preceding state is branched: 1 <= t < its turns, with
    a snapshot before t (turn t - 1's). Never an infrastructure failure's or an external
    harness's episode (agentrl did not play it)."""
    n = len(traj.turns)
    if not traj.trainable or traj.agent is not None or traj.branch_of is not None:
        return []
    ready = [t for t in range(1, n) if traj.turns[t - 1].snapshot_id is not None]
    if cfg.select == "every":
        return [t for t in ready if t % cfg.every == 0]
    if cfg.select == "count":  # evenly spread over the branchable states
        picks = {ready[(i * len(ready)) // cfg.count] for i in range(min(cfg.count, len(ready)))}
        return sorted(picks)
    # uncertain: around the turns whose replies the sampler was least sure of
    ledgers = traj.ledgers()

    def confidence(u: int) -> float:
        turn = traj.turns[u]
        lps = ledgers[turn.segment].logprobs[turn.span[0] : turn.span[1]]
        return math.fsum(lps) / len(lps) if lps else 0.0

    doubtful = sorted(range(n), key=lambda u: (confidence(u), u))[: cfg.count]
    return sorted({t for u in doubtful for t in (u, u + 1)} & set(ready))


def branch_points(
    group: Sequence[Trajectory], cfg: BranchConfig
) -> list[tuple[Trajectory, int, int]]:
    """(parent, turn, continuations) for a finished group: `k` of every state
    `branch_turns` picks. With `pool`, a state is branched once for the group (from the
    first episode that passed it), and only for the continuations that the siblings which
    passed it do not already give: each sibling's value leaves its own reward out, so a
    state n siblings passed has n - 1 free samples for each of them."""
    keys_of = {t.trajectory_id: state_keys(t, cfg.pool) for t in group}
    passed: Counter[tuple[str, int]] = Counter()
    if cfg.pool:
        for t in group:
            if t.trainable and t.reward is not None and t.branch_of is None:
                passed.update(keys_of[t.trajectory_id][1:])
    planned: set[tuple[str, int]] = set()
    points = []
    for parent in group:
        keys = keys_of[parent.trajectory_id]
        for turn in branch_turns(parent, cfg):
            count = cfg.k
            if cfg.pool:
                if keys[turn] in planned:
                    continue
                planned.add(keys[turn])
                count = max(0, cfg.k - (passed[keys[turn]] - 1))
            if count:
                points.append((parent, turn, count))
    return points


class Branches:
    """Plans continuations for finished groups and reclaims their snapshots after."""

    def __init__(self, run: TrainRun, cfg: BranchConfig, sampler: Sampler) -> None:
        self.run, self.cfg, self.sampler = run, cfg, sampler
        self.task_index = {task.spec.name: i for i, task in enumerate(run.tasks)}
        self.factory = run.factory(sampler)
        self.held: dict[str, Episode] = {}  # episodes whose snapshots are not reclaimed yet

    def hold(self, episodes: Sequence[Episode]) -> None:
        """Episodes that hold their snapshots for branching, until `reclaim` (or `close`)."""
        self.held.update((ep.trajectory_id, ep) for ep in episodes)

    def plan(self, group: Sequence[Trajectory]) -> list[Episode]:
        """The continuations `branch_points` asks for, of the group's episodes."""
        episodes = []
        for parent, turn, count in branch_points(group, self.cfg):
            task = self.run.tasks[self.task_index[parent.task]]
            instance = next(x for x in task.instances if x.id == parent.group_id)
            for k in range(count):
                try:
                    ep = self.factory.continued(
                        task,
                        instance,
                        parent,
                        turn,
                        trajectory_id=f"{parent.trajectory_id}~{turn}-{k}",
                        purpose="value",
                        snapshot=parent.turns[turn - 1].snapshot_id,
                    )
                except ConfigError as e:  # its state has no estimate: outcome credit
                    log.warning("%s: no branch at turn %d: %s", parent.trajectory_id, turn, e)
                    break
                episodes.append(ep)
        return episodes

    async def reclaim(self, trajs: Sequence[Trajectory]) -> list[Trajectory]:
        """Remove the snapshots of `trajs`' fresh episodes that their replay policy would
        not have kept (those made for branching; all of a success retention drops);
        returns `trajs` recording none of them, continuations included."""
        gone: set[str] = set()
        remove, kept = [], []
        for t in trajs:
            if t.branch_of is not None:
                continue
            self.held.pop(t.trajectory_id, None)
            i = self.task_index[t.task]
            policy = self.run.config.snapshots or self.run.tasks[i].spec.snapshots
            mine = Snapshots(policy).reclaimable(f"{self.run.run_id}/{t.trajectory_id}", t)
            gone |= mine
            remove += [self.run.envs[i].remove_snapshot(sid) for sid in sorted(mine)]
            left = [sid for _, sid in recorded(t) if sid not in mine]
            kept.append((t, left, policy, self.run.envs[i]))
        # A failed removal leaves an image `agentrl gc --snapshots` reclaims.
        await asyncio.gather(*remove, return_exceptions=True)
        for t, left, policy, env in kept:  # what the replay policy keeps: within keep_gb
            await self.run.retention.keep(t.task, t.trajectory_id, left, policy, env)
        return [without_snapshots(t, gone) for t in trajs]

    async def close(self) -> None:
        """Remove every snapshot of the held episodes never reclaimed: a run that ends
        (or is stopped) with groups in flight leaves none behind."""
        held, self.held = list(self.held.values()), {}
        for ep in held:
            await ep.close()  # idempotent; settles a commit in flight
            await ep.snapshots.remove(ep.env.remove_snapshot, set(ep.snapshots.made))


def collect_group(
    traj: Trajectory, groups: dict[str, Group], feed: Feed, branches: Branches | None
) -> Group | None:
    """File a returned trajectory with its group (`groups`: trajectory id -> group, until
    it is back). When the group's episodes are all back, its continuations (if any) go
    into `feed` and the group waits for them too. Returns the group once it is done."""
    group = groups.pop(traj.trajectory_id)
    group.trajectories.append(traj)
    if not group.complete:
        return None
    if branches is not None and not group.branched:
        group.branched = True
        continuations = branches.plan(group.trajectories)
        if continuations:
            group.size += len(continuations)
            for ep in continuations:
                groups[ep.trajectory_id] = group
                feed.put(ep)
            return None
    return group


def branch_sampled_tokens(traj: Trajectory) -> int:
    """Tokens a continuation sampled itself (after its branch point)."""
    if traj.branch_of is None:
        return traj.num_sampled
    ledgers = traj.ledgers()
    own = traj.turns[traj.branch_of.turn :]
    return sum(sum(ledgers[u.segment].loss_mask[u.span[0] : u.span[1]]) for u in own)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def branch_metrics(trajs: Sequence[Trajectory], credit: BranchCredit) -> dict[str, Any]:
    """The step's branch record: what branching cost and what it estimated."""
    conts = [t for t in trajs if t.branch_of is not None]
    fresh = [t for t in trajs if t.branch_of is None and t.trainable]
    restores = [t.seconds.get("init", 0.0) for t in conts if t.trainable]
    by_turn: dict[int, list[float]] = defaultdict(list)
    for (_, turn), (value, _) in credit.values.items():
        by_turn[turn].append(value)
    values = {}
    for turn in sorted(by_turn):
        vs = by_turn[turn]
        mean, sd = math.fsum(vs) / len(vs), sample_std(vs)
        values[str(turn)] = {"mean": round(mean, 4), "sd": round(sd, 4), "states": len(vs)}
    turn_advs = [a for t in fresh for a in credit.per_turn.get(t.trajectory_id, [])]
    failed = [t for t in fresh if (t.reward or 0.0) < 1.0 and credit.per_turn.get(t.trajectory_id)]
    return {
        "branch_episodes": len(conts),
        "branch_infra_failures": sum(not t.trainable for t in conts),
        "branch_sampled_tokens": sum(branch_sampled_tokens(t) for t in conts),
        "branch_sandbox_seconds": round(sum(sandbox_seconds(t) for t in conts), 3),
        "branch_states": len(credit.values),
        "branch_restore_p50_s": round(_quantile(restores, 0.5), 3) if restores else None,
        "branch_restore_p95_s": round(_quantile(restores, 0.95), 3) if restores else None,
        "branch_values": values,
        "turn_adv_pos_frac": _share(turn_advs, lambda a: a > 0),
        "turn_adv_neg_frac": _share(turn_advs, lambda a: a < 0),
        "failed_first_turn_credited": _share(
            [credit.per_turn[t.trajectory_id][0] for t in failed], lambda a: a > 0
        ),
    }


def _share(values: list[float], pick: Any) -> float | None:
    return round(sum(map(pick, values)) / len(values), 4) if values else None
