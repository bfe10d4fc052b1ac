"""Ctrl-C in a TRL-style script: `trainer.train()` stops during generation, prints the CLI's message with the
facade's way to continue (the newest checkpoint, `trainer.train(resume_from_checkpoint=True)`), and raises
KeyboardInterrupt as Python does. A real SIGINT to a real process, sent while the engine samples step 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("datasets", reason="needs datasets: pip install datasets")
ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import sys
    from pathlib import Path

    from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
    from tests.helpers.toy_task import digit_share, tiny_model, toy_rows

    from cohort import GRPOConfig, GRPOTrainer
    from cohort.engine.engine import CohortEngine

    out, marker = Path(sys.argv[1]), Path(sys.argv[2])
    calls = []
    sample = CohortEngine.generate

    def generate(self, *args, **kwargs):  # step 2's generation tells the test to press Ctrl-C, and lasts
        calls.append(1)
        if len(calls) == 2:
            marker.write_text("generating")
            for _ in range(20000):  # a long generation: the engine's real work, many times over
                sample(self, *args, **kwargs)
        return sample(self, *args, **kwargs)

    CohortEngine.generate = generate
    tok = make_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4, max_steps=50,
                      max_completion_length=200, generation_kwargs={"ignore_eos": True}, learning_rate=1e-3,
                      use_cpu=True, save_steps=1, report_to="none", gradient_checkpointing=False)
    trainer = GRPOTrainer(model=tiny_model(tok), reward_funcs=digit_share, args=args, train_dataset=toy_rows(),
                          processing_class=tok)
    trainer.train()
''')


def test_ctrl_c_during_generation_stops_with_the_resume_call(tmp_path):
    marker, out = tmp_path / "marker", tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(marker)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(4800):  # up to 4 minutes for step 1 and the start of step 2
            if marker.exists():
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        else:
            pytest.fail("step 2 never started generating")
        time.sleep(0.5)  # well inside step 2's generation
        proc.send_signal(signal.SIGINT)
        # step 2's generation alone would run for hours (20,000 generate calls): ending within three minutes is
        # Ctrl-C's doing; a minute was too short on a loaded 2-core CI machine (seen once)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    step1 = out / "checkpoints" / "step-000001"
    assert f"cohort: interrupted. The newest checkpoint is {step1}; continue from it with:" in err, err[-3000:]
    assert "trainer.train(resume_from_checkpoint=True)" in err
    assert not (out / "checkpoints" / "step-000002").exists()
