"""Start `cohort serve` in a subprocess on the CPU for tests, and stop it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class ServerProcess:
    def __init__(self, model_dir, *extra: str, port: int = 0, timeout_s: float = 120.0, device: str = "cpu",
                 env: dict | None = None) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                   TOKENIZERS_PARALLELISM="false", **(env or {}))
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

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
