"""The served engine: R engine replicas, the policy version, weight pushes into a staging copy.

`EngineServer` knows nothing of HTTP (http.py exposes it). Its invariants:
- every generation request runs under a shared (read) lock and reports the one version it was served with;
- a weight push lands in a staging copy while generation goes on; `commit` takes the exclusive (write) lock,
  copies the staging tensors into every replica, refreshes the engines' fused copies and bumps the version,
  so no request ever sees a half-updated model;
- a push whose names, shapes or dtypes differ from the served model is refused before any byte moves.
"""

from __future__ import annotations

import dataclasses
import math
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cohort.errors import CohortError
from cohort.remote import weights as W
from cohort.serving.coalesce import Coalescer
from cohort.types import Completion, SamplingParams


def _offset(params: SamplingParams, start: int) -> SamplingParams:
    """`params` for a chunk of prompts starting at `start`: its seeds as one engine would draw them there."""
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + start * params.n)


class StaleVersion(CohortError):
    """A request asked for a policy version the server has not received within its wait."""


class RWLock:
    """Many readers or one writer; a waiting writer blocks new readers (a commit is never starved)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    def acquire_read(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def acquire_write(self) -> None:
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    def writer_waiting(self) -> bool:
        with self._cond:
            return self._writer or self._writers_waiting > 0


@dataclass
class Replica:
    model: torch.nn.Module
    engine: Any
    device: torch.device
    lock: threading.Lock  # one generate at a time per engine (engines are not thread-safe)


@dataclass
class _Push:
    version: int
    specs: list[W.TensorSpec]
    thread: threading.Thread
    staged: dict[str, torch.Tensor] | None = None
    error: BaseException | None = None
    started: float = 0.0
    session: str | None = None


class EngineServer:
    def __init__(self, replicas: Sequence[Replica], tokenizer, *, model_name: str, host: str = "127.0.0.1",
                 group_timeout_s: float = 120.0) -> None:
        if not replicas:
            raise ValueError("a server needs at least one engine replica")
        self.replicas = list(replicas)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host = host
        self.group_timeout_s = group_timeout_s
        self.server_id = uuid.uuid4().hex
        self.version = 0  # 0: the weights as loaded; a push sets the trainer's version number
        self.pushed = False
        self.session: str | None = None  # the training run whose weights are served (its ranks share it)
        self._lock = RWLock()
        self._version_cond = threading.Condition()
        self._group = None
        self._group_error: BaseException | None = None
        self._group_thread: threading.Thread | None = None
        self._push: _Push | None = None
        self._admin = threading.Lock()  # one weight operation at a time
        self.specs = W.manifest_of(W.model_tensors(self.replicas[0].model))
        self.castable = W.buffer_names(self.replicas[0].model)  # buffers: a push may send another float dtype
        self.backend = "nccl" if self.replicas[0].device.type == "cuda" else "gloo"
        self._group_backend = self.backend  # the open group's: gloo for a trainer on one of our GPUs
        self._gpus = {W.gpu_uuid(r.device) for r in self.replicas} - {None}
        self._said_shared_gpu = False
        self._pool = ThreadPoolExecutor(len(self.replicas)) if len(self.replicas) > 1 else None
        # concurrent requests (a data-parallel trainer's ranks) decode as one batch: serving/coalesce.py
        self._coalescer = Coalescer(self._generate)
        self.sessions: Any = None  # a SessionTable when the engine keeps KV between turns (serving/sessions.py)

    # ---- generation --------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams], *,
                 min_version: int | None = None, wait_s: float = 0.0,
                 session: str | None = None) -> tuple[list[list[Completion]], int]:
        """Completions of every prompt, all sampled with one version (returned), after `wait_version`."""
        self.wait_version(min_version, wait_s, session)
        self._lock.acquire_read()
        try:
            version = self.version  # fixed while this request holds the read lock (its batch runs meanwhile)
            return self._coalescer.run(list(prompts), params), version
        finally:
            self._lock.release_read()

    def wait_version(self, min_version: int | None = None, wait_s: float = 0.0, session: str | None = None) -> None:
        """With `min_version`, wait up to `wait_s` for a push of at least that version (by the run `session`,
        when given), else raise StaleVersion."""
        if not (math.isfinite(wait_s) and wait_s >= 0):  # a NaN wait spins for ever, an infinite one holds for ever
            raise ValueError(f"wait_s={wait_s!r} must be a finite number of seconds >= 0")
        if min_version is None:
            return

        def ready() -> bool:
            return self.pushed and session in (None, self.session) and self.version >= min_version

        with self._version_cond:
            if not self._version_cond.wait_for(ready, wait_s):
                state = (f"pushed by run {self.session}" if self.pushed else "as loaded, no push yet")
                raise StaleVersion(f"the server holds version {self.version} ({state}), the request needs "
                                   f"{min_version} from run {session}; no such push arrived within {wait_s:.0f} s")

    # the session turns' driver (serving/session_driver.py) holds the version while turns are in flight
    def hold_version(self) -> int:
        """Take the read lock (no commit until `release_version`) and return the version it holds."""
        self._lock.acquire_read()
        return self.version

    def release_version(self) -> None:
        self._lock.release_read()

    def commit_waiting(self) -> bool:
        """Whether a weight commit waits for the read lock (the driver then admits no new turn)."""
        return self._lock.writer_waiting()

    def _generate(self, prompts: list, params: list[SamplingParams]) -> list[list[Completion]]:
        """One batch (the coalescer's, one SamplingParams per prompt), its prompts split in contiguous chunks over
        the replicas; a chunk starting at prompt `start` offsets each prompt's seed by start * n, so the result
        equals one engine's (completion j of prompt i: seed + i * n + j)."""
        r = min(len(self.replicas), max(1, len(prompts)))
        if r == 1:
            return self._run(self.replicas[0], prompts, params)
        size = -(-len(prompts) // r)
        pool = self._pool
        assert pool is not None  # made for more than one replica
        jobs = []
        for k, start in enumerate(range(0, len(prompts), size)):
            chunk_params = [_offset(p, start) for p in params[start:start + size]]
            jobs.append(pool.submit(self._run, self.replicas[k], prompts[start:start + size], chunk_params))
        return [group for job in jobs for group in job.result()]

    @staticmethod
    def _run(replica: Replica, prompts: list, params: list[SamplingParams]) -> list[list[Completion]]:
        with replica.lock:
            return replica.engine.generate(prompts, params)

    # ---- weights -----------------------------------------------------------------------------------
    def weights_init(self, trainer_gpu: str | None = None) -> dict:
        """Open a weight group: a TCPStore on a free port of the server's host (announced) and, in the background,
        the group the trainer joins as rank 0, its keys under a prefix drawn now (announced to the caller only,
        who passed the HTTP authentication). A second init replaces the first (a trainer that reconnects).
        `trainer_gpu`: the UUID of the trainer's GPU; when it is one of the server's, the group is gloo (weights
        through host memory), because NCCL refuses two ranks on one GPU."""
        with self._admin:
            backend = self._backend_for(trainer_gpu)
            store = W.host_store(self.host, self.group_timeout_s)
            prefix = f"{W.DEFAULT_PREFIX}/{secrets.token_hex(16)}"
            self._group, self._group_error, self._push = None, None, None
            self._group_backend = backend

            def join() -> None:
                try:
                    self._group = W.make_group(self.host, store.port, 1, backend=backend,
                                               timeout_s=self.group_timeout_s, store=store, prefix=prefix,
                                               bind_host=self.host)
                except BaseException as exc:  # reported to the next begin
                    self._group_error = exc

            self._group_thread = threading.Thread(target=join, name="cohort-weight-group", daemon=True)
            self._group_thread.start()
            return {"port": store.port, "backend": backend, "rank": 0, "world_size": 2,
                    "timeout_s": self.group_timeout_s, "prefix": prefix}

    def _backend_for(self, trainer_gpu: str | None) -> str:
        if self.backend != "nccl" or trainer_gpu is None or trainer_gpu not in self._gpus:
            return self.backend
        if not self._said_shared_gpu:  # said once: every reconnect of the same trainer would repeat it
            self._said_shared_gpu = True
            print("cohort serve: the trainer runs on one of this server's GPUs; weights travel over gloo through "
                  "host memory (NCCL cannot put both ends on one GPU), slower than NCCL: serve from another GPU "
                  "for the fast path", flush=True)
        return "gloo"

    def weights_begin(self, version: int, manifest: Sequence, plan: Sequence[Sequence[int]],
                      session: str | None = None) -> dict:
        """Check the announced manifest and plan, then receive the buckets into staging in the background."""
        with self._admin:
            specs = [W.TensorSpec.from_json(item) for item in manifest]
            W.check_manifest(specs, self.specs, self.castable)
            W.check_plan(plan, len(specs))
            group = self._joined_group()
            push = _Push(version=int(version), specs=specs, thread=threading.Thread(), started=time.perf_counter(),
                         session=session)
            # a gloo group receives into host memory; _apply copies it onto the replicas' devices
            device = self.replicas[0].device if self._group_backend == "nccl" else torch.device("cpu")

            def receive() -> None:
                try:
                    push.staged = W.receive_buckets(group, specs, plan, device, _fault_hook(push.version))
                except BaseException as exc:
                    push.error = exc

            push.thread = threading.Thread(target=receive, name="cohort-weight-receive", daemon=True)
            self._push = push
            push.thread.start()
            return {"buckets": len(plan), "tensors": len(specs)}

    def _joined_group(self):
        if self._group_thread is None:
            raise CohortError("weight push before /weights/init: open the weight group first")
        self._group_thread.join(self.group_timeout_s)
        if self._group_error is not None:
            raise CohortError(f"the weight group did not form: {self._group_error}")
        if self._group is None:
            raise CohortError(f"the trainer did not join the weight group within {self.group_timeout_s:.0f} s")
        return self._group

    def weights_commit(self, version: int) -> dict:
        """Wait for the push's buckets, then switch every replica to it under the write lock."""
        with self._admin:
            push = self._push
            if push is None or push.version != int(version):
                raise CohortError(f"commit of version {version} without a matching /weights/begin")
            push.thread.join(self.group_timeout_s)
            self._push = None
            if push.thread.is_alive():
                raise CohortError(f"the weights of version {version} did not arrive within {self.group_timeout_s:.0f} s")
            if push.error is not None or push.staged is None:
                raise CohortError(f"receiving the weights of version {version} failed: {push.error}")
            received = time.perf_counter()
            self._lock.acquire_write()  # waits for the requests in flight (they finish on the old version)
            locked = time.perf_counter()
            try:
                self._apply(push.staged)
                with self._version_cond:
                    self.version, self.pushed, self.session = push.version, True, push.session
                    self._version_cond.notify_all()
            finally:
                self._lock.release_write()
            return {"version": self.version, "receive_s": received - push.started, "wait_s": locked - received,
                    "apply_s": time.perf_counter() - locked}

    @torch.no_grad()
    def _apply(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy the staged tensors into every replica (buffers cast to their own dtype), then let each engine
        refresh what it derives from them (fused copies, RoPE tables)."""
        for replica in self.replicas:
            for name, param in W.model_tensors(replica.model):
                param.copy_(staged[name], non_blocking=True)
            if replica.device.type == "cuda":
                torch.cuda.synchronize(replica.device)
            replica.engine.sync_weights()
            refresh = getattr(replica.engine, "refresh_buffers", None)  # engines that cache RoPE tables
            if refresh is not None:
                refresh()

    def bounds(self) -> tuple[int | None, int | None]:
        """(vocabulary size, context) of the served model: token ids below the first (the embedding's rows),
        prompt + max_tokens within the second (the engine's max_model_len; None when the engine names none)."""
        replica = self.replicas[0]
        get_embeddings = getattr(replica.model, "get_input_embeddings", None)
        vocab = getattr(get_embeddings() if get_embeddings is not None else None, "num_embeddings", None)
        config = getattr(replica.engine, "config", None)
        context = getattr(config, "max_model_len", None)
        if context is None:  # Hugging Face generate: the model's own limit
            context = getattr(getattr(replica.model, "config", None), "max_position_embeddings", None)
        return (int(vocab) if vocab else None), (int(context) if context else None)

    def health(self) -> dict:
        return {"status": "ok", "server_id": self.server_id, "version": self.version, "pushed": self.pushed,
                "session": self.session,
                "model": self.model_name, "replicas": len(self.replicas),
                "devices": [str(r.device) for r in self.replicas], "backend": self.backend,
                **(self.sessions.info() if self.sessions is not None else {"sessions": False}),
                "engine": getattr(self.replicas[0].engine, "engine_name", lambda: "hf generate")(),
                **self._engine_stats()}

    def _engine_stats(self) -> dict:
        """The first replica's counters (cohort's engine: prefill / decode steps and tokens, cumulative), so a
        benchmark compares the served engine's steps with an in-process one's; read without its lock (ints)."""
        stats = getattr(self.replicas[0].engine, "stats", None)
        if not dataclasses.is_dataclass(stats) or isinstance(stats, type):
            return {}  # Hugging Face generate counts nothing
        return {"engine_stats": dataclasses.asdict(stats)}


def _fault_hook(version: int):
    """Tests only: COHORT_SERVE_FAULT=exit_mid_push:V or stop_mid_push:V makes this server exit (code 17) or
    freeze itself (SIGSTOP) once the first bucket of version V's push has arrived: a server that dies or
    stops answering in the middle of a push, which the trainer must report by name (serving/liveness.py)."""
    kind, _, at = os.environ.get("COHORT_SERVE_FAULT", "").partition(":")
    if kind not in ("exit_mid_push", "stop_mid_push") or not at.isdigit() or int(at) != version:
        return None

    def fault(bucket: int) -> None:
        if bucket == 0:
            if kind == "exit_mid_push":
                os._exit(17)
            os.kill(os.getpid(), signal.SIGSTOP)

    return fault
