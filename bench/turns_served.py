"""The served rows of bench/turns.py (`--served`): the same workload through a `cohort serve` subprocess.

The scripted weights and the tokenizer are saved (save_pretrained) into a temporary folder that the server
loads, so it serves exactly the model the in-process rows use. The server runs `python -m cohort.cli serve` with
the in-process engine's settings (bench/turns.py's docstring lists them and the differences), on its own port,
with an API key drawn here and handed over in its environment (COHORT_API_KEY, never on the command line); it
is killed at the end, also on an error or Ctrl-C. The rows go through `RemoteEngine` (cohort.remote.client):
`engine.generate` for single-turn, `TurnLoop.generate` for multi-turn, with sessions (the server keeps each
conversation's KV between turns) or without (every turn re-sends and re-prefills the whole conversation).
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# no commas: --only splits on them ("multi-turn: sessions" picks the first multi-turn row, "no sessions" the other)
ROW_NAMES = ("served single-turn", "served multi-turn: sessions (KV kept between turns)",
             "served multi-turn: no sessions (re-prefill every turn)")


def server_device(requested: str | None, device: str) -> str:
    """--server-device, else the second GPU when there are two or more, else the in-process device."""
    if requested:
        return requested
    import torch

    return "cuda:1" if device == "cuda" and torch.cuda.device_count() >= 2 else device


def serve_command(folder: str, args, device: str, where: str) -> tuple[list[str], dict[str, str]]:
    """The `cohort serve` command line and environment for the engine settings of bench/turns.py's engine."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false")
    extra = []
    if where.startswith("cuda"):  # the server sees one GPU, as its cuda:0 (cohort serve places replicas so)
        index = int(where.partition(":")[2] or 0)
        visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        if visible and index >= len(visible):
            raise SystemExit(f"--server-device {where}: CUDA_VISIBLE_DEVICES={','.join(visible)} names {len(visible)}")
        env["CUDA_VISIBLE_DEVICES"] = visible[index] if visible else str(index)
        where = "cuda"
    else:  # one compute thread, as the in-process engine on the CPU (torch.set_num_threads(1))
        env["OMP_NUM_THREADS"] = "1"
        extra += ["--threads", "1"]
    dtype = "bfloat16" if device == "cuda" else "float32"  # the in-process model's dtype (bench/turns.py build)
    conversations = args.prompts * args.n
    cmd = [sys.executable, "-m", "cohort.cli", "serve", folder, "--host", "127.0.0.1", "--port", "0",
           "--device", where, "--dtype", dtype, "--engine", "cohort", "--max-model-len", "1024",
           "--kv-cache-fraction", str(0.3 if device == "cuda" else 0.05),
           "--max-num-seqs", str(max(256, conversations)),
           "--max-sessions", str(max(64, conversations)),  # every conversation of a call keeps its session
           "--session-timeout-s", "3600", *extra]
    return cmd, env


class Server:
    """A `cohort serve` subprocess: started and waited for by `start`, ended by `stop`."""

    def __init__(self, cmd: list[str], env: dict[str, str], key: str) -> None:
        self.cmd, self.env, self.key = cmd, dict(env, COHORT_API_KEY=key), key
        self.proc: subprocess.Popen | None = None
        self.log: list[str] = []
        self.address = self.context = ""

    def start(self, timeout_s: float) -> None:
        """Launch and wait for its `ready on http://HOST:PORT` line (at most `timeout_s`)."""
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        lines: queue.Queue[str | None] = queue.Queue()

        def read(stream) -> None:  # always drained: a chatty server never blocks on a full pipe
            for line in stream:
                self.log.append(line)
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, args=(self.proc.stdout,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"cohort serve exited with code {self.proc.wait()} before it was ready")
            if line.startswith("cohort serve: context"):
                self.context = line.strip().removeprefix("cohort serve: ")
            found = re.search(r"ready on http://([\d.]+):(\d+)", line)
            if found:
                self.address = f"{found.group(1)}:{found.group(2)}"
                return
        raise RuntimeError(f"cohort serve was not ready within {timeout_s:.0f} s (--server-timeout)")

    def tail(self, lines: int = 40) -> str:
        return "".join(self.log[-lines:])

    def cpu_seconds(self) -> float:
        """The server process's CPU time (user + system, all threads) from /proc; 0 where there is none."""
        try:  # after the command's ")": state is field 3, utime and stime fields 14 and 15
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, AttributeError, IndexError, ValueError):
            return 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)  # its own session (start_new_session): the server alone
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@contextmanager
def served(model, tokenizer, args, device: str):
    """Save the scripted model, start a server on it, yield (Server, its device); always stop it."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed bench still stops its server
    try:
        with tempfile.TemporaryDirectory(prefix="cohort-turns-") as folder:
            from transformers.utils import logging as hf_logging

            getattr(hf_logging, "disable_progress_bar", lambda: None)()  # no "Writing model shards" bar
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            where = server_device(args.server_device, device)
            server = Server(*serve_command(folder, args, device, where), key=secrets.token_urlsafe(32))
            try:
                server.start(args.server_timeout)
                yield server, where
            except Exception:
                print(f"cohort serve's last lines:\n{server.tail()}", file=sys.stderr)
                raise
            finally:
                server.stop()  # before its model folder goes
    finally:
        signal.signal(signal.SIGTERM, previous)


def engine_stats(remote):
    """A reader of the server engine's counters (its /health "engine_stats"), for bench/turns.py's `measure`."""
    def read() -> dict:
        return remote.client.request("GET", "/health", phase="engine counters")["engine_stats"]
    return read


def served_modes(server: Server, tok, tools, parser, ids, convs, params):
    """(name, fn, engine) of each served row: RemoteEngine clients with and without sessions."""
    from cohort.agents.rollout_loop import TurnLoop
    from cohort.remote.client import RemoteEngine

    with_sessions = RemoteEngine(server.address, api_key=server.key, connect_timeout_s=30.0)
    plain = RemoteEngine(server.address, api_key=server.key, connect_timeout_s=30.0, use_sessions=False)
    if not with_sessions.use_sessions:
        raise RuntimeError(f"{with_sessions.engine_name()} keeps no sessions (its /health says so)")

    def multi(remote):
        def run():
            loop = TurnLoop(tok, tools, max_iterations=3, parser=parser)
            return loop.generate(remote, ids, params, prompts=convs)
        return run

    single, sessions, resend = ROW_NAMES
    return [(single, lambda: plain.generate(ids, params), plain),
            (sessions, multi(with_sessions), with_sessions),
            (resend, multi(plain), plain)]
