"""`cohort serve MODEL`: the engine as an HTTP server (stdlib ThreadingHTTPServer, JSON bodies).

Routes (docs/serving.md has the full protocol):
    GET  /health                  {"status", "server_id", "version", "pushed", "model", "replicas", ...}
    GET  /version                 {"version", "server_id", "pushed"}
    POST /generate                token ids in -> token ids, sampling logprobs, finish reasons, version out
    POST /weights/init            open a weight group; answers the TCPStore port the trainer joins
    POST /weights/begin           announce version, manifest (name, shape, dtype) and bucket plan; checked
    POST /weights/commit          wait for the buckets, switch the version atomically
    GET  /v1/models, POST /v1/completions, POST /v1/chat/completions   (OpenAI-compatible)

Errors are JSON `{"error": {"message", "type", "param", "code"}}` with status 400 (bad request), 404 (unknown
route or model), 409 (weight mismatch, stale version) or 500.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cohort.engine import CohortEngine, engine_supports
from cohort.engine.hf_backend import HFGenerateEngine
from cohort.errors import CohortError
from cohort.policy.model import _with_pad_token, load_policy
from cohort.remote.weights import WeightMismatchError
from cohort.serving import openai_api
from cohort.serving.engine_server import EngineServer, Replica, StaleVersion
from cohort.setup.engine import eos_ids
from cohort.setup.policy import resolve_dtype
from cohort.types import Completion, SamplingParams


def params_from_json(data: dict) -> SamplingParams:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise openai_api.RequestError(f"unknown sampling field(s) {unknown}; known: {sorted(names)}")
    values: dict[str, Any] = {k: tuple(v) if k in ("stop_token_ids", "stop_strings") else v for k, v in data.items()}
    return SamplingParams(**values)


def completion_to_json(c: Completion) -> dict:
    return {"token_ids": c.token_ids, "logprobs": c.logprobs, "finish_reason": c.finish_reason}


class _Handler(BaseHTTPRequestHandler):
    server_version = "cohort-serve"
    protocol_version = "HTTP/1.1"
    engine: EngineServer  # set on the subclass made by `make_http_server`

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the trainer's log

    def do_GET(self) -> None:
        routes = {"/health": self.engine.health,
                  "/version": lambda: {k: self.engine.health()[k] for k in ("version", "server_id", "pushed")},
                  "/v1/models": lambda: openai_api.models_response(self.engine.model_name)}
        self._answer(routes.get(self.path.split("?")[0]))

    def do_POST(self) -> None:
        routes = {"/generate": self._generate, "/weights/init": lambda b: self.engine.weights_init(),
                  "/weights/begin": lambda b: self.engine.weights_begin(b["version"], b["manifest"], b["plan"],
                                                                        b.get("session")),
                  "/weights/commit": lambda b: self.engine.weights_commit(b["version"]),
                  "/v1/completions": self._completions, "/v1/chat/completions": self._chat}
        route = routes.get(self.path.split("?")[0])
        self._answer(None if route is None else lambda: route(self._body()))

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError as exc:
            raise openai_api.RequestError(f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise openai_api.RequestError("the body must be a JSON object")
        return body

    def _answer(self, handler) -> None:
        if handler is None:
            return self._send(404, _error(f"no route {self.command} {self.path}", "not_found"))
        try:
            return self._send(200, handler())
        except openai_api.RequestError as exc:
            return self._send(exc.status, _error(str(exc), "invalid_request_error", exc.param))
        except (WeightMismatchError, StaleVersion) as exc:
            kind = "weight_mismatch" if isinstance(exc, WeightMismatchError) else "stale_version"
            return self._send(409, _error(str(exc), kind, server_id=self.engine.server_id))
        except (CohortError, ValueError, KeyError, TypeError) as exc:
            return self._send(400, _error(f"{type(exc).__name__}: {exc}", "invalid_request_error"))
        except Exception as exc:  # a server answers every request, it never dies of one
            traceback.print_exc(file=sys.stderr)
            return self._send(500, _error(f"{type(exc).__name__}: {exc}", "internal_error"))

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            # The client left before its answer (a trainer that finished with a rollout request queued ahead):
            # one line, not a traceback per request.
            print(f"cohort serve: {self.command} {self.path}: the client closed the connection before the answer",
                  file=sys.stderr, flush=True)

    # ---- routes ------------------------------------------------------------------------------------
    def _generate(self, body: dict) -> dict:
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
            raise openai_api.RequestError("prompts must be a list of token-id lists", param="prompts")
        raw = body.get("params") or {}
        if isinstance(raw, list):  # one per prompt (a multi-turn round: each conversation its own room and seed)
            if len(raw) != len(prompts):
                raise openai_api.RequestError(f"params: got {len(raw)} for {len(prompts)} prompts; give one "
                                              "object, or one per prompt", param="params")
            params: SamplingParams | list[SamplingParams] = [params_from_json(item or {}) for item in raw]
        else:
            params = params_from_json(raw)
        min_version = body.get("min_version")
        groups, version = self.engine.generate(prompts, params, min_version=min_version,
                                               wait_s=float(body.get("wait_s", 0.0)), session=body.get("session"))
        return {"version": version, "server_id": self.engine.server_id,
                "completions": [[completion_to_json(c) for c in g] for g in groups]}

    def _completions(self, body: dict) -> dict:
        tok, name = self.engine.tokenizer, self.engine.model_name
        prompts, params = openai_api.completion_request(body, tok, name)
        groups, version = self.engine.generate(prompts, params)
        return openai_api.completion_response(body, tok, name, prompts, groups, version)

    def _chat(self, body: dict) -> dict:
        tok, name = self.engine.tokenizer, self.engine.model_name
        prompts, params = openai_api.chat_request(body, tok, name)
        groups, version = self.engine.generate(prompts, params)
        return openai_api.chat_response(body, tok, name, prompts, groups, version)


def _error(message: str, kind: str, param: str | None = None, **extra) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None, **extra}}


def make_http_server(engine: EngineServer | None, host: str, port: int) -> ThreadingHTTPServer:
    """Bound at once (a port in use fails before any model loads); `set_engine` before serving if None."""
    handler = type("CohortHandler", (_Handler,), {"engine": engine})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def set_engine(httpd: ThreadingHTTPServer, engine: EngineServer) -> None:
    httpd.RequestHandlerClass.engine = engine  # type: ignore[attr-defined]


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


def serve(args) -> int:
    """`cohort serve`: build, announce the address on stdout (one line), serve until killed."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0 < args.kv_cache_fraction <= 1:
        raise CohortError(f"--kv-cache-fraction={args.kv_cache_fraction} must be in (0, 1], e.g. 0.8")
    try:
        httpd = make_http_server(None, args.host, args.port)  # requests wait in the backlog until serve_forever
    except OSError as exc:
        raise CohortError(f"--host={args.host} --port={args.port}: cannot listen there ({exc}); pick another port "
                          "(0: a free one) or stop what uses it") from None
    replicas, tokenizer = build_replicas(args)
    engine = EngineServer(replicas, tokenizer, model_name=args.served_model_name or args.model, host=args.host,
                          group_timeout_s=args.group_timeout_s)
    set_engine(httpd, engine)
    host, port = str(httpd.server_address[0]), int(httpd.server_address[1])
    print(f"cohort serve: ready on http://{host}:{port} (model {engine.model_name}, {len(replicas)} replica(s) on "
          f"{', '.join(str(r.device) for r in replicas)}, weights over {engine.backend}, "
          f"{engine.health()['engine']})", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
    return 0
