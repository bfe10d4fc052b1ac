"""Prompt data: sources -> `PromptDataset` rows -> token ids (`encode`) -> a resumable per-step order.

    ds = load_prompt_dataset("reasoning_gym:chain_sum", size=1000, seed=1, conversational=True)
    ds = ds.encode(tokenizer, max_prompt_length=256, truncation="left")   # ds.stats counts truncated/dropped
    sampler = PromptSampler(len(ds), prompts_per_step=8, seed=0)
    batch = ds.batch(sampler.next_indices()).repeat(num_generations)      # prompts, prompt_ids, columns
"""

from cohort.data.dataset import EncodeStats, PromptBatch, PromptDataset, is_conversational, prompt_key
from cohort.data.sampler import PromptSampler, drop_overlap, reasoning_gym_eval_set, train_eval_split
from cohort.data.sources import check_text, import_object, load_prompt_dataset, reasoning_gym_rows

__all__ = [
    "EncodeStats",
    "PromptBatch",
    "PromptDataset",
    "PromptSampler",
    "check_text",
    "drop_overlap",
    "import_object",
    "is_conversational",
    "load_prompt_dataset",
    "prompt_key",
    "reasoning_gym_eval_set",
    "reasoning_gym_rows",
    "train_eval_split",
]
