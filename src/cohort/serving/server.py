"""`cohort serve MODEL`: the engine as an HTTP server (stdlib http.server, JSON bodies, a bounded thread pool).

Routes (docs/serving.md has the full protocol); every one needs `Authorization: Bearer KEY` (auth.py):
    GET  /health                  {"status", "server_id", "version", "pushed", "model", "replicas", ...}
    GET  /version                 {"version", "server_id", "pushed"}
    POST /generate                token ids in -> token ids, sampling logprobs, finish reasons, version out
    POST /weights/init            open a weight group; answers the TCPStore port and key prefix the trainer joins
    POST /weights/begin           announce version, manifest (name, shape, dtype) and bucket plan; checked
    POST /weights/commit          wait for the buckets, switch the version atomically
    POST /sessions/close, /sessions/keepalive   end or keep alive the conversations kept between turns
    POST /sessions/wait           the turns of an owner's detached session requests, as each ends
    GET  /v1/models, POST /v1/completions, POST /v1/chat/completions   (OpenAI-compatible)

Errors are JSON `{"error": {"message", "type", "param", "code"}}` with status 400 (bad request: every field is
range-checked, limits.py), 401 (no or wrong API key), 404 (unknown route or model), 408/411/413 (body late,
without Content-Length, too large: httpd.py), 409 (weight mismatch, stale version), 410 (session evicted: sessions.py), 503 (busy) or 500.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cohort.engine import CohortEngine, engine_supports
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.errors import CohortError
from cohort.policy.context import model_context
from cohort.policy.model import _with_pad_token, load_policy
from cohort.remote.client import API_KEY_ENV
from cohort.remote.weights import WeightMismatchError
from cohort.serving import auth, openai_api, sessions
from cohort.serving import limits as L
from cohort.serving.engine_server import EngineServer, Replica, StaleVersion
from cohort.serving.httpd import PooledHTTPServer, content_length, linger, read_body
from cohort.serving.limits import Limits
from cohort.setup.engine import eos_ids
from cohort.setup.length_checks import check_serve_context, check_served_context
from cohort.setup.policy import resolve_dtype
from cohort.types import Completion, SamplingParams


def params_from_json(data: Any, limits: Limits | None = None) -> SamplingParams:
    """SamplingParams from /generate's `params` object, every field checked (limits.sampling_params)."""
    return L.sampling_params(data, limits or Limits())


def completion_to_json(c: Completion) -> dict:
    return {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}


def _printable(text: str, size: int = 120) -> str:
    """A client-chosen string (a path) as a log line may show it: no control characters, bounded."""
    return "".join(c if c.isprintable() else "?" for c in text[:size]) + ("..." if len(text) > size else "")


class _Handler(BaseHTTPRequestHandler):
    server_version = "cohort-serve"
    protocol_version = "HTTP/1.1"
    timeout = 30  # seconds a connection may stay silent: reading a request, or idle between two
    linger_s = 2.0  # after an answer that left the body unread: how long its rest is read and dropped
    # set on the subclass made by `make_http_server` (engine and limits by `set_engine`)
    engine: EngineServer
    api_key: str | None = None
    limits: Limits = Limits()
    _unread = False  # the request's body is not read (yet): answering closes the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the trainer's log

    def do_GET(self) -> None:
        routes = {"/health": self.engine.health,
                  "/version": lambda: {k: self.engine.health()[k] for k in ("version", "server_id", "pushed")},
                  "/v1/models": lambda: openai_api.models_response(self.engine.model_name)}
        self._route(routes)

    def do_POST(self) -> None:
        routes = {"/generate": self._generate, "/weights/init": lambda b: self.engine.weights_init(L.gpu_id(b.get("gpu"))),
                  "/weights/begin": self._weights_begin,
                  "/weights/commit": lambda b: self.engine.weights_commit(L.version(b.get("version"))),
                  "/sessions/close": lambda b: sessions.close_answer(self.engine, b, _session_id),
                  "/sessions/keepalive": lambda b: sessions.keepalive_answer(self.engine, b, _session_id),
                  "/sessions/wait": lambda b: sessions.wait_answer(self.engine, b, _session_id, self.limits),
                  "/v1/completions": self._completions, "/v1/chat/completions": self._chat}
        self._route({path: (lambda route=route: route(self._body())) for path, route in routes.items()})

    def _route(self, routes: dict) -> None:
        """Authentication first (before the body is read, on every route), then the route."""
        self._unread = bool(self.headers.get("Transfer-Encoding")) or \
            (self.headers.get("Content-Length") or "0").strip() != "0"
        if self._authorized():
            self._answer(routes.get(self.path.split("?")[0]))

    def _authorized(self) -> bool:
        """True when the request carries the key; else answer 401 (one log line, never the key) and False."""
        why = auth.refusal(self.headers.get("Authorization"), self.api_key)
        if why is None:
            return True
        print(f"cohort serve: 401 {self.command} {_printable(self.path)} from {self.client_address[0]}: {why}",
              file=sys.stderr, flush=True)
        message = ("missing or wrong API key: send 'Authorization: Bearer <key>' with the key `cohort serve` "
                   f"printed at start (or was given with --api-key / {API_KEY_ENV})")
        self._send(401, _error(message, "authentication_error", code="invalid_api_key"),
                   {"WWW-Authenticate": 'Bearer realm="cohort serve"'})
        return False

    def handle_expect_100(self) -> bool:
        """`Expect: 100-continue` (curl, before a large body): invite the body only from a client with the key."""
        self._unread = True
        return self._authorized() and super().handle_expect_100()

    def _body(self) -> dict:
        data = read_body(self.rfile, content_length(self.headers, self.limits.max_body_bytes))
        self._unread = False
        try:
            body = json.loads(data or b"{}")
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, an integer of too many digits, nesting
            raise L.RequestError(f"the body is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(body, dict):
            raise L.RequestError("the body must be a JSON object")
        return body

    def _answer(self, handler) -> None:
        if handler is None:
            return self._send(404, _error(f"no route {self.command} {_printable(self.path)}", "not_found"))
        try:
            return self._send(200, handler())
        except L.RequestError as exc:
            return self._send(exc.status, _error(str(exc), "invalid_request_error", exc.param))
        except sessions.SessionEvicted as exc:
            return self._send(410, _error(str(exc), "session_evicted", param="session_id", code="session_evicted"))
        except (WeightMismatchError, StaleVersion) as exc:
            kind = "weight_mismatch" if isinstance(exc, WeightMismatchError) else "stale_version"
            return self._send(409, _error(str(exc), kind, server_id=self.engine.server_id))
        except (CohortError, ValueError, KeyError, TypeError, ArithmeticError) as exc:
            return self._send(400, _error(f"{type(exc).__name__}: {exc}", "invalid_request_error"))
        except Exception as exc:  # a server answers every request, it never dies of one
            traceback.print_exc(file=sys.stderr)
            return self._send(500, _error(f"{type(exc).__name__}: {exc}", "internal_error"))

    def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self._unread:  # the body is not read: the connection cannot carry another request
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            if self._unread:
                self.wfile.flush()
                linger(self.connection, self.limits.max_body_bytes, self.linger_s)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            # The client left before its answer (a trainer that finished with a rollout request queued ahead):
            # one line, not a traceback per request.
            print(f"cohort serve: {self.command} {_printable(self.path)}: the client closed the connection before "
                  "the answer", file=sys.stderr, flush=True)

    # ---- routes ------------------------------------------------------------------------------------
    def _generate(self, body: dict) -> dict:
        session = sessions.parse(body, _session_id)  # pops the session fields
        prompts, params, keywords = L.generate_request(body, self.limits)
        if session is not None:
            return sessions.generate_answer(self.engine, session, prompts, params, keywords)
        groups, version = self.engine.generate(prompts, params, **keywords)
        return {"version": version, "server_id": self.engine.server_id,
                "completions": [[completion_to_json(c) for c in g] for g in groups]}

    def _weights_begin(self, body: dict) -> dict:
        manifest, plan = body.get("manifest"), body.get("plan")
        if not isinstance(manifest, list) or not isinstance(plan, list):
            raise L.RequestError("/weights/begin needs `manifest` and `plan` lists", param="manifest")
        return self.engine.weights_begin(L.version(body.get("version")), manifest, plan,
                                         L.session(body.get("session"), self.limits))

    def _completions(self, body: dict) -> dict:
        tok, name = self.engine.tokenizer, self.engine.model_name
        prompts, params = openai_api.completion_request(body, tok, name, self.limits)
        groups, version = self.engine.generate(prompts, params)
        return openai_api.completion_response(body, tok, name, prompts, groups, version)

    def _chat(self, body: dict) -> dict:
        tok, name = self.engine.tokenizer, self.engine.model_name
        prompts, params = openai_api.chat_request(body, tok, name, self.limits)
        groups, version = self.engine.generate(prompts, params)
        return openai_api.chat_response(body, tok, name, prompts, groups, version)


def _session_id(value: Any, field: str) -> str:
    return L.text(value, field, sessions.MAX_ID_CHARS, empty=False)


def _error(message: str, kind: str, param: str | None = None, code: str | None = None, **extra) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **extra}}


def make_http_server(engine: EngineServer | None, host: str, port: int, *, api_key: str | None = None,
                     max_body_bytes: int = Limits.max_body_bytes, workers: int = 64,
                     queued: int = 1024) -> PooledHTTPServer:
    """Bound at once (a port in use fails before any model loads); `set_engine` before serving if None.
    `api_key` None: no authentication (`--api-key none`)."""
    handler = type("CohortHandler", (_Handler,), {"api_key": api_key, "limits": Limits(max_body_bytes=max_body_bytes)})
    server = PooledHTTPServer((host, port), handler, workers=workers, queued=queued)
    if engine is not None:
        set_engine(server, engine)
    return server


def set_engine(server: PooledHTTPServer, engine: EngineServer) -> None:
    """Serve `engine`; the requests' bounds follow its vocabulary and context."""
    handler: Any = server.RequestHandlerClass
    vocab, context = engine.bounds()
    handler.engine = engine
    handler.limits = dataclasses.replace(handler.limits, vocab_size=vocab, context=context)


# ---------------------------------------------------------------------------------------------------------
# Building the replicas


def _devices(device: str, replicas: int) -> list[torch.device]:
    if replicas < 1:
        raise CohortError(f"--replicas={replicas} must be >= 1")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        count = torch.cuda.device_count()
        if replicas > count:
            raise CohortError(f"--replicas={replicas} needs {replicas} GPUs but {count} are visible "
                              "(CUDA_VISIBLE_DEVICES); lower --replicas")
        return [torch.device("cuda", k) for k in range(replicas)]
    return [torch.device(device)] * replicas


def _load(model: str, device: torch.device, dtype: str, load_format: str):
    torch_dtype = resolve_dtype(dtype, device)
    if load_format == "dummy":  # random weights from the config: the trainer's first push replaces them
        config = AutoConfig.from_pretrained(model)
        with device:
            net = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        return net, _with_pad_token(AutoTokenizer.from_pretrained(model))
    return load_policy(model, dtype=torch_dtype, device=device)


def build_replicas(args) -> tuple[list[Replica], Any]:
    replicas, tokenizer = [], None
    for device in _devices(args.device, args.replicas):
        model, tokenizer = _load(args.model, device, args.dtype, args.load_format)
        model.eval().requires_grad_(False)
        check_served_context(model.config, args.max_model_len)  # again where config.json could not be read first
        ok, why = engine_supports(model)
        engine: Any
        if ok and args.engine in ("auto", "cohort"):
            engine = CohortEngine(model, tokenizer, eos_token_ids=eos_ids(tokenizer, model),
                                  kv_cache_fraction=args.kv_cache_fraction, max_num_seqs=args.max_num_seqs,
                                  max_model_len=args.max_model_len, enforce_eager=args.enforce_eager, device=device)
        elif args.engine == "cohort":
            raise CohortError(f"--engine cohort: {why}")
        else:
            engine = HFGenerateEngine(model, tokenizer, eos_token_ids=eos_ids(tokenizer, model))
        replicas.append(Replica(model=model, engine=engine, device=device, lock=threading.Lock()))
    return replicas, tokenizer


def _context_line(engine) -> str:
    """The served context and why (cohort's engine: the model's own, within what one sequence can have in the
    KV pool, or --max-model-len); Hugging Face generate: the model's own."""
    note = getattr(engine, "context_note", None)
    if note is not None:
        return note
    native, field = model_context(getattr(getattr(engine, "model", None), "config", None))
    return f"context {native} tokens: the model's {field} (Hugging Face generate)" if native else \
        "context: the model's config names none (Hugging Face generate)"


def _http_options(args) -> dict:
    """make_http_server's keywords from `cohort serve`'s options, checked; prints the key (or the warning)."""
    max_body_mb = float(getattr(args, "max_body_mb", 16.0))
    workers, queued = int(getattr(args, "http_workers", 64)), int(getattr(args, "http_queue", 1024))
    if not (math.isfinite(max_body_mb) and max_body_mb > 0):
        raise CohortError(f"--max-body-mb={max_body_mb} must be a positive number of MiB, e.g. 16")
    if workers < 1 or queued < 0:
        raise CohortError(f"--http-workers={workers} must be >= 1 and --http-queue={queued} >= 0")
    key, source = auth.resolve_key(getattr(args, "api_key", None), os.environ)
    return {"api_key": key, "key_source": source, "max_body_bytes": int(max_body_mb * (1 << 20)),
            "workers": workers, "queued": queued}


def serve(args) -> int:
    """`cohort serve`: build, announce the key and the address on stdout, serve until killed."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.kv_cache_fraction <= 1:
        raise CohortError(f"--kv-cache-fraction={args.kv_cache_fraction} must be in (0, 1], e.g. 0.8")
    first = _devices(args.device, args.replicas)[0]  # --max-model-len against the model and the KV pool, unloaded
    check_serve_context(args.model, args.max_model_len, args.kv_cache_fraction, first,
                        resolve_dtype(args.dtype, first), args.engine)
    options = _http_options(args)
    session_options = float(getattr(args, "session_timeout_s", 300.0)), int(getattr(args, "max_sessions", 64))
    sessions.check_options(*session_options)
    source = options.pop("key_source")
    try:  # requests wait in the backlog until serve_forever
        server = make_http_server(None, args.host, args.port, **options)
    except OSError as exc:
        raise CohortError(f"--host={args.host} --port={args.port}: cannot listen there ({exc}); pick another port "
                          "(0: a free one) or stop what uses it") from None
    replicas, tokenizer = build_replicas(args)
    engine = EngineServer(replicas, tokenizer, model_name=args.served_model_name or args.model, host=args.host,
                          group_timeout_s=args.group_timeout_s)
    sessions.attach(engine, *session_options)
    set_engine(server, engine)
    host, port = str(server.server_address[0]), int(server.server_address[1])
    line, warning = auth.announcement(options["api_key"], source, f"{host}:{port}")
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if line:
        print(line, flush=True)
    print(f"cohort serve: {_context_line(replicas[0].engine)}", flush=True)
    print(f"cohort serve: ready on http://{host}:{port} (model {engine.model_name}, {len(replicas)} replica(s) on "
          f"{', '.join(str(r.device) for r in replicas)}, weights over {engine.backend}, "
          f"{engine.health()['engine']})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
