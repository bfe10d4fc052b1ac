"""A model alias (smollm2-135m-instruct, gemma-3-270m) resolves to its local copy before anything asks the
Hub: with HF_HUB_OFFLINE unset and no network, GRPOTrainer(model="smollm2-135m-instruct") must not try the
Hub (transformers' five tries took about 25 s before the alias was resolved offline)."""

from __future__ import annotations

import httpx2
import huggingface_hub
import huggingface_hub.file_download
import huggingface_hub.utils._http as hub_http
import pytest
import transformers.utils.hub
from huggingface_hub import constants as hub_constants
from tests.helpers.toy_task import digit_share, toy_rows, write_toy_workspace

import cohort.policy.model as policy_model
from cohort import GRPOConfig, GRPOTrainer
from cohort.policy.model import resolve_model_path


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """Network 'unreachable' and HF_HUB_OFFLINE unset; every Hub download, lookup or HTTP request is recorded (and
    fails, as it would offline). The alias's package copy is a tiny saved model instead of the 93 MB GGUF."""
    calls: list[str] = []

    def refuse(name):
        def fail(*args, **kwargs):
            calls.append(f"{name}{args[:2]}")
            raise OSError(f"{name}: the network is unreachable in this test")
        return fail

    for module, name in ((huggingface_hub, "hf_hub_download"), (huggingface_hub, "snapshot_download"),
                         (huggingface_hub.file_download, "hf_hub_download"),
                         (huggingface_hub.file_download, "get_hf_file_metadata"),
                         (huggingface_hub.file_download, "_get_metadata_or_catch_error"),
                         (transformers.utils.hub, "hf_hub_download"),
                         (transformers.utils.hub, "snapshot_download")):
        monkeypatch.setattr(module, name, refuse(name))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # a closed port: nothing is reachable
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    model_dir, _ = write_toy_workspace(tmp_path / "ws")
    monkeypatch.setattr(policy_model, "smollm2_gguf_path", lambda: tmp_path / "SmolLM2.gguf")
    monkeypatch.setattr(policy_model, "convert_gguf", lambda path, cache_dir=None: model_dir)

    def unreachable(request):  # every HTTP request huggingface_hub sends, whichever function sends it
        calls.append(f"{request.method} {request.url}")
        raise httpx2.ConnectError("the network is unreachable in this test", request=request)

    previous = hub_http._GLOBAL_CLIENT_FACTORY
    huggingface_hub.set_client_factory(lambda: httpx2.Client(transport=httpx2.MockTransport(unreachable)))
    yield calls, model_dir
    huggingface_hub.set_client_factory(previous)


def test_alias_resolves_locally(no_hub):
    calls, model_dir = no_hub
    assert resolve_model_path("smollm2-135m-instruct") == str(model_dir)
    assert calls == []


def test_gemma_alias_resolves_locally(no_hub, monkeypatch, tmp_path):
    calls, model_dir = no_hub
    monkeypatch.setattr(policy_model, "gemma3_270m_gguf_path", lambda cache_dir=None: tmp_path / "gemma.gguf")
    assert resolve_model_path("gemma-3-270m") == str(model_dir)
    # the hub id also resolves to the package's copy when the HF cache lacks it, without asking the Hub
    assert resolve_model_path("google/gemma-3-270m") == str(model_dir)
    assert calls == []


def test_facade_resolves_the_alias_before_any_hub_call(no_hub, tmp_path):
    # the facade needs these today even with a list as train_dataset (trl_compat/rows.py reads datasets; its
    # config keeps cohort's default data.source, reasoning-gym's chain_sum, which the checks import)
    pytest.importorskip("datasets", reason="the TRL facade needs datasets: pip install datasets")
    pytest.importorskip("reasoning_gym", reason="the TRL facade's checks need reasoning-gym: pip install "
                                                "reasoning-gym==0.1.25")
    calls, _ = no_hub
    args = GRPOConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=2,
                      max_completion_length=4, max_steps=1, report_to="jsonl", extra={"train.device": "cpu"})
    trainer = GRPOTrainer(model="smollm2-135m-instruct", reward_funcs=digit_share, args=args,
                          train_dataset=toy_rows(1))
    trainer.train()
    # nothing asked the Hub, so nothing was retried: no download or lookup, and no HTTP request at all
    assert calls == [], f"the alias reached the Hub before resolving locally: {calls}"
