"""The context a run or a server gets (issue 33): the model's own from its config (nested text configs, GPT-2's
n_positions), read before any weight loads; the training engine sized for the run's longest prompt + completion,
no longer raised to a fixed 4,096; and decode graphs that never copy max_model_len x batch keys."""

from __future__ import annotations

from tests.helpers.tiny_tokenizer import make_tiny_tokenizer
from tests.helpers.toy_task import tiny_model
from transformers import Gemma3Config, GPT2Config, LlamaConfig

from cohort.config import CohortConfig
from cohort.engine import CohortEngine, model_runner
from cohort.policy.context import (
    kv_bytes_per_token,
    kv_pool_tokens,
    largest_fitting,
    model_context,
    peek_config,
)
from cohort.setup.lengths import engine_model_len


def test_the_models_context_comes_from_its_config():
    assert model_context(LlamaConfig(max_position_embeddings=8192)) == (8192, "max_position_embeddings")
    assert model_context(GPT2Config(n_positions=1024)) == (1024, "max_position_embeddings")
    assert model_context(Gemma3Config())[0] == Gemma3Config().get_text_config().max_position_embeddings
    assert model_context({"seq_length": 2048}) == (2048, "seq_length")
    assert model_context(None) == (None, "")


def test_kv_arithmetic_is_the_engines():
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3)
    assert kv_bytes_per_token(config, 2) == 2 * 3 * 2 * 16 * 2
    assert kv_pool_tokens(10_000, 0.5, 100, 16) == 48  # 5,000 bytes: 3 whole blocks of 1,600
    assert largest_fitting(lambda x: x <= 37, 100) == 37
    assert largest_fitting(lambda x: False, 100) is None


def test_the_config_is_read_without_the_weights(tmp_path):
    tok = make_tiny_tokenizer()
    tiny_model(tok).config.save_pretrained(tmp_path / "model")  # config.json only: no weights anywhere
    assert model_context(peek_config(str(tmp_path / "model")))[0] == 256
    assert peek_config("smollm2-135m-instruct") is None  # a GGUF inside a package: read after conversion
    assert peek_config(str(tmp_path / "model"), gguf_file="x.gguf") is None
    assert peek_config(str(tmp_path / "missing")) is None


def test_the_training_engine_is_sized_for_the_run_not_4096():
    model = tiny_model(make_tiny_tokenizer())
    model.config.max_position_embeddings = 32768
    cfg = CohortConfig()
    cfg.data.max_prompt_length, cfg.generation.max_completion_length = 64, 32
    assert engine_model_len(cfg, model) == 96  # was max(96, 4096)
    assert engine_model_len(cfg, model, longest_prompt=20) == 96  # data handed in later still fits the cap
    cfg.generation.max_completion_length = 8000  # a long completion: the engine follows it
    assert engine_model_len(cfg, model) == 8064
    cfg.run.eval_max_completion_length = 9000
    assert engine_model_len(cfg, model) == 9064
    model.config.max_position_embeddings = 9010  # the prompt cap gives way to the context
    assert engine_model_len(cfg, model) == 9010


def test_gather_decode_graphs_leave_out_batches_whose_key_copies_grow_too_large(monkeypatch):
    """Without the Triton kernel a decode graph gathers every row's keys over the whole table width: batch sizes
    whose copies pass GATHER_GRAPH_BYTES are not captured (they run eagerly over the live contexts)."""
    tok = make_tiny_tokenizer()
    engine = CohortEngine(tiny_model(tok), tok, eos_token_ids=[tok.eos_token_id], max_model_len=256)
    runner = engine.runner
    assert not runner.attention.use_triton  # the CPU: the gather path
    row = 2 * (4 + 2) * 256 * 16 * 4  # (heads + kv heads) x max_model_len x head_dim x fp32, K and V
    monkeypatch.setattr(model_runner, "GATHER_GRAPH_BYTES", 5 * row)
    assert runner.graph_batch_sizes() == [1, 2, 4]
    runner.attention.use_triton = True  # the Triton kernel reads only the live blocks: every size
    assert runner.graph_batch_sizes()[-1] == engine.config.max_num_seqs
