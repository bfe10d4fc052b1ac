"""Multi-step decode launches of a CohortEngine: queueing one, reading it, chaining the next, launching ahead.

A launch (engine/multi_step.py) runs `EngineConfig.decode_steps` decode steps on the device; its tokens are read
at the engine's next step. The device only stays busy while the host works if the next launch is queued before
the host turns to that work:

- `chain`: when the batch need not change, the next launch is queued before the current one's tokens are read
  (the rows continue from the device state), so reading and booking them overlaps the device;
- `launch_ahead` (multi-turn): when turns ended in a launch and no chain was possible, the next decode launch
  is queued before the turn-end callbacks run (parsing, tools, chat template rendering), so that host work
  overlaps the other conversations' decoding instead of leaving the device idle. The continued turns those
  callbacks queue would have waited for the next decode steps anyway (`continuation_delay_steps`).

Launching ahead or chaining never changes a token: sampling is keyed by each sequence's seed and position, not
by the batch it runs in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cohort.engine.sampler import needs_processing
from cohort.engine.scheduler import ScheduledStep
from cohort.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from cohort.engine.engine import CohortEngine

# A chained launch keeps rows that ended in the batch (budget 0) while at least this share still decodes.
MIN_LIVE_SHARE = 0.75


@dataclass
class Launch:
    """A multi-step decode launch whose tokens have not been read yet."""

    ticket: int
    seqs: list[Sequence]
    budgets: list[int]


def queue(engine: CohortEngine, step: ScheduledStep) -> bool:
    """Queue `step` as a multi-step launch when it is a decode step that may run several device steps with plain
    sampling; False (nothing queued) otherwise: the engine runs it one step at a time."""
    if step.is_prefill or step.lookahead <= 1 or not step.seqs or needs_processing(step.seqs):
        return False
    budgets = [seq.decode_budget(step.lookahead) for seq in step.seqs]
    engine._inflight = Launch(engine.runner.launch_multi(step.seqs, budgets), step.seqs, budgets)
    return True


def launch_ahead(engine: CohortEngine) -> None:
    """Queue the next decode launch now, when nothing is queued and the next step would be a multi-step decode
    (sequences run; nothing waits, or only continued turns that the scheduler defers). A decode step that cannot
    run several device steps is kept for the engine's next `step`. Nothing when the next step is a prefill."""
    scheduler = engine.scheduler
    if engine._inflight is not None or engine._scheduled is not None or engine.runner.decode_steps <= 1:
        return
    if not scheduler.running or (scheduler.waiting and not scheduler.defers_continuations()):
        return
    step = scheduler.schedule(engine.runner.decode_steps)
    if not queue(engine, step):
        engine._scheduled = step


def read(engine: CohortEngine) -> list[Sequence]:
    """Read the queued launch's tokens (decode_steps per row; those after a row's stop are dropped), after
    queueing the next launch when it can chain: the device then runs the next `decode_steps` steps while the
    host reads and books these (see `chain`). Returns the sequences that ended."""
    current = engine._inflight
    assert current is not None
    engine._inflight = chain(engine, current)
    tokens, logprobs = engine.runner.collect_multi(current.ticket, len(current.seqs))
    before = sum(len(seq) for seq in current.seqs)
    engine.runner.routes.book_multi(current.ticket, current.seqs, current.budgets)  # when recording
    for seq, budget, toks, lps in zip(current.seqs, current.budgets, tokens, logprobs):
        # a row that ended in an earlier launch was computed in vain in this chained one
        if seq.status is Status.RUNNING and seq.finish_reason is None:
            seq.extend_sampled(toks[:budget], lps[:budget], engine.tokenizer)
    engine.stats.decode_tokens += sum(len(seq) for seq in current.seqs) - before
    engine.stats.decode_steps += engine.runner.decode_steps
    engine.stats.peak_used_blocks = max(engine.stats.peak_used_blocks, engine.blocks.num_used_blocks)
    finished = engine.scheduler.finish(current.seqs)
    if engine._inflight is not None and not any(s.status is Status.RUNNING for s in current.seqs):
        engine.runner.collect_multi(engine._inflight.ticket, 0)  # every row ended: nothing to read
        engine._inflight = None
    return finished


def chain(engine: CohortEngine, current: Launch) -> Launch | None:
    """Queue the launch after `current`, before its tokens are read, when the batch need not change in between:
    no prefill is due (nothing waits, or only continued turns the scheduler defers, which then count these
    steps), and at least MIN_LIVE_SHARE of the rows have tokens left after `current`. The other rows stay in the
    batch with a budget of 0 (they compute nothing that is kept and write only the scratch block): those that
    reach max_tokens inside `current`, and those that ended in an earlier launch. A row that stops (EOS, stop
    string) inside `current` is computed once more in vain. The blocks for both chunks must be free. Otherwise
    None: the host reads `current` and schedules afresh, which drops the ended rows from the batch."""
    steps = engine.runner.decode_steps
    scheduler = engine.scheduler
    deferring = bool(scheduler.waiting)
    if deferring and not scheduler.defers_continuations():
        return None
    budgets = []
    for seq, budget in zip(current.seqs, current.budgets):
        if seq.status is not Status.RUNNING or seq.finish_reason is not None:
            budgets.append(0)  # ended before `current`, whose tokens for it are dropped too
        else:  # tokens left once `current`'s are in (a row with budget < steps ends in `current`)
            budgets.append(max(0, min(steps, seq.max_tokens - seq.num_completion_tokens - budget)))
    live = sum(b > 0 for b in budgets)
    if live == 0 or live < MIN_LIVE_SHARE * len(budgets):
        return None
    # this launch writes KV at positions len + budget(current) - 1 .. len + budget(current) + budget - 2
    wanted = [(seq, len(seq) + b0 + b - 1) for seq, b0, b in zip(current.seqs, current.budgets, budgets) if b]
    if not scheduler.reserve_ahead(wanted):
        return None
    if deferring:
        scheduler.deferred_steps += steps
    return Launch(engine.runner.launch_multi(current.seqs, budgets, chained=True), current.seqs, budgets)
