"""Which groups a step may admit and which it trains on, so that no token is more than k versions stale.

Versions count training steps: the step that trains from version v turns it into v + 1, and the weights a group
was admitted with (version a) sampled its oldest tokens, so a group trained from version v is at most v - a stale.
The bound is `train.max_staleness` = k: a group admitted at version a must be trained at version a + k at the
latest (its *deadline*). Each step trains exactly P groups (P = prompts per step on this rank).

Invariant kept before every step (v the version it trains from), for j = 0 .. k:

    #{resident groups with deadline <= v + j} <= (j + 1) * P          (resident: admitted, not yet trained)

- Admission (`room`): a group admitted now has deadline v + k, so only the j = k bound grows: at most
  (k + 1) * P groups may be resident. Past that, new prompts wait (generation is paced, nothing is thrown away).
- Selection (`select`): the step must leave the invariant true for v + 1, i.e. train at least
  need(j) = #{deadline <= v + j} - j * P of the groups with deadline <= v + j, for j = 0 .. k (j = 0: every group
  due now). It takes those from the finished groups, earliest deadline first, then fills its P slots with other
  finished groups in the order they finished. When the finished groups cannot meet a need yet (a due group still
  decodes), the step waits for more to finish: that is what bounds staleness.

With k = 0 at most P groups are resident and all are due: the step admits P prompts, waits for all of them and
trains on them, exactly the synchronous loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Paced(Protocol):
    """What pacing reads of a group: the version it was admitted at and, once finished, its finishing order."""

    admitted: int
    finished_at: int | None


G = TypeVar("G", bound=Paced)


@dataclass(frozen=True)
class Pacer:
    per_step: int  # P: groups each step trains on
    max_staleness: int  # k

    def capacity(self) -> int:
        """The most groups resident at once: (k + 1) * P."""
        return (self.max_staleness + 1) * self.per_step

    def room(self, resident: int) -> int:
        """How many groups may be admitted now, `resident` being admitted and not yet trained."""
        return max(0, self.capacity() - resident)

    def deadline(self, group: Paced) -> int:
        """The last version that may train on `group`."""
        return group.admitted + self.max_staleness

    def needs(self, resident: Sequence[Paced], version: int) -> list[int]:
        """need(j) for j = 0 .. k: groups with deadline <= version + j this step must train on."""
        deadlines = [self.deadline(g) for g in resident]
        return [sum(d <= version + j for d in deadlines) - j * self.per_step for j in range(self.max_staleness + 1)]

    def select(self, resident: Sequence[G], version: int) -> list[G] | None:
        """The P groups the step trained from `version` takes (see the module docstring), or None when the
        finished ones cannot make a step yet. Groups in the order they are to be taken (forced ones first)."""
        finished = [g for g in resident if g.finished_at is not None]
        if len(finished) < self.per_step:
            return None
        taken: list[G] = []
        chosen: set[int] = set()
        by_deadline = sorted(finished, key=lambda g: (self.deadline(g), g.finished_at or 0))
        for j, need in enumerate(self.needs(resident, version)):
            have = sum(self.deadline(g) <= version + j for g in taken)
            for g in by_deadline:
                if have >= need:
                    break
                if id(g) not in chosen and self.deadline(g) <= version + j:
                    taken.append(g)
                    chosen.add(id(g))
                    have += 1
            if have < need:
                return None  # a group at its bound is still decoding: the step waits for it
        if len(taken) > self.per_step:  # the admission bound makes this impossible; say so rather than overfill
            raise RuntimeError(f"{len(taken)} groups are due at version {version}, more than the {self.per_step} "
                               "a step trains on: groups were admitted past the staleness bound")
        for g in sorted(finished, key=lambda g: g.finished_at or 0):  # the rest in the order they finished
            if len(taken) == self.per_step:
                break
            if id(g) not in chosen:
                taken.append(g)
                chosen.add(id(g))
        return taken

    def forced(self, resident: Sequence[Paced], version: int) -> bool:
        """Whether a step at `version` must wait for a group at its bound (P groups finished, yet no step)."""
        finished = sum(g.finished_at is not None for g in resident)
        return finished >= self.per_step and self.select(resident, version) is None
