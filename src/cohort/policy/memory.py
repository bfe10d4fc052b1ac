"""Device-memory estimate for a training run, printed before any work and checked against the device.

The estimate is arithmetic on the model config, not a measurement; its job is to fail early, with a
message that says which setting to lower, instead of an out-of-memory error twenty minutes in.

What it is for: the peak of a run whose completions all reach max_completion_length. T, the tokens of the
largest forward/backward, is then the biggest micro-batch the update cuts (cohort.setup.memory_plan.micro_batch_tokens: a
step smaller than train.token_budget is one micro-batch of its size); shorter completions pack more sequences
into a micro-batch, up to train.token_budget. docs/memory.md compares it with measured peaks (bench/memory.py).

Terms (P parameters, b bytes per weight element, T tokens per forward/backward):
- weights P*b; gradients P*b; fp32 master weights 4P when the weights are not already fp32;
- optimizer: AdamW keeps two moments per parameter, fp32 (8P) with master weights, else in the weight
  dtype (2bP); "adamw_8bit" 2P; "sgd" nothing; with optimizer_offload the moments live on the host and
  the device holds one bucket's during the step (the biggest: vocab x hidden);
- activations: per token and decoder layer, the tensors autograd keeps for a Llama/Qwen-style block with
  varlen/flash attention (no [T, T] scores): 7H + 3K + 4I elements in the weight dtype (norm inputs and
  outputs, q/k/v before and after RoPE, attention output, gate/up/act/product of the MLP) plus 2H fp32
  elements of RMSNorm internals; H hidden, K = kv heads x head dim, I intermediate. With gradient
  checkpointing only each layer's input is kept (H*b per layer) plus one layer being recomputed. Layers
  compiled with torch.compile (model.compile_layers, CUDA) keep 3H + 2Q + 2K + 3I elements in the weight
  dtype plus 2H fp32 (Q = heads x head dim): fitted to bench/grpo_step.py's update peaks on an H100. A row
  with shared prompts (train.share_prompts) also keeps the K and V rows its attention gathers: each completion
  reads its prompt's keys again (shared_key_rows);
- logits chunk: one chunk of the chunked logprob kernel (at most the micro-batch's completion tokens, the
  kernel's only input), chunk_tokens x vocab elements: in the eager code the logits, an fp32 working copy
  (none for fp32 weights), exp() in fp32 and the gradient cast back (8 bytes per element in fp32, 12 in bf16:
  measured); with the fused CUDA kernels (fused_logprob_kernels) two copies in the weight dtype. With
  keep_logits (train.keep_logits) the kernel also keeps every completion token's logits for the backward:
  completion tokens x vocab x b more, counted in the same term;
- LM-head gradient: the same kernel's backward sums the LM-head weight gradient over chunks in an fp32
  [vocab, hidden] buffer next to one chunk's product in the weight dtype (4 + b bytes per element). It does
  not shrink with the token budget or chunk size: 0.76 GiB for Qwen2.5-0.5B in bf16, 1.30 GiB for 1.5B
  (bench/grpo_step.py's low-memory run peaked about 1 GiB above the estimate before this term existed);
  with lm_head_grad_fp32=False (train.master_weights=false) the sum is kept in the weight dtype: V*H*b;
- KV cache: what the rollout engine reserves (given: setup fills in the pool as built); engine_weights: the
  engine's fused QKV / gate-up copies (given); reference model: P*b more when beta > 0.
- peak (`total`): the largest of three phases: the backward (every term, less the KV pool when
  generation.release_kv_during_update frees it and the moments when they are offloaded), the optimizer
  step (no activations or logprob buffers) and generation (no gradients either: zero_grad frees them).
- sharded (train.sharding=fsdp over N ranks, per rank): the training copy (fp32 masters, or the weights'
  dtype without master weights), its gradients, the Adam moments and the reference are divided by N; the
  engine keeps whole weights in the compute dtype (engine_weights, P*b); FSDP holds the root (embeddings,
  LM head) and about two decoder layers gathered at a time (gathered).
- LoRA (lora_params=A adapter parameters beside the P frozen ones): the base stays in the weight dtype
  (sharded: 1/N of it per rank); the adapters are fp32 (peft upcasts them), with fp32 gradients and Adam
  moments and no separate masters; the LM head is frozen, so there is no LM-head gradient. The engine still keeps the whole bf16 base (sharded runs:
  engine_weights), the term that decides whether a large model fits (docs/benchmarks.md, "Eight GPUs").
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from cohort.errors import ConfigError

GIB = 1024**3
_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")
# What to lower when a term is the biggest one, in the words of the config a user edits.
_ADVICE = {
    "activations": "lower train.token_budget or set model.gradient_checkpointing=true",
    "optimizer": "keep Adam moments in bf16 (train.master_weights=false) or on the host (train.optimizer_offload=true)",
    "master_weights": "drop fp32 master weights (train.master_weights=false)",
    "kv_cache": "give the rollout engine a smaller KV cache (generation.kv_cache_fraction)",
    "logits_chunk": "lower train.logprob_chunk_tokens (and set train.keep_logits=false)",
    "lm_head_grad": "sum it in bf16 (train.master_weights=false) or use a smaller model (vocabulary x hidden size)",
    "reference": "set beta=0 (no reference model) or use a smaller model",
    "weights": "use a smaller model or bf16 weights",
    "grads": "use a smaller model or bf16 weights",
    "engine_weights": "the rollout engine keeps whole weights on every rank: train LoRA adapters (model.lora_r) "
                      "or a smaller model",
    "gathered": "use a smaller model (FSDP gathers the root and one layer at a time)",
}


@dataclass
class MemoryEstimate:
    """Bytes per term; `total` sums them. `table()` is the human-readable form printed at start."""

    weights: int
    grads: int
    master_weights: int
    optimizer: int
    activations: int
    logits_chunk: int
    lm_head_grad: int
    kv_cache: int
    reference: int
    num_params: int
    activations_known: bool = True
    engine_weights: int = 0
    gathered: int = 0
    kv_released_in_update: bool = False  # generation.release_kv_during_update: the pool and the update never meet
    optimizer_offloaded: bool = False  # train.optimizer_offload: the optimizer term is on the device in the step only

    @property
    def terms(self) -> dict[str, int]:
        skip = {"num_params", "activations_known", "kv_released_in_update", "optimizer_offloaded"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @property
    def phases(self) -> dict[str, int]:
        """Bytes live at the peak of each phase of a step. backward: everything, less the KV pool when it is
        freed for the update and the optimizer's bucket when the moments live on the host; optimizer step:
        no activations or logprob buffers; generation: no gradients either (zero_grad frees them)."""
        t = self.terms
        resident = sum(t.values()) - self.grads - self.activations - self.logits_chunk - self.lm_head_grad
        resident -= self.optimizer + self.kv_cache  # every phase holds the rest
        kv_in_update = 0 if self.kv_released_in_update else self.kv_cache
        return {
            "backward": resident + self.grads + self.activations + self.logits_chunk + self.lm_head_grad
            + kv_in_update + (0 if self.optimizer_offloaded else self.optimizer),
            "optimizer_step": resident + self.grads + self.optimizer + kv_in_update,
            "generation": resident + self.kv_cache + (0 if self.optimizer_offloaded else self.optimizer),
        }

    @property
    def total(self) -> int:
        """The peak: the largest phase (every term at once unless the KV pool or the optimizer moments leave
        the device for part of the step)."""
        return max(self.phases.values())

    def table(self) -> str:
        lines = [f"memory estimate ({self.num_params / 1e6:.1f}M parameters)"]
        for name, value in self.terms.items():
            if name in ("engine_weights", "gathered") and not value:
                continue  # terms of sharded runs only
            note = "  (unknown: pass a model config)" if name == "activations" and not self.activations_known else ""
            lines.append(f"  {name:<15} {value / GIB:9.3f} GiB{note}")
        whole = sum(self.terms.values())
        note = (f"  (the largest phase, {max(self.phases, key=self.phases.__getitem__)}: not every term is on the "
                "device at once)" if self.total < whole else "")
        lines.append(f"  {'total':<15} {self.total / GIB:9.3f} GiB{note}")
        return "\n".join(lines)


def _get(config, name, default=None):
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _shape(config) -> dict[str, int]:
    hidden = int(_get(config, "hidden_size"))
    heads = int(_get(config, "num_attention_heads"))
    head_dim = int(_get(config, "head_dim", None) or hidden // heads)
    return {
        "H": hidden, "L": int(_get(config, "num_hidden_layers")), "I": int(_get(config, "intermediate_size")),
        "Q": heads * head_dim, "K": int(_get(config, "num_key_value_heads", None) or heads) * head_dim,
        "V": int(_get(config, "vocab_size")),
    }


def count_parameters(config) -> int:
    """Parameters of a Llama/Qwen2-style decoder from its config (biases on q/k/v when attention_bias or Qwen2)."""
    s = _shape(config)
    h, q, k = s["H"], s["Q"], s["K"]
    qkv_bias = bool(_get(config, "attention_bias", False)) or _get(config, "model_type") == "qwen2"
    attn = h * q + 2 * h * k + q * h + ((q + 2 * k) if qkv_bias else 0)
    layer = attn + 3 * h * s["I"] + 2 * h  # MLP gate/up/down and two RMSNorm weights
    tied = bool(_get(config, "tie_word_embeddings", False))
    return s["V"] * h * (1 if tied else 2) + s["L"] * layer + h


_LORA_SHAPES = {  # module name -> (in, out) features, in the shape names of _shape
    "q_proj": ("H", "Q"), "k_proj": ("H", "K"), "v_proj": ("H", "K"), "o_proj": ("Q", "H"),
    "gate_proj": ("H", "I"), "up_proj": ("H", "I"), "down_proj": ("I", "H"),
}


def count_lora_parameters(config, r: int, target_modules) -> int:
    """Adapter parameters of LoRA rank r on a Llama/Qwen2-style decoder: r x (in + out) per targeted linear
    per layer (A is r x in, B is out x r). `target_modules`: names among q/k/v/o_proj and gate/up/down_proj,
    or "all-linear" (all seven)."""
    s = _shape(config)
    names = list(_LORA_SHAPES) if target_modules in ("all-linear", ["all-linear"]) else list(target_modules)
    unknown = [n for n in names if n not in _LORA_SHAPES]
    if unknown or r <= 0:
        raise ConfigError(f"memory estimate LoRA r={r}, target_modules={names}: r must be >= 1 and the modules "
                          f"among {sorted(_LORA_SHAPES)} or 'all-linear' (unknown: {unknown})")
    return s["L"] * sum(r * (s[_LORA_SHAPES[n][0]] + s[_LORA_SHAPES[n][1]]) for n in names)


def _dtype_bytes(dtype) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    if dtype not in _BYTES:
        raise ConfigError(f"memory estimate dtype={dtype!r} is not known; use one of {sorted(_BYTES)}")
    return _BYTES[dtype]


def _activation_bytes(s, b, token_budget, gradient_checkpointing, compiled_layers=False) -> int:
    if compiled_layers:
        # inductor's partitioner keeps fewer tensors and recomputes the elementwise ones (norms, RoPE, SiLU);
        # fitted to the update peaks of bench/grpo_step.py's compiled fast rows on an H100 (docs/memory.md)
        per_layer_token = b * (3 * s["H"] + 2 * s["Q"] + 2 * s["K"] + 3 * s["I"]) + 4 * 2 * s["H"]
    else:
        per_layer_token = b * (7 * s["H"] + 3 * s["K"] + 4 * s["I"]) + 4 * 2 * s["H"]
    # Embedding output and the final hidden states fed to the logprob kernel.
    outer = 2 * b * s["H"]
    if gradient_checkpointing:
        return token_budget * (s["L"] * b * s["H"] + per_layer_token + outer)
    return token_budget * (s["L"] * per_layer_token + outer)


def _trained_parameters(num_params: int, lora_params) -> tuple[bool, int]:
    """Whether LoRA adapters train, and how many parameters have gradients, masters and moments."""
    if int(lora_params) < 0:
        raise ConfigError(f"memory estimate lora_params={lora_params} must be >= 0 (the adapters' parameter count)")
    lora = int(lora_params) > 0
    return lora, int(lora_params) if lora else num_params  # LoRA: only the adapters train


def _optimizer_bytes(optimizer: str, trained: int, state_bytes: int, offload: bool, s: dict[str, int]) -> int:
    """Device bytes of the optimizer state of `trained` parameters (one bucket's when offloaded)."""
    if offload and optimizer == "adamw":
        # moments on the host; the step brings one bucket's in (the biggest holds the embedding matrix)
        biggest = max(s["V"] * s["H"], 32 * 2**20) if s else 32 * 2**20
        return 2 * state_bytes * min(trained, biggest)
    return {"adamw": 2 * state_bytes * trained, "adamw_8bit": 2 * trained, "sgd": 0}[optimizer]


def _activations_term(s, b, token_budget, gradient_checkpointing, compiled_layers, shared_key_rows) -> int:
    """The activations term: the decoder's saved tensors plus the K/V rows shared prompts gather."""
    activations = _activation_bytes(s, b, token_budget, gradient_checkpointing, compiled_layers)
    if shared_key_rows:  # gathered K and V rows, kept per layer (one layer at a time when recomputed)
        activations += int(shared_key_rows) * 2 * s["K"] * b * (1 if gradient_checkpointing else s["L"])
    return activations


def _logits_chunk_bytes(s, b, token_budget, completion_tokens, chunk_tokens, fused, keep_logits) -> int:
    """The logprob kernel's buffers: one [chunk, vocab] chunk, plus every completion row's logits if kept."""
    # fused (compiled, CUDA) kernels keep two [chunk, vocab] tensors in the weight dtype (logits, gradient)
    # eager: the logits, an fp32 working copy (none when they are fp32 already), exp(logits) in fp32 and the
    # gradient cast back to the weight dtype: 8 bytes per element in fp32, 12 in bf16 (measured on the CPU)
    per_element = 2 * b if fused else (8 if b == 4 else 2 * b + 8)
    # the kernel's input is the micro-batch's completion tokens: a chunk never holds more rows than that
    completion_rows = min(token_budget, token_budget if completion_tokens is None else completion_tokens)
    logits = min(chunk_tokens, completion_rows) * s["V"] * per_element
    if keep_logits:  # every completion row's logits, in the weight dtype, held from forward to backward
        logits += completion_rows * s["V"] * b
    return logits


def _lm_head_grad_bytes(s, b, lm_head_grad_fp32: bool, lora: bool) -> int:
    """The LM-head weight gradient the logprob kernel's backward sums over chunks."""
    if lora:  # a frozen LM head: the logprob kernel computes no weight gradient
        return 0
    # fp32 sum plus one chunk's product; or (lm_head_grad_fp32=False) one buffer in the weight dtype
    return s["V"] * s["H"] * ((4 + b) if lm_head_grad_fp32 or b == 4 else b)


def _per_rank(est: MemoryEstimate, model_config, s, b, lora: bool, shards: int) -> MemoryEstimate:
    """The per-rank figure of `est` (one replica's) when FSDP shards the training state over `shards` ranks."""
    p = est.num_params
    train_bytes = 4 if est.master_weights else b  # the masters are the sharded parameters themselves
    root = s["V"] * s["H"] * (1 if _get(model_config, "tie_word_embeddings", False) else 2) if s else 0
    layer = (p - root) // max(1, s["L"]) if s else 0
    # LoRA: the base (weight dtype) and the fp32 adapters are both sharded; only the adapters have gradients
    return replace(
        est, weights=(est.weights if lora else p * train_bytes) // shards,
        grads=(est.grads if lora else p * train_bytes) // shards, master_weights=0,
        optimizer=est.optimizer // shards, reference=est.reference // shards,
        # the engine keeps whole weights in the compute dtype; FSDP gathers the root and about two layers
        engine_weights=p * b + est.engine_weights, gathered=(root + 2 * layer) * b,
    )


def estimate_memory(
    model_config_or_num_params,
    *,
    dtype="bf16",
    optimizer: str = "adamw",
    master_weights_fp32: bool = True,
    token_budget: int = 4096,
    gradient_checkpointing: bool = False,
    kv_cache_bytes: int = 0,
    reference_model: bool = False,
    chunk_tokens: int = 1024,
    lm_head_grad_fp32: bool = True,
    fused_logprob_kernels: bool = False,
    optimizer_offload: bool = False,
    shards: int | None = None,
    completion_tokens: int | None = None,
    engine_bytes: int = 0,
    kv_released_in_update: bool = False,
    compiled_layers: bool = False,
    lora_params: int = 0,
    keep_logits: bool = False,
    shared_key_rows: int = 0,
) -> MemoryEstimate:
    """Bytes needed to train (see the module docstring for every term). Pass an HF config (or a dict of its
    fields) for activations and logits; a bare parameter count gives weights and optimizer terms only.
    token_budget: tokens of the largest forward/backward (micro-batch); completion_tokens: how many of them
    are completion tokens, the logprob kernel's input (None: all of them). engine_bytes: what the rollout
    engine keeps beside its KV pool (fused projection copies), added to engine_weights.
    shards=N: the per-rank figure of a run sharded with FSDP over N ranks (N=1 is FSDP on one process).
    lora_params: LoRA adapter parameters (count_lora_parameters gives them from the config); 0: every
    parameter of the model trains. keep_logits: the logprob kernel keeps all its logits for the backward.
    shared_key_rows: keys a shared-prompt row's attention gathers beyond its tokens (cohort.forward.shared_prompts), each
    keeping a K and a V row per layer for the backward."""
    if optimizer not in _OPTIMIZERS:
        raise ConfigError(f"memory estimate optimizer={optimizer!r} is not known; use one of {list(_OPTIMIZERS)}")
    b = _dtype_bytes(dtype)
    known = not isinstance(model_config_or_num_params, int)
    # a bare parameter count has no shape (`s` is empty): every term that reads `s` is guarded by `known`
    s: dict[str, int] = _shape(model_config_or_num_params) if known else {}
    p = count_parameters(model_config_or_num_params) if known else int(model_config_or_num_params)
    lora, t = _trained_parameters(p, lora_params)
    master = 4 * t if master_weights_fp32 and b != 4 and not lora else 0  # adapters are fp32 already
    state_bytes = 4 if (master_weights_fp32 or b == 4 or lora) else b
    est = MemoryEstimate(
        weights=p * b + (4 * t if lora else 0), grads=4 * t if lora else p * b, master_weights=master,
        optimizer=_optimizer_bytes(optimizer, t, state_bytes, optimizer_offload, s),
        activations=_activations_term(s, b, token_budget, gradient_checkpointing, compiled_layers,
                                      shared_key_rows) if known else 0,
        logits_chunk=_logits_chunk_bytes(s, b, token_budget, completion_tokens, chunk_tokens,
                                         fused_logprob_kernels, keep_logits) if known else 0,
        lm_head_grad=_lm_head_grad_bytes(s, b, lm_head_grad_fp32, lora) if known else 0,
        kv_cache=int(kv_cache_bytes), reference=p * b if reference_model else 0, num_params=p,
        activations_known=known, engine_weights=engine_bytes, kv_released_in_update=kv_released_in_update,
        optimizer_offloaded=optimizer_offload,
    )
    return est if shards is None else _per_rank(est, model_config_or_num_params, s, b, lora, shards)


def check_fits(estimate: MemoryEstimate, device_free_bytes: int, *, headroom: float = 0.9) -> None:
    """Raise ConfigError, naming the biggest terms and what to lower, when the estimate exceeds
    `headroom` x free device memory (the rest covers allocator fragmentation and CUDA workspaces)."""
    budget = int(device_free_bytes * headroom)
    if estimate.total <= budget:
        return
    ranked = sorted(((v, k) for k, v in estimate.terms.items() if v > 0), reverse=True)[:3]
    advice = "; ".join(f"{k} {v / GIB:.2f} GiB: {_ADVICE[k]}" for v, k in ranked)
    raise ConfigError(
        f"the run needs about {estimate.total / GIB:.2f} GiB but the device has {device_free_bytes / GIB:.2f} GiB "
        f"free ({headroom:.0%} usable = {budget / GIB:.2f} GiB). Biggest terms: {advice}.\n{estimate.table()}"
    )


def device_free_bytes(device: torch.device | str | None = None) -> int | None:
    """Free bytes on a CUDA device (None on the CPU, where the check is skipped)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)
