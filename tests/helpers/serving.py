"""Start `cohort serve` in a subprocess on the CPU for tests, and stop it.

Every server of a test session gets one API key, `API_KEY`, and this process's environment holds it as
COHORT_API_KEY: clients made here (RemoteEngine, a trainer's engine built by setup) and the processes the tests
start (trainer ranks, TrainerProcess) read it from there, as `cohort train` does.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from cohort.remote.client import API_KEY_ENV

ROOT = Path(__file__).resolve().parents[2]
API_KEY = os.environ.setdefault(API_KEY_ENV, f"cohort-tests-{secrets.token_hex(16)}")


class ServerProcess:
    """`api_key`: the key the server is given (COHORT_API_KEY in its environment); None lets it draw and print
    one (read back into `self.api_key`)."""

    def __init__(self, model_dir, *extra: str, port: int = 0, timeout_s: float = 120.0, device: str = "cpu",
                 env: dict | None = None, api_key: str | None = API_KEY) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                   TOKENIZERS_PARALLELISM="false", **(env or {}))
        env.pop(API_KEY_ENV, None)
        if api_key is not None:
            env[API_KEY_ENV] = api_key
        self.api_key = api_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cohort.cli", "serve", str(model_dir), "--port", str(port), "--device", device,
             "--group-timeout-s", "20", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        self.log: list[str] = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.log.append(line)
            generated = re.search(r"API key \(generated\): (\S+)", line)
            if generated:
                self.api_key = generated.group(1)
            found = re.search(r"ready on http://([\d.]+):(\d+)", line)
            if found:
                self.host, self.port = found.group(1), int(found.group(2))
                # keep reading, so a chatty server never blocks on a full pipe
                threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()
                return
        self.kill()
        raise RuntimeError("cohort serve did not start:\n" + "".join(self.log))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What an authenticated request sends."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, timeout_s: float = 30.0) -> dict:
        """GET `path` with the server's key (e.g. /health); the JSON answer."""
        req = urllib.request.Request(f"http://{self.address}{path}", headers=self.headers)
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
