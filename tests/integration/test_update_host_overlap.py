"""The update builds each micro-batch's host inputs while the GPU runs the previous forward.

Host work between two queued forwards leaves the GPU idle, so `PolicyUpdater` launches micro-batch m's forward
first, then builds m's loss inputs and micro-batch m + 1's packed row (`cohort.forward.packing.pack_row`). This checks
the order on the CPU (the same code path) and that a row built ahead is the row the forward gets.
"""

from __future__ import annotations

import pytest
from tests.integration.engine_models import tiny_model
from tests.integration.test_token_mask import _Capture, _no_timer, make_batch

import cohort.forward.packing
import cohort.update
from cohort.algorithms import build_policy_loss
from cohort.update import PolicyUpdater, UpdateSettings


@pytest.mark.parametrize("share_prompts", [False, True])
def test_next_row_is_packed_after_the_forward_is_launched(monkeypatch, share_prompts):
    events: list[tuple[str, int]] = []
    built: list[cohort.forward.packing.PackedRow] = []
    real_pack, real_pass = cohort.forward.packing.pack_row, cohort.forward.packing.packed_pass

    def pack_row(model, sequences, **kw):
        row = real_pack(model, sequences, **kw)
        built.append(row)
        events.append(("pack", len(sequences)))
        return row

    def packed_pass(model, *tensors, **kw):
        # the forward runs the row packed for it, in order
        assert tensors[0] is built[sum(kind == "forward" for kind, _ in events)].tensors[0]
        events.append(("forward", int(tensors[0].numel())))
        return real_pass(model, *tensors, **kw)

    monkeypatch.setattr(cohort.update, "pack_row", pack_row)
    monkeypatch.setattr(cohort.forward.packing, "packed_pass", packed_pass)
    model = tiny_model("llama").train()
    capture = _Capture(list(model.parameters()))
    settings = UpdateSettings(mini_batches=1, num_iterations=1, token_budget=24, temperature=1.0,
                              max_grad_norm=1e9, max_completion_length=16,
                              share_prompts=share_prompts)
    PolicyUpdater(model, capture, capture, build_policy_loss("grpo", {}), settings).update(make_batch(), _no_timer)
    kinds = [k for k, _ in events]
    forwards = kinds.count("forward")
    assert forwards >= 2, events  # the budget cuts the batch into several micro-batches
    # pack 0, then (forward m, pack m + 1) for every micro-batch but the last
    assert kinds == ["pack"] + ["forward", "pack"] * (forwards - 1) + ["forward"], events
    assert capture.grads is not None
