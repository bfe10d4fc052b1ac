"""Staleness of a step's rollouts, per token: how many versions behind the trained weights each token was sampled.

A completion's tokens carry the version that sampled them (`RolloutBatch.token_versions`; a served engine's
completion has one version for all of them, `RolloutBatch.policy_versions`). The step that trains from version v
logs, over the completion tokens the model sampled (tool results excluded):

    staleness/mean   mean of v - version(token)
    staleness/max    max of v - version(token)
"""

from __future__ import annotations

from cohort.types import RolloutBatch


def token_staleness(batch: RolloutBatch, current: int) -> dict[str, float]:
    """staleness/mean and staleness/max over the sampled tokens of `batch`, trained from version `current`;
    {} when the batch records no versions (an in-process engine sampling with the current weights).

    >>> from types import SimpleNamespace as B
    >>> token_staleness(B(token_versions=[[2, 2, 3], None], policy_versions=[2, 3], completion_ids=[[1, 2, 3], [4]],
    ...                   completion_masks=None), current=3)
    {'staleness/mean': 0.5, 'staleness/max': 1.0}
    """
    per_token = batch.token_versions or [None] * len(batch.completion_ids)
    per_completion = batch.policy_versions or [None] * len(batch.completion_ids)
    masks = batch.completion_masks or [None] * len(batch.completion_ids)
    total, count, worst = 0, 0, 0
    for ids, versions, version, mask in zip(batch.completion_ids, per_token, per_completion, masks):
        if versions is None:
            if version is None:
                continue
            versions = [version] * len(ids)
        for i, v in enumerate(versions):
            if mask is not None and not mask[i]:
                continue  # context (a tool result): no policy sampled it
            total, count = total + current - v, count + 1
            worst = current - v if count == 1 else max(worst, current - v)
    if not count:
        return {}
    return {"staleness/mean": total / count, "staleness/max": float(worst)}
