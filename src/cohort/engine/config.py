"""Engine configuration: every knob of cohort's rollout engine in one validated dataclass.

The engine owns no global state: one `EngineConfig` (and one engine) per data-parallel rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    """Sizes and switches of one `CohortEngine`.

    max_num_seqs: most sequences decoded together in one step (also the largest CUDA-graph batch).
    max_num_batched_tokens: token budget of one prefill step; a sequence longer than this cannot be
        prefilled (chunked prefill is not implemented), so it must be >= max_model_len.
    block_size: tokens per KV-cache block (page). Blocks are the unit of sharing between a group's samples.
    max_model_len: longest prompt + completion a request may reach (sizes the block tables).
    fit_context_to_kv: max_model_len is an upper bound (the model's context, CohortEngine's default): when one
        sequence of it does not fit the KV pool, lower it to what one sequence can have there instead of failing.
    kv_cache_fraction: fraction of the device's free memory (after the trainer's allocations) given to
        the KV cache. On the CPU it is a fraction of 4 GiB.
    num_kv_blocks: force the number of KV blocks (tests use this to force preemption); None = from memory.
    enforce_eager: True disables CUDA graphs for decode steps.
    fuse_projections: keep concatenated QKV and gate-up weight copies (fewer, larger matmuls); they cost
        memory and a refresh in `sync_weights`, and are skipped when a projection is not a plain nn.Linear
        (LoRA wrappers keep running their own forward). None = on CUDA when the copies take under a
        quarter of the free memory, off on the CPU.
    continuation_delay_steps: multi-turn: when only continued turns (tool results) wait to be prefilled while
        other sequences decode, hold them for up to this many decode steps so that the turns ending around
        the same time share one prefill step (each prefill step is a full eager forward: on a small model
        one continuation per step cost more than the decode steps around it). They go at once when nothing
        is decoding or when they number at least half the decoding sequences. 0 = prefill each at once.
        Sampled tokens do not depend on it (noise comes from each sequence's seed and position). None (the
        default): 0 where continued turns replay CUDA graphs (continuation_graph_tokens, engine/
        continuation_graphs.py: a continued turn's prefill then costs about one decode step, and waiting only
        adds steps; measured on bench/turns.py, docs/benchmarks.md), else 8.
    decode_steps: decode steps run per host iteration when every row samples plainly (no penalty or
        filter): one CUDA graph replays `decode_steps` forwards, each feeding its sampled tokens to the next
        on the device, so the host's per-step work (inputs, copies, synchronisation, bookkeeping) is paid
        once per `decode_steps` tokens. A row that stops (EOS / stop string) inside the chunk computes up to
        decode_steps - 1 tokens that are dropped; a row never computes past its max_tokens. Tokens do not
        depend on it. None = 8 where the decode graphs and the in-graph sampler exist (CUDA with Triton),
        1 elsewhere; a value > 1 without CUDA graphs runs the same device-side loop eagerly (tests).
    prefill_graph_tokens: prefill steps of fresh prompts totalling up to this many tokens (padded to a
        multiple of 512) replay a CUDA graph captured for their padded shape the first time it occurs
        (engine/prefill_graphs.py): a small model's prefill is bound by host work otherwise. Each shape
        captured costs one extra forward then; the graphs' activations stay reserved in the decode graphs'
        memory pool. 0 = always eager. Only with CUDA graphs and varlen attention.
    continuation_graph_tokens: prefill steps with continued turns (multi-turn: tool results appended to a
        conversation whose KV is kept) of up to this many new tokens run as one decode-shaped forward, each new
        token attending over its sequence's paged KV with the decode kernel, replayed from a CUDA graph per padded
        size (engine/continuation_graphs.py; eager without CUDA graphs). 0 = the general prefill path (varlen
        attention, then the continued turns' attention redone over their prefix). Text models with the Triton
        decode kernel (CUDA) only; elsewhere the general path runs whatever this says.
    record_routes: a mixture-of-experts model records the top-k experts every sparse layer chose for each token
        it runs (router replay, engine/routing.py): `Completion.routed_experts`. False records nothing and adds
        nothing to any step or graph.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 16384
    block_size: int = 64
    max_model_len: int = 4096
    fit_context_to_kv: bool = False
    kv_cache_fraction: float = 0.3
    num_kv_blocks: int | None = None
    enforce_eager: bool = False
    fuse_projections: bool | None = None
    continuation_delay_steps: int | None = None
    decode_steps: int | None = None
    prefill_graph_tokens: int = 4096
    continuation_graph_tokens: int = 2048
    record_routes: bool = False

    def __post_init__(self) -> None:
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("block_size", self.block_size)
        _positive("max_model_len", self.max_model_len)
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError(
                f"kv_cache_fraction={self.kv_cache_fraction} must be in (0, 1]: it is the share of free "
                "device memory given to the KV cache (try 0.3)."
            )
        delay = self.continuation_delay_steps
        if delay is not None and (not isinstance(delay, int) or delay < 0):
            raise ValueError(f"continuation_delay_steps={delay!r} must be an integer >= 0 (decode steps a continued "
                             "turn may wait to share a prefill; 0 = none) or None (0 or 8, see EngineConfig).")
        if self.decode_steps is not None and (not isinstance(self.decode_steps, int) or self.decode_steps < 1):
            raise ValueError(f"decode_steps={self.decode_steps!r} must be an integer >= 1 (decode steps per host "
                             "iteration) or None (8 with CUDA graphs, else 1).")
        if not isinstance(self.prefill_graph_tokens, int) or self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens={self.prefill_graph_tokens!r} must be an integer >= 0 (largest "
                             "prefill replayed as a CUDA graph; 0 = always eager).")
        if not isinstance(self.continuation_graph_tokens, int) or self.continuation_graph_tokens < 0:
            raise ValueError(f"continuation_graph_tokens={self.continuation_graph_tokens!r} must be an integer >= 0 "
                             "(largest continued-turn prefill run as a decode-shaped forward; 0 = the general path).")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be >= 1 or None (size from memory).")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len={self.max_model_len}: "
                "a sequence must fit one prefill step (no chunked prefill). Raise max_num_batched_tokens "
                "or lower max_model_len."
            )

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer.")


def context_note(config: EngineConfig, asked: int | None, native: int | None, field: str, num_blocks: int) -> str:
    """Why an engine's context (max_model_len) is what it is: asked for, the model's own, or what one sequence
    can have in the KV pool of `num_blocks` blocks (`cohort serve` prints it at start)."""
    length = config.max_model_len
    if asked is not None:
        return f"context {length} tokens (max_model_len given)"
    if native is None:
        return f"context {length} tokens (the model's config names no context: the engine's default)"
    if length < native:
        return (f"context {length} tokens: what one sequence can have in the KV pool ({num_blocks} blocks of "
                f"{config.block_size} tokens at kv_cache_fraction={config.kv_cache_fraction}), below the model's "
                f"{native} ({field}); a larger kv_cache_fraction raises it")
    return f"context {length} tokens: the model's {field}; the KV pool holds {num_blocks * config.block_size} tokens"
