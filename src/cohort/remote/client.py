"""The trainer's side of `cohort serve`: an HTTP client with timeouts, and `RemoteEngine`, a RolloutEngine whose
generate() asks the server and whose sync_weights() pushes the policy's weights to it.

Versions: the engine's `version` counts pushes. The first push (at construction) is version 0, the weights
the first step samples with; each sync_weights (after a step's optimizer update) pushes version + 1. A
generate request names the oldest version it accepts (`min_version`, by default the newest pushed, i.e.
on-policy; the pipeline of `train.max_staleness` asks for older ones), and every completion records the
version that sampled it.

Failures never hang: every request has a timeout (`generation.server_timeout_s`), every collective of the
weight group too, and a push runs under a liveness watch (liveness.py): a server that leaves /health
unanswered for `generation.server_liveness_timeout_s` mid-push ends it. A server that stops answering raises
`ServerUnavailable` naming host, port and phase. A server that went away is waited for up to
`generation.server_connect_timeout_s`; if it comes back (a restart: a new server_id), the trainer joins a new
weight group, pushes its current weights, and retries.

Authentication: every request carries `Authorization: Bearer KEY`, KEY from `api_key=` or else the environment
variable COHORT_API_KEY (the key `cohort serve` printed at start, or was given). A server that refuses it
answers 401, raised as `ServerAuthError` at once (never retried). The weight group's rendezvous keys live
under a prefix the server draws for each group and tells only an authenticated trainer (/weights/init).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence

import torch

from cohort.engine.turns_by_regeneration import generate_turns_by_regeneration
from cohort.errors import CohortError, ConfigError
from cohort.remote import weights as W
from cohort.remote.address import parse_address
from cohort.remote.errors import ServerAuthError, ServerError, ServerUnavailable, SessionGone, StaleServer
from cohort.remote.liveness import mark_nccl_aborted, run_watched
from cohort.remote.session_turns import generate_turns_in_sessions
from cohort.types import Completion, SamplingParams, TurnCallback

API_KEY_ENV = "COHORT_API_KEY"  # the shared secret of `cohort serve`, read by both sides (docs/serving.md)


def params_to_json(params: SamplingParams) -> dict:
    """SamplingParams as a /generate request carries them (the server's `params_from_json` reads them back)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}


class ServerClient:
    """HTTP to one `cohort serve`. `api_key`: the server's key; None reads COHORT_API_KEY, "" sends none."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 600.0, connect_timeout_s: float = 60.0,
                 api_key: str | None = None) -> None:
        self.host, self.port = host, port
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.api_key = os.environ.get(API_KEY_ENV, "") if api_key is None else api_key

    @property
    def where(self) -> str:
        return f"cohort server at {self.host}:{self.port}"

    def request(self, method: str, path: str, body: dict | None = None, *, phase: str,
                timeout_s: float | None = None) -> dict:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(f"http://{self.host}:{self.port}{path}", data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc, phase) from None
        except TimeoutError as exc:
            raise ServerUnavailable(f"{self.where} did not answer during {phase} within {timeout:.0f} s "
                                    "(generation.server_timeout_s); is it overloaded or stopped?") from exc
        except (urllib.error.URLError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerUnavailable(f"{self.where} did not answer during {phase}: {reason}") from exc

    def _http_error(self, exc: urllib.error.HTTPError, phase: str) -> CohortError:
        try:
            err = json.loads(exc.read()).get("error", {})
        except (ValueError, AttributeError):
            err = {}
        message = f"{self.where} refused {phase} (HTTP {exc.code}): {err.get('message', exc.reason)}"
        if exc.code == 401:
            given = "sent no key" if not self.api_key else "sent a key the server does not accept"
            return ServerAuthError(f"{message}. This client {given}: set the environment variable {API_KEY_ENV} "
                                   "to the key `cohort serve` printed at start (or was given with --api-key / "
                                   f"{API_KEY_ENV})")
        if err.get("type") == "weight_mismatch":
            return W.WeightMismatchError(message)
        if err.get("type") == "session_evicted":
            return SessionGone(message)
        if err.get("type") == "stale_version":
            return StaleServer(message, err.get("server_id"))
        return ServerError(message)

    def wait_ready(self, phase: str) -> dict:
        """/health, retried until it answers or generation.server_connect_timeout_s passes."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                # a frozen server holds each probe for its whole timeout: never past the deadline
                left = max(0.5, deadline - time.monotonic())
                return self.request("GET", "/health", phase=phase, timeout_s=min(self.timeout_s, 10.0, left))
            except ServerUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise ServerUnavailable(f"{exc}; waited {self.connect_timeout_s:.0f} s "
                                            "(generation.server_connect_timeout_s) for it to answer. Start it "
                                            "with `cohort serve MODEL --port PORT`") from None
                time.sleep(0.2)


class RemoteEngine:
    """cohort.types.RolloutEngine over a `cohort serve` process."""

    def __init__(self, address: str, policy: torch.nn.Module | None = None, *, timeout_s: float = 600.0,
                 connect_timeout_s: float = 60.0, pusher: bool = True, session: str | None = None,
                 bucket_bytes: int = W.DEFAULT_BUCKET_BYTES, liveness_timeout_s: float = 30.0,
                 api_key: str | None = None, use_sessions: bool = True) -> None:
        host, port = parse_address(address)
        self.client = ServerClient(host, port, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                                   api_key=api_key)  # None: COHORT_API_KEY
        self.liveness_timeout_s = liveness_timeout_s  # /health silent this long mid-push: the server is gone
        self.policy = policy
        self.pusher = pusher and policy is not None
        self.bucket_bytes = bucket_bytes
        # the run's id, the same on all its ranks: requests wait for this run's pushes, never another's
        self.session = session or uuid.uuid4().hex
        self.version = 0
        self.last_push: dict[str, float] = {}
        self._group: tuple | None = None  # (process group, the device its buffers live on)
        self._weights_lock = threading.RLock()
        self._version_cond = threading.Condition()
        self._local = threading.local()
        info = self.client.wait_ready("connect")
        self.server_id, self._server_engine = info["server_id"], info.get("engine", "?")
        # multi-turn on kept KV when the server keeps sessions (cohort's engine), else today's re-send
        self.use_sessions = use_sessions and bool(info.get("sessions"))
        # a prompt's n conversations opened on one prefill of it (else n sessions, each prefilling it)
        self.session_groups = bool(info.get("session_groups"))
        if self.pusher:
            self._push(phase="the initial weight push")

    # ---- RolloutEngine ----------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[Completion]]:
        """`params.n` completions per prompt from the server; `params` may be one per prompt."""
        wire = (params_to_json(params) if isinstance(params, SamplingParams)
                else [params_to_json(p) for p in params])
        body = {"prompts": [list(map(int, p)) for p in prompts], "params": wire, **self.version_fields()}
        for attempt in (0, 1):
            try:
                out = self.client.request("POST", "/generate", body, phase="generate")
            except (ServerUnavailable, StaleServer) as exc:
                if attempt:
                    raise
                self._recover("generate", exc)
                continue
            if out.get("server_id") != self.server_id and attempt == 0 and self.pusher:
                # answered by a restarted server with weights we never pushed
                self._recover("generate", StaleServer("restarted", out.get("server_id")))
                continue
            return [[Completion(c["token_ids"], c["logprobs"], c["finish_reason"], version=out["version"])
                     for c in group] for group in out["completions"]]
        raise AssertionError("unreachable")

    def version_fields(self) -> dict:
        """A generation request's version fields: the version it needs, the run's id, how long to wait."""
        return {"min_version": self._required_version(), "session": self.session if self.policy is not None else None,
                "wait_s": 0.0 if self.pusher else self.client.timeout_s}

    def generate_turns(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                       on_turn_end: TurnCallback) -> list[list[Completion]]:
        """Multi-turn (tool-calling) rollouts on the server: each later turn is generated on the conversation so
        far, every conversation of a round in one request (cohort.engine.turns_by_regeneration); a completion
        records its oldest turn's version. The tools run here, in the trainer process, as colocated. A server
        that keeps sessions continues each conversation on its kept KV instead, its next turn sent as soon as its
        own tool result is ready (remote/session_turns.py)."""
        if self.use_sessions:
            return generate_turns_in_sessions(self, prompts, params, on_turn_end)
        return generate_turns_by_regeneration(self.generate, prompts, params, on_turn_end, batched=True)

    def sync_weights(self) -> None:
        """After an optimizer step: push the policy as the next version (rank 0; other ranks only count)."""
        version = self.version + 1
        if self.pusher:
            try:
                self._push(version=version, phase="weight push")
            except ServerError as exc:  # a restarted server gets this version; a dead one: the error
                with self._weights_lock:
                    try:
                        info = self.client.wait_ready("weight push")
                    except ServerUnavailable:
                        raise exc from None  # the push's own error says what happened, and when
                    if info["server_id"] == self.server_id:
                        raise exc from None
                    self.server_id, self._group = info["server_id"], None
                    self.session_groups = bool(info.get("session_groups"))
                    self._push(version=version, phase=f"pushing version {version} to the restarted server")
        with self._version_cond:
            self.version = version
            self._version_cond.notify_all()

    def engine_name(self) -> str:
        return f"{self.client.where} ({self._server_engine})"

    # ---- versions (the pipeline of train.max_staleness) ---------------------------------------------
    @contextlib.contextmanager
    def requiring(self, version: int) -> Iterator[None]:
        """generate() in this thread accepts completions sampled with `version` or newer."""
        self._local.min_version = version
        try:
            yield
        finally:
            self._local.min_version = None

    def _required_version(self) -> int | None:
        """The thread's requirement, else the newest pushed version; None (any) for an engine without a policy
        (a client that only reads, e.g. an evaluation against a server someone else trains)."""
        required = getattr(self._local, "min_version", None)
        if required is None and self.policy is not None:
            required = self.version
        return required

    def wait_for_version(self, version: int, stop: threading.Event, poll_s: float = 0.1) -> bool:
        """Block until `version` has been pushed (True) or `stop` is set (False)."""
        with self._version_cond:
            while self.version < version:
                if stop.is_set():
                    return False
                self._version_cond.wait(poll_s)
        return True

    # ---- weights ----------------------------------------------------------------------------------
    def _push(self, *, version: int | None = None, phase: str) -> None:
        version = self.version if version is None else version
        assert self.policy is not None, "only an engine with a policy pushes"
        with self._weights_lock:
            started = time.perf_counter()
            tensors = W.model_tensors(self.policy)
            specs = W.manifest_of(tensors)
            plan = W.plan_buckets(specs, self.bucket_bytes)
            on_gpu = threading.Event()  # set once the group is NCCL: a stuck broadcast cannot be cancelled

            def push(cancelled: threading.Event) -> tuple[float, dict]:
                group, device = self._join_group(phase)
                if device.type == "cuda":
                    on_gpu.set()
                self._check_cancelled(cancelled, phase)
                self.client.request("POST", "/weights/begin", {"version": version, "plan": plan,
                                                                "session": self.session,
                                                                "manifest": [s.to_json() for s in specs]}, phase=phase)
                try:
                    # this thread's current device is cuda:0 whatever the trainer's is: name the weights' own
                    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                        W.send_buckets(group, [t for _, t in tensors], plan, device)
                except Exception as exc:  # a collective that failed or timed out: the group is gone
                    self._group = None
                    raise ServerUnavailable(f"{self.client.where}: sending the weights during {phase} failed: "
                                            f"{exc}") from exc
                sent = time.perf_counter()
                self._check_cancelled(cancelled, phase)
                return sent, self.client.request("POST", "/weights/commit", {"version": version}, phase=phase)

            try:
                sent, out = run_watched(push, self.client, phase=phase, timeout_s=self.liveness_timeout_s,
                                        abort=self._abort_group, must_return=on_gpu.is_set)
            except ServerUnavailable:
                self._group = None  # a later push joins a new group
                raise
            # send_s: pack + broadcast; wait_s: the switch waiting for requests in flight (the pipeline's next
            # step); apply_s: copying the staging tensors in; seconds: all of it, as the trainer waited
            self.last_push = {"seconds": time.perf_counter() - started, "send_s": sent - started,
                              "wait_s": float(out.get("wait_s", 0.0)), "apply_s": float(out.get("apply_s", 0.0)),
                              "buckets": float(len(plan)), "bytes": float(sum(s.nbytes for s in specs))}

    def _check_cancelled(self, cancelled: threading.Event, phase: str) -> None:
        if cancelled.is_set():  # the liveness watch gave up on this push: send nothing more
            self._group = None
            raise ServerUnavailable(f"{self.client.where}: {phase} abandoned")

    def _abort_group(self) -> None:
        """Unblock a collective on the weight group (NCCL's kernels return; gloo's wait ends) and drop it."""
        group, self._group = self._group, None
        if group is not None:
            if group[1].type == "cuda":  # an NCCL group: see liveness.mark_nccl_aborted
                mark_nccl_aborted()
            group[0].abort()

    def _join_group(self, phase: str):
        if self._group is not None:
            return self._group
        assert self.policy is not None
        weights_device = next(self.policy.parameters()).device
        # the server answers gloo instead of NCCL when this GPU is one of its own (W.gpu_uuid)
        info = self.client.request("POST", "/weights/init", {"gpu": W.gpu_uuid(weights_device)}, phase=phase)
        if info["backend"] == "nccl" and weights_device.type != "cuda":
            raise ConfigError(f"{self.client.where} receives weights over NCCL (it runs on a GPU) but the trainer's "
                              "policy is on the CPU; train on a GPU, or serve on the CPU (--device cpu)")
        device = weights_device if info["backend"] == "nccl" else torch.device("cpu")
        # the server's group timeout (--group-timeout-s), never longer than the trainer's own request timeout
        timeout_s = min(float(info.get("timeout_s", self.client.timeout_s)), self.client.timeout_s)
        try:
            group = W.make_group(self.client.host, int(info["port"]), 0, backend=info["backend"],
                                 timeout_s=timeout_s, prefix=str(info.get("prefix", W.DEFAULT_PREFIX)))
        except Exception as exc:
            raise ServerUnavailable(f"{self.client.where}: joining its weight group on port {info['port']} during "
                                    f"{phase} failed: {exc}") from exc
        self._group = (group, device)
        return self._group

    def _recover(self, phase: str, error: ServerError) -> None:
        """A request failed: wait for the server (connect timeout); if it is a new process, re-push and let the
        caller retry; if it is the same process, the error stands."""
        with self._weights_lock:
            info = self.client.wait_ready(phase)
            if info["server_id"] == self.server_id:
                if not self.pusher and isinstance(error, StaleServer):
                    return  # rank 0's push is late: the retry waits on the server again
                raise error
            self.server_id, self._group = info["server_id"], None
            self.session_groups = bool(info.get("session_groups"))
            if self.pusher:
                self._push(phase=f"re-pushing version {self.version} to the restarted server")
