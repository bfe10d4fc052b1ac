"""Rewards: TRL's reward-function contract, combination of several functions, built-ins, reward models.

    runner = RewardRunner(["reasoning_gym", "answer_format"], weights=[1.0, 0.2], on_error="skip")
    result = runner(prompts, completions, completion_ids, columns=batch.columns, trainer_state=state)
    result.rewards  # [N, F], NaN where not applicable;  result.total  # [N];  result.metrics()
"""

from cohort.rewards.builtins import (
    accuracy,
    answer_format,
    answer_number,
    cosine_scaled_length,
    extract_numeric_answer,
    last_number,
    math_correct,
    number_line_format,
    soft_overlong_punishment,
    think_answer_format,
    think_format,
)
from cohort.rewards.combination import RewardRunner
from cohort.rewards.grouping import filter_zero_std_groups
from cohort.rewards.protocol import (
    AllNoneRewardsError,
    RewardError,
    RewardFunc,
    RewardResult,
    completion_text,
    reward_name,
)
from cohort.rewards.reasoning_gym import extract_answer, reasoning_gym_score
from cohort.rewards.registry import builtin_names, get_reward_function
from cohort.rewards.reward_model import RewardModel

__all__ = [
    "AllNoneRewardsError",
    "RewardError",
    "RewardFunc",
    "RewardModel",
    "RewardResult",
    "RewardRunner",
    "accuracy",
    "answer_format",
    "answer_number",
    "builtin_names",
    "completion_text",
    "cosine_scaled_length",
    "extract_answer",
    "extract_numeric_answer",
    "filter_zero_std_groups",
    "get_reward_function",
    "last_number",
    "math_correct",
    "number_line_format",
    "reasoning_gym_score",
    "reward_name",
    "soft_overlong_punishment",
    "think_answer_format",
    "think_format",
]
