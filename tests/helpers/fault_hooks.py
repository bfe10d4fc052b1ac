"""Kill points for the fault-injection tests (tests/integration/test_kill_resume.py), test code only.

A training child names `tests.helpers.fault_hooks:digit_share` as its reward function, so this module is
imported inside it while it builds its components. When the environment variable COHORT_TEST_KILL is set to
"<point>:<step>", importing it patches cohort so that the process SIGKILLs itself at that point of that step:

    generate        while the step's completions are scored (inside the reward function)
    update          after the update's backward passes, before optimizer.step()
    save_write      mid-save: the checkpoint's files are written into its temporary folder, optimizer.pt
                    only half, and the process dies before the folder is renamed into place
    save_publish    mid-save: the folder is renamed into place, but `latest` still names the previous one
    after_save      right after the step's checkpoint is complete

Without COHORT_TEST_KILL it is the plain toy reward, so a reference run logs the same metric names.
"""

from __future__ import annotations

import os
import signal

from tests.helpers.toy_task import digit_share as _digit_share

POINTS = ("generate", "update", "save_write", "save_publish", "after_save")
_SPEC = os.environ.get("COHORT_TEST_KILL", "")
POINT, _, _STEP = _SPEC.partition(":")
STEP = int(_STEP) if _STEP else -1


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def digit_share(completions, digit, trainer_state=None, **kwargs):
    if POINT == "generate" and trainer_state is not None and trainer_state.global_step == STEP:
        _die()
    return _digit_share(completions, digit)


def _saving_step(path) -> int:
    """The step of a checkpoint folder or of its temporary (`.tmp-step-000003-ab12cd34`)."""
    name = os.path.basename(os.fspath(path)).removeprefix(".tmp-")
    return int(name.split("-")[1]) if name.startswith("step-") else -1


def _install() -> None:
    from cohort import checkpointing, trainer, update
    from cohort.checkpointing import atomic, saving

    if POINT == "update":
        real_clip = update.PolicyUpdater._reduce_and_clip

        def reduce_and_clip(self):
            norm = real_clip(self)
            if self.step == STEP:
                _die()
            return norm

        update.PolicyUpdater._reduce_and_clip = reduce_and_clip
    elif POINT == "save_write":
        real_write = saving._write_contents

        def write_contents(directory, *args, **kwargs):
            real_write(directory, *args, **kwargs)
            if _saving_step(directory) == STEP:
                optimizer = directory / checkpointing.OPTIMIZER_FILE
                with open(optimizer, "r+b") as f:
                    f.truncate(f.seek(0, 2) // 2)
                _die()

        saving._write_contents = write_contents
    elif POINT == "save_publish":
        real_move = atomic._move_into_place

        def move_into_place(tmp, final):
            real_move(tmp, final)
            if _saving_step(final) == STEP:
                _die()

        atomic._move_into_place = move_into_place
    elif POINT == "after_save":
        real_save = trainer._save

        def save(cfg, comp, run_dir, step, *args, **kwargs):
            path = real_save(cfg, comp, run_dir, step, *args, **kwargs)
            if step == STEP:
                _die()
            return path

        trainer._save = save


if POINT:
    if POINT not in POINTS:
        raise ValueError(f"COHORT_TEST_KILL={_SPEC!r}: the point must be one of {POINTS}")
    _install()
