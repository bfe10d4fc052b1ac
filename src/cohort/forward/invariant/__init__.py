"""Batch-invariant kernels and the one decoder forward that both the engine and the trainer run with them.

generation.logprob_parity=exact makes the engine's sampling log-probabilities equal the trainer's recompute bit
for bit. The two sides differ today because every reduction's order depends on the batch: cuBLAS picks its
matmul kernel (and split-K) by M, the engine's decode attention splits the context by a count chosen from the
batch (triton_ops.decode_splits), the sampler slices the vocabulary by the row count (sample_splits), and the
engine fuses QKV and gate-up copies, compiles its norms and RoPE with torch.compile and attends with other kernels
(flash varlen in prefill, the paged Triton kernel in decode) than the trainer (HF modules, flash varlen or SDPA).

Here every reduction of a token's row has one order whatever the batch, the row's place in it, the chunking or
the packing:
- `kernels`: the matmul with fixed tiles and one K loop (no split-K: each output row is a function of its input
  row only), RMSNorm one row per program, the SiLU and GELU-tanh gates, and the log-softmax of the chosen token
  over fixed blocks of the vocabulary;
- `attention`: one query token (its GQA group of heads) per program, keys in tiles from position 0 and the
  context split by a fixed number of keys (SPLIT_KEYS), the same code whether the keys come from the engine's
  paged cache (prefill or decode) or a training row's packed K/V;
- `decoder`: the Llama-family forward (Llama, Mistral, Qwen2, Qwen3) and Gemma 3's over these kernels, with
  one RoPE table per layer type and position (`rope_table`), called by the engine (engine/models/decoder.py)
  and the training forward (forward/packing.py); `ops` gives the kernels a backward (the usual torch maths) for the training forward;
- `parity`: the mode on the model, the checks, and the chosen-token log-probabilities of both sides.
"""
