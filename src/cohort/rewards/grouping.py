"""Group-level helpers for DAPO's dynamic sampling (the trainer drives the resampling loop).

Completions are laid out group by group: rows [g * G, (g + 1) * G) are the G completions of prompt g.
"""

from __future__ import annotations

import torch


def filter_zero_std_groups(rewards: torch.Tensor, num_generations: int, atol: float = 1e-6) -> torch.Tensor:
    """Keep mask over groups: True where a group's rewards are not all equal (it carries a learning signal).

    A group whose G rewards are all equal has zero advantage under GRPO, so DAPO drops it and samples more
    prompts. NaN rewards are ignored; a group with fewer than two finite rewards is dropped.
    `1 - keep.float().mean()` is TRL's `frac_reward_zero_std`.

    >>> filter_zero_std_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), num_generations=2).tolist()
    [False, True, False]
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N] (the combined reward), got shape {tuple(rewards.shape)}.")
    if num_generations < 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards cannot be split into groups of num_generations={num_generations}."
        )
    groups = rewards.view(-1, num_generations).float()
    finite = ~torch.isnan(groups)
    hi = torch.where(finite, groups, torch.full_like(groups, -torch.inf)).amax(dim=1)
    lo = torch.where(finite, groups, torch.full_like(groups, torch.inf)).amin(dim=1)
    return (finite.sum(dim=1) >= 2) & ((hi - lo) > atol)
