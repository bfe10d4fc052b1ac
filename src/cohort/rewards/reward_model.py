"""A learned reward model (a sequence-classification model on disk) as a reward function.

`RewardModel(path)` loads `AutoModelForSequenceClassification` and its tokenizer from a local folder and
scores prompt + completion in batches, returning the first logit of each (as TRL does). Conversational
samples go through the reward model's own chat template; standard ones are concatenated text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from cohort.errors import ConfigError
from cohort.rewards.protocol import completion_text


class RewardModel:
    """Score completions with a sequence-classification model; `name` is the folder's name.

    batch_size: samples per forward pass. max_length: truncate longer inputs from the left (keeping the
    completion's end) when set. device/dtype: where and how to run it (default: CPU, the saved dtype).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        batch_size: int = 16,
        max_length: int | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ):
        path = Path(path)
        if not (path / "config.json").exists():
            raise ConfigError(
                f"Reward model path {str(path)!r} has no config.json; give a folder saved with "
                "save_pretrained (a sequence-classification model and its tokenizer)."
            )
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).eval()
        if device is not None:
            self.model.to(device)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # The model finds each row's last real token through pad_token_id; it must be set to batch.
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.max_length = max_length
        self.name = path.name or "reward_model"
        self.__name__ = self.name

    def texts(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        out: list[str] = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):
                messages = list(p) + (list(c) if isinstance(c, list) else [{"role": "assistant", "content": c}])
                out.append(str(self.tokenizer.apply_chat_template(messages, tokenize=False)))  # tokenize=False: text
            else:
                out.append(str(p) + completion_text(c))
        return out

    @torch.inference_mode()
    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        scores: list[float] = []
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=self.max_length is not None,
                max_length=self.max_length,
                add_special_tokens=False,
            ).to(device)
            logits = self.model(**enc).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores
