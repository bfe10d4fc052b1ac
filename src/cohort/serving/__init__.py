"""Generation on its own GPUs: `cohort serve` (the engine as an HTTP server, weights pushed over a
torch.distributed group) and the trainer's side of it (`RemoteEngine`, the bounded-staleness pipeline).

    weights.py        manifest, bucket plan, the trainer <-> server process group (gloo on CPU, NCCL on GPU)
    engine_server.py  replicas, versions, staging copy and atomic version switch (no HTTP)
    server.py         the HTTP routes, building the replicas, `cohort serve`'s arguments
    auth.py           the API key: where it comes from, the Bearer check on every route
    limits.py         every request field range-checked (400 naming the field, value and fix)
    httpd.py          the HTTP layer's bounds: thread pool, backlog, Content-Length, 503 when busy
    openai_api.py     /v1/completions and /v1/chat/completions request/response shapes
    client.py         ServerClient (timeouts, named errors) and RemoteEngine (a RolloutEngine)
    pipeline.py       train.max_staleness >= 1: rollouts of later steps generated while a step trains

docs/serving.md describes the protocol, the commands and the settings.
"""

from cohort.remote.client import RemoteEngine, ServerError, ServerUnavailable, parse_address
from cohort.remote.errors import ServerAuthError
from cohort.remote.weights import WeightMismatchError

__all__ = ["RemoteEngine", "ServerAuthError", "ServerError", "ServerUnavailable", "WeightMismatchError",
           "parse_address"]
