"""The trainer's side of `cohort serve` in a process of its own, driven one command at a time (GPU tests).

Over NCCL a push to a server that died or froze can end the trainer's process (liveness.EXIT_SERVER_LOST,
code 75) instead of raising, and a stuck collective or an NCCL teardown must never hang the test run; so
tests/gpu/test_serving_gpu.py runs the trainer (policy on cuda:0, a RemoteEngine, an in-process CohortEngine
on the same weights) here and kills, freezes and restarts servers itself between commands.

    python -m tests.helpers.serving_trainer MODEL_DIR      (from the repo root; `TrainerProcess` starts it)

stdin: one JSON command per line, `{"op": ..., "timeout_s": ..., **arguments}`; stdout: one JSON answer per
command (anything else the process prints goes to stderr). A command still running after its `timeout_s`
dumps every thread's stack to stderr and ends the process (faulthandler): a hang shows where it hangs.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

from tests.helpers.serving import API_KEY

from cohort.cli import _exit_now_if_nccl_aborted  # imported up front: nothing is imported at exit
from cohort.remote.client import API_KEY_ENV

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("Say the digit 3", "What is 2 + 3?")


class TrainerProcess:
    """Test side: start the worker, send commands, read answers (None: the process ended without one)."""

    def __init__(self, model_dir, env: dict | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                                            os.environ.get("PYTHONPATH", "")]),
               "TOKENIZERS_PARALLELISM": "false", API_KEY_ENV: API_KEY, **(env or {})}  # API_KEY: the servers' key
        env.setdefault("NCCL_DEBUG", "WARN")  # NCCL's own view in stderr, should a test fail
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.serving_trainer", str(model_dir)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self._answers: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read_answers, daemon=True).start()
        self._stderr_reader = threading.Thread(target=lambda: self._stderr.extend(self.proc.stderr), daemon=True)
        self._stderr_reader.start()

    def _read_answers(self) -> None:
        for line in self.proc.stdout:
            self._answers.put(line)
        self._answers.put(None)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def call(self, op: str, timeout_s: float, **args) -> dict | None:
        """The answer to `op`, or None when the process ended before answering (see `proc.returncode` and
        `stderr`). Raises AssertionError when the worker failed unexpectedly or gave no answer in time."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": op, "timeout_s": timeout_s, **args}) + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # it just ended: the answer below is None
        try:
            # the worker's own faulthandler ends it after timeout_s; the margin covers its stack dump
            line = self._answers.get(timeout=timeout_s + 30)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"the trainer process gave no answer to {op!r} within {timeout_s + 30:.0f} s; "
                                 f"stderr:\n{self.stderr[-8000:]}") from None
        if line is None:
            self.proc.wait(30)
            self._stderr_reader.join(10)  # the last lines of a process that ended
            return None
        answer = json.loads(line)
        if "crash" in answer:
            raise AssertionError(f"the trainer process failed in {op!r}:\n{answer['crash']}\nstderr:\n"
                                 f"{self.stderr[-4000:]}")
        return answer

    def ask(self, op: str, timeout_s: float, **args) -> dict:
        """`call`, where the process ending without an answer fails the test (with its exit code and stderr)."""
        answer = self.call(op, timeout_s, **args)
        if answer is None:
            raise AssertionError(f"the trainer process ended during {op!r} with exit code {self.proc.returncode}; "
                                 f"stderr:\n{self.stderr[-8000:]}")
        return answer

    def exit(self, timeout_s: float = 60.0) -> int:
        """Ask the worker to exit normally; its exit code (a teardown that hangs fails the test)."""
        self.ask("exit", timeout_s)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the trainer process did not exit within {timeout_s:.0f} s of being asked; "
                                 f"stderr:\n{self.stderr[-8000:]}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


# ---------------------------------------------------------------------------------------------------------
# The worker


class _Trainer:
    def __init__(self, model_dir: str) -> None:
        import torch

        from cohort.policy.model import load_policy

        _, self.tok = load_policy(model_dir, dtype=torch.bfloat16)
        self.policy = None
        self.remote = None
        self.local = None

    def connect(self, address: str, seed: int, server_timeout_s: float, connect_timeout_s: float,
                liveness_timeout_s: float, bucket_bytes: int, device: str = "cuda:0",
                dtype: str = "bfloat16") -> dict:
        """A policy on `device` in `dtype` (the server's: bfloat16 on a GPU) and a RemoteEngine: the first push
        is version 0."""
        import torch
        from tests.helpers.toy_task import tiny_model

        from cohort.serving import RemoteEngine

        self.policy = tiny_model(self.tok, seed=seed).to(device=device, dtype=getattr(torch, dtype))
        self.remote = RemoteEngine(address, self.policy, timeout_s=server_timeout_s,
                                   connect_timeout_s=connect_timeout_s, liveness_timeout_s=liveness_timeout_s,
                                   bucket_bytes=bucket_bytes)
        health = self.remote.client.request("GET", "/health", phase="test")
        return {"buckets": self.remote.last_push["buckets"], "backend": health["backend"],
                "version": self.remote.version}

    def perturb(self, seed: int) -> dict:
        """An optimizer step's worth of change to the policy (the next sync pushes it)."""
        import torch

        torch.manual_seed(seed)
        with torch.no_grad():
            for p in self.policy.parameters():
                p.add_(0.1 * torch.randn_like(p))
        return {}

    def sync(self) -> dict:
        """remote.sync_weights(); a ServerUnavailable is an answer (error, seconds), not a failure."""
        import time

        from cohort.serving import ServerUnavailable

        started = time.monotonic()
        try:
            self.remote.sync_weights()
        except ServerUnavailable as exc:
            return {"error": str(exc), "seconds": time.monotonic() - started, "version": self.remote.version,
                    "group_dropped": self.remote._group is None}
        return {"error": None, "seconds": time.monotonic() - started, "version": self.remote.version}

    def generate(self) -> dict:
        """Greedy completions of PROMPTS from the server and from an in-process engine on the same weights."""
        from cohort.engine import CohortEngine
        from cohort.setup.engine import eos_ids
        from cohort.types import SamplingParams

        prompts = [self.tok(t)["input_ids"] for t in PROMPTS]
        params = SamplingParams(n=2, max_tokens=16, temperature=0.0)
        served = self.remote.generate(prompts, params)  # may find a restarted server and re-push first
        if self.local is None:  # eager, like the test's servers: one code path on both sides
            self.local = CohortEngine(self.policy, self.tok, eos_token_ids=eos_ids(self.tok, self.policy),
                                      kv_cache_fraction=0.05, max_num_seqs=16, enforce_eager=True)
        self.local.sync_weights()  # the fused copies follow the perturbed weights
        local = self.local.generate(prompts, params)
        return {"served": [c.token_ids for g in served for c in g], "local": [c.token_ids for g in local for c in g],
                "versions": sorted({c.version for g in served for c in g}), "remote_version": self.remote.version}

    def exit(self) -> dict:
        return {}


def main(model_dir: str) -> None:
    import faulthandler
    import traceback

    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the answers' own channel
    os.dup2(2, 1)  # whatever else prints to stdout goes to stderr
    sys.stdout = sys.stderr
    trainer = _Trainer(model_dir)
    for line in sys.stdin:
        command = json.loads(line)
        op, timeout_s = command.pop("op"), float(command.pop("timeout_s"))
        faulthandler.dump_traceback_later(timeout_s, exit=True)
        try:
            answer = getattr(trainer, op)(**command)
        except Exception:
            answer = {"crash": traceback.format_exc()}
        faulthandler.cancel_dump_traceback_later()
        answers.write(json.dumps(answer) + "\n")
        if op == "exit":
            break
    # as the CLI leaves after an error: os._exit(75) once an NCCL weight group was aborted (its teardown can
    # wait forever on a frozen peer), a normal exit otherwise
    _exit_now_if_nccl_aborted()


if __name__ == "__main__":
    main(sys.argv[1])
