"""The same script, run with `trl` and with `cohort` (only the import differs), on a tiny model on the CPU.

Both log the same metric names (cohort's rows hold TRL's and a few more). Sampling differs between the two, so
the first step's loss is compared where it does not depend on the samples: every completion runs to
max_completion_length (a random model that never says EOS), the step is on-policy (ratio 1), so TRL's dapo loss
-sum_i A_i |o_i| / sum_i |o_i| is -mean(A) = 0 for group-normalised advantages whatever the rewards; both must
log 0 within 1e-6. The loss on identical inputs is checked for every loss type in tests/unit/test_trl_crosscheck.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from tests.helpers.toy_task import digit_share, toy_rows, write_toy_workspace
from transformers import TrainerCallback

trl = pytest.importorskip("trl", reason="needs TRL: pip install trl==1.16.0")
datasets = pytest.importorskip("datasets", reason="needs datasets: pip install datasets")


def reward_len(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _script(GRPOConfig, GRPOTrainer, model_dir, out):
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                      max_steps=2, logging_steps=1, learning_rate=1e-4, use_cpu=True, bf16=False, seed=0,
                      gradient_checkpointing=False, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=reward_len, args=args,
                          train_dataset=datasets.Dataset.from_list(toy_rows(1)))
    trainer.train()
    return [row for row in trainer.state.log_history if "reward" in row]


def test_same_script_same_metric_names_and_first_loss(tmp_path):
    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    theirs = _script(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl")
    ours = _script(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort")
    assert len(theirs) == len(ours) == 2
    missing = set(theirs[0]) - set(ours[0])
    assert not missing, f"TRL logs {sorted(missing)}, cohort does not"
    assert [r["step"] for r in theirs] == [r["step"] for r in ours] == [1, 2]
    assert theirs[0]["completions/mean_length"] == ours[0]["completions/mean_length"] == 8  # no EOS: all run out
    assert abs(theirs[0]["loss"]) < 1e-6 and abs(ours[0]["loss"]) < 1e-6
    assert theirs[0]["learning_rate"] == pytest.approx(ours[0]["learning_rate"])  # linear decay, same schedule
    assert theirs[1]["epoch"] == pytest.approx(ours[1]["epoch"])


# ------------------------------------------------------------------------ the same completions in both
# Both trainers get the same completion tokens: TRL's `_generate_single_turn` (its generation step in 1.16) and
# cohort's rollout engine are replaced by one table of fixed completions, keyed by the prompt's digit. With the
# same model, prompts and completions, the first step's loss, gradient norm and every metric computed from them
# must agree. Tolerance: 1e-4 relative, 1e-6 absolute for values near 0 (float32 on the CPU: the two sum the same
# terms in a different order, and cohort's importance-sampling correction sees the fixed engine's logprobs,
# recomputed here, as a ratio of 1 +- 1e-6; measured: loss 5e-6, grad_norm 5e-7 relative apart).
REL, ABS = 1e-4, 1e-6
_TEXTS = ["{d}{d}{d}{d}", "{d} and {d}", "no digit here", "{d}"]  # completion j of each group
_ENDS = [True, False, True, False]  # ends with EOS (stop) or runs to max_completion_length (truncated)


def _fixed_completion(tok, prompt_ids: list[int], j: int, limit: int) -> list[int]:
    digit = next(ch for ch in tok.decode(prompt_ids) if ch.isdigit())
    ids = tok(_TEXTS[j].format(d=digit), add_special_tokens=False)["input_ids"]
    return [*ids, tok.eos_token_id][:limit] if _ENDS[j] else (ids * limit)[:limit]


class _FixedEngine:
    """cohort's rollout engine seam: the fixed completions, with the policy's own logprobs (a sampler that
    happened to draw exactly these tokens)."""

    def __init__(self, inner, policy, tok, limit: int, seen: list):
        self.inner, self.policy, self.tok, self.limit, self.seen = inner, policy, tok, limit, seen

    def generate(self, prompts, params):
        import torch

        from cohort.types import Completion

        groups = []
        for p in prompts:
            self.seen.extend([list(p)] * params.n)
            group = []
            for j in range(params.n):
                ids = _fixed_completion(self.tok, list(p), j, self.limit)
                device = next(self.policy.parameters()).device
                with torch.no_grad():
                    logits = self.policy(torch.tensor([list(p) + ids], device=device)).logits[0, len(p) - 1:-1]
                logp = logits.float().log_softmax(-1).gather(-1, torch.tensor(ids, device=device)[:, None])[:, 0]
                logp = logp.tolist()
                group.append(Completion(ids, logp, "stop" if ids[-1] == self.tok.eos_token_id else "length"))
            groups.append(group)
        return groups

    def sync_weights(self):
        self.inner.sync_weights()


def _fixed_script(GRPOConfig, GRPOTrainer, model_dir, out, seen, **kw):
    import cohort

    limit = 8
    kw = {"use_cpu": True, "bf16": False, **kw}  # tests/gpu/test_trl_facade_gpu.py runs it on CUDA too
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=limit, max_steps=1, logging_steps=1, learning_rate=1e-4, seed=0,
                      gradient_checkpointing=False, report_to="none", save_strategy="no", **kw)
    rows = [{"prompt": "Say the digit 3 many times", "digit": "3"},
            {"prompt": "Say the digit 7 many times", "digit": "7"}]  # one step takes both, in either order
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digit_share, args=args,
                          train_dataset=datasets.Dataset.from_list(rows))
    if GRPOTrainer is cohort.GRPOTrainer:
        trainer._comp = trainer._components()
        trainer._comp = dataclasses.replace(trainer._comp, engine=_FixedEngine(
            trainer._comp.engine, trainer._comp.policy, trainer.processing_class, limit, seen))
    else:
        tok = trainer.processing_class

        def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            seen.extend(list(p) for p in prompt_ids)
            # TRL repeats each prompt num_generations times in a row: j is the position within its group
            return [_fixed_completion(tok, list(p), i % num_generations, limit) for i, p in enumerate(prompt_ids)], None

        trainer._generate_single_turn = generate
    trainer.train()
    return trainer.state.log_history[0]


# metrics that measure time, or that cohort computes differently by design (documented in docs/trl_compat.md)
_NOT_COMPARED = {"step_time", "epoch", "step"}


@pytest.mark.parametrize("kw", [{}, {"loss_type": "grpo", "beta": 0.04}], ids=["dapo", "grpo_kl"])
def test_first_step_equal_on_the_same_completions(tmp_path, kw):
    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    seen_trl: list = []
    seen_cohort: list = []
    theirs = _fixed_script(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl", seen_trl, **kw)
    ours = _fixed_script(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort", seen_cohort, **kw)
    assert sorted(seen_trl) == sorted(seen_cohort)  # the same prompt tokens
    assert theirs["reward_std"] > 0 and theirs["grad_norm"] > 0.1  # non-trivial advantages and gradient
    if not kw:  # dapo: -sum_i A_i |o_i| / sum_i |o_i| on the first step, not 0 as lengths differ within groups
        assert abs(theirs["loss"]) > 1e-3
    missing = set(theirs) - set(ours)
    assert not missing, f"TRL logs {sorted(missing)}, cohort does not"
    differ = {k: (v, ours[k]) for k, v in theirs.items() if k not in _NOT_COMPARED
              and ours[k] != pytest.approx(v, rel=REL, abs=ABS)}
    assert not differ, f"(TRL, cohort) differ: {differ}"


# ------------------------------------------------------------------------------- callbacks, as TRL calls them
_EVENTS = ["on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_pre_optimizer_step",
           "on_optimizer_step", "on_substep_end", "on_step_end", "on_log", "on_evaluate", "on_save", "on_epoch_end",
           "on_train_end"]


class _Recorder(TrainerCallback):
    """Every callback event with the state and control it saw."""

    def __init__(self):
        self.events = []
        for name in _EVENTS:
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def record(args, state, control, **kwargs):
            self.events.append((name, state.global_step, round(state.epoch or 0.0, 6), control.should_log,
                                control.should_save, control.should_training_stop))
        return record


def _events(GRPOConfig, GRPOTrainer, model_dir, out, eval_rows=None, **kw):
    rec = _Recorder()
    args = GRPOConfig(output_dir=str(out), num_generations=4, max_completion_length=4, logging_steps=1,
                      learning_rate=1e-4, use_cpu=True, bf16=False, seed=0, gradient_checkpointing=False,
                      report_to="none", **kw)
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=digit_share, args=args, callbacks=[rec],
                          train_dataset=datasets.Dataset.from_list(toy_rows(1)),
                          eval_dataset=None if eval_rows is None else datasets.Dataset.from_list(eval_rows))
    trainer.train()
    return rec.events, [row["step"] for row in trainer.state.log_history]


def test_callbacks_are_called_as_trl_calls_them(tmp_path):
    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    # one optimiser step per generation (TRL's default split), evaluation every 2 steps and at the end: the very
    # same calls, states and flags
    kw = dict(per_device_train_batch_size=8, max_steps=3, save_steps=2, eval_strategy="steps", eval_steps=2,
              eval_rows=toy_rows(1)[:4])
    theirs, their_rows = _events(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl", **kw)
    ours, our_rows = _events(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort", **kw)
    assert ours == theirs
    assert our_rows == their_rows == [1, 2, 2, 3, 3, 3]  # train rows, eval rows (steps 2 and 3), closing row


@pytest.mark.slow
def test_callbacks_with_two_optimiser_steps_per_generation_are_trls_but_logging(tmp_path):
    import cohort

    model_dir, _ = write_toy_workspace(tmp_path)
    # two optimiser steps per generation: the same calls, except that cohort logs once per generation
    kw = dict(per_device_train_batch_size=4, steps_per_generation=2, max_steps=4, save_steps=2)
    theirs, _ = _events(trl.GRPOConfig, trl.GRPOTrainer, model_dir, tmp_path / "trl2", **kw)
    ours, our_rows = _events(cohort.GRPOConfig, cohort.GRPOTrainer, model_dir, tmp_path / "cohort2", **kw)
    def no_logging(events):  # (event, global_step, epoch, should_save, should_training_stop)
        return [(e[0], *e[1:3], *e[4:]) for e in events if e[0] != "on_log"]

    assert no_logging(ours) == no_logging(theirs)
    assert [e[1] for e in ours if e[0] == "on_log"] == our_rows == [2, 4, 4]
