"""How a packed row's attention sees only its own sequence.

A packed row is many (prompt, completion) sequences laid end to end (`cohort.forward.packing`), with
`cu_seq_lens` marking where each begins. `enable_packed_attention` routes the model's attention (once,
permanently) through `varlen_attention_forward`, registered with transformers' `AttentionInterface` as
VARLEN_IMPL:

- with `cu_seq_lens`: on CUDA in bf16/fp16 a flash-attention varlen kernel (no mask tensor), and causal SDPA
  over each sequence elsewhere (exact, cheap enough on the CPU). The CUDA kernel is `model.packed_attention`:
  "torch" (default) is torch's built-in FlashAttention-2 (`torch.nn.attention.varlen.varlen_attn`); "fa4" is
  FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`; Hopper and Blackwell) through the custom
  ops of `cohort.forward.fa4_attention`, with the query heads grouped over the KV heads inside the kernel;
- without them (generate, ordinary forwards): the model's previous implementation, unchanged;
- with `cohort_context` (a rank's share of a context-parallel row): that shard's attention over the K/V its
  group gathers (cohort.forward.context_attention).

Sliding-window layers (Mistral, Gemma 3's local layers, Qwen with use_sliding_window) hand their window to
the attention function as `sliding_window`; both packed paths honour it inside each sequence (flash
window_size=(W - 1, 0), a windowed causal mask in the SDPA fallback), as transformers' own masks do.
While a packed forward runs (`_PACKED_MASKS` set), the registered mask function builds no mask at all, and
transformers' search for packed sequences in the position ids (`find_packed_sequence_indices`, whose result
only feeds that mask) is skipped: its `.all()` made the host wait for the GPU once per micro-batch, leaving
the device idle while the host then launched the forward's first kernels.
Attention sinks (GPT-OSS: a learned per-head logit that joins every softmax and takes no value) and
attention-logit soft-capping (Gemma 2: scores = c * tanh(scores / c)) are in neither flash kernel nor SDPA: a
layer that passes `s_aux` or `softcap` runs the explicit per-segment softmax of `_segment_eager` on every device
(announced once on CUDA as the slower path it is), so the sinks learn and the cap applies as in the model's own
eager attention. A context-parallel row refuses both (its ring kernel has neither).
Flash-attention-2/3 models already understand the same `cu_seq_lens_*` kwargs and are left as they are.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import sys
import warnings

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, masking_utils
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cohort.errors import ConfigError

try:  # torch's FlashAttention-2 over packed rows; an older torch runs exact per-sequence SDPA instead
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None  # type: ignore[assignment]
from cohort.forward.fa4_attention import fa4_varlen

VARLEN_IMPL = "cohort_varlen"
KERNELS = ("torch", "fa4")  # model.packed_attention
_KERNEL = {"name": "torch"}  # process-wide: the policy and its reference share the packed pass


def use_packed_kernel(name: str, device: torch.device | str | None = None) -> None:
    """Choose the CUDA kernel of packed attention (model.packed_attention), checked before any model loads:
    "fa4" needs a CUDA device and an importable `flash_attn.cute`, else a ConfigError saying the fix."""
    if name not in KERNELS:
        raise ConfigError(f"model.packed_attention={name!r} is not a packed-attention kernel; choose one of "
                          f"{', '.join(KERNELS)}")
    if name == "fa4":
        dev = torch.device(device) if device is not None else None
        if dev is not None and dev.type != "cuda":
            raise ConfigError(f"model.packed_attention='fa4' runs FlashAttention-4 on CUDA GPUs, but this run trains "
                              f"on {dev.type}; set model.packed_attention=torch (on the CPU the packed forward uses "
                              "exact per-sequence SDPA)")
        try:  # optional dependency: FlashAttention-4 (model.packed_attention=fa4)
            from flash_attn.cute.interface import (  # type: ignore[import-not-found]  # noqa: F401
                _flash_attn_bwd,
                _flash_attn_fwd,
            )
        except Exception as exc:  # ImportError, or the CUTLASS DSL failing to load its libraries
            raise ConfigError(f"model.packed_attention='fa4' needs FlashAttention-4 (`pip install flash-attn-4`, "
                              f"Hopper or Blackwell GPUs), which does not import here: {exc!r:.300}; or set "
                              "model.packed_attention=torch") from exc
    _KERNEL["name"] = name


def packed_kernel() -> str:
    """The CUDA kernel packed attention runs now ("torch" or "fa4")."""
    return _KERNEL["name"]


def _has_varlen_attn() -> bool:
    return varlen_attn is not None


# Whether varlen_attn takes fewer KV heads than query heads: with `enable_gqa=True` where the keyword exists;
# torch 2.11 lacks it, but its FlashAttention-2 kernel groups the query heads over the KV heads by itself, which
# `prepare_flash` checks once against expanded heads. Unchecked (None) or refused, the KV heads are expanded:
# on Qwen2.5-0.5B (14 query heads, 2 KV heads) that writes 7 copies of every key and value in each layer and
# sums their gradients back. A plain dict, set eagerly, so compiled layers read constants ("keyword": pass
# enable_gqa=True).
GROUPED_KV: dict[str, bool | None] = {"native": None, "keyword": False}


def _varlen_has_gqa_keyword() -> bool:
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def prepare_flash(device) -> None:
    """Before the first packed forward on a CUDA device (outside compiled code): decide, once, whether
    varlen_attn can be handed grouped KV heads (see GROUPED_KV). Forward and gradients must equal the expanded run."""
    device = torch.device(device)
    if GROUPED_KV["native"] is not None or device.type != "cuda" or not _has_varlen_attn():
        return
    if _varlen_has_gqa_keyword():
        GROUPED_KV["native"] = GROUPED_KV["keyword"] = True
        return
    GROUPED_KV["native"] = ok = _grouped_kv_works(device)
    if not ok:
        _announce_slow_path("the KV heads are expanded to the query heads in every layer (slower, more memory "
                            "on models with fewer KV than query heads)",
                            "this torch's varlen_attn neither takes enable_gqa nor groups KV heads correctly")


def _grouped_kv_works(device: torch.device) -> bool:
    """Whether varlen_attn on `device` gives grouped KV heads the forward and gradients of expanded ones."""
    with torch.inference_mode(False):
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(48, h, 64, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
                   for h in (4, 2, 2))
        cu = torch.tensor([0, 16, 48], device=device, dtype=torch.int32)
        grad_out = torch.randn(48, 4, 64, device=device, generator=gen, dtype=torch.bfloat16)

    def run(k_in, v_in):
        out = varlen_attn(q, k_in, v_in, cu, cu, 32, 32, window_size=(-1, 0))
        return (out, *torch.autograd.grad(out, (q, k, v), grad_out))

    try:
        # the first packed forward may come under no_grad (old or reference logprobs) or inference mode (an
        # engine built there): the check needs gradients either way
        with torch.inference_mode(False), torch.enable_grad():
            grouped = run(k, v)
            expanded = run(k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1))
        ok = all(a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)
                 for a, b in zip(grouped, expanded, strict=True))
    except RuntimeError:  # a kernel that checks the head counts
        ok = False
    return ok


def grouped_kv(query, key, value, kwargs: dict):
    """(key, value) for varlen_attn on [T, H, D] tensors with fewer KV heads than query heads: as they are where
    GROUPED_KV says the kernel takes them (adding enable_gqa=True to `kwargs` where the keyword exists), else
    expanded to the query heads. Shared by the packed forward and the engine's prefill."""
    if query.shape[1] == key.shape[1]:
        return key, value
    if GROUPED_KV["native"]:
        if GROUPED_KV["keyword"]:
            kwargs["enable_gqa"] = True
        return key, value
    rep = query.shape[1] // key.shape[1]
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


def _flash_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scaling, window=None):
    """varlen_attn on [T, H, D] tensors, grouped KV heads as they are where torch takes them (GROUPED_KV), else
    expanded. window W (sliding-window layers): each query sees its own and the W - 1 previous keys. A query
    segment shorter than its key segment (a completion after its shared prompt) is aligned to the segment's
    end, as flash attention aligns causal masks."""
    kwargs = {"scale": scaling, "window_size": (-1 if window is None else window - 1, 0)}  # (-1, 0): causal
    key, value = grouped_kv(query, key, value, kwargs)
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)


def _fa4_varlen(query, key, value, cu_q, cu_k, max_q, max_k, scaling, window=None):
    """FlashAttention-4's varlen attention on [T, H, D] tensors, grouped query heads in the kernel, through
    the custom ops of cohort.forward.fa4_attention (one opaque op inside a compiled layer, not a graph break)."""
    return fa4_varlen(query, key, value, cu_q, max_q, scaling, window, cu_k=cu_k, max_len_k=max_k)


def _flash_eligible(query) -> bool:
    """Whether this packed forward runs a flash varlen kernel (CUDA, half precision) rather than exact SDPA."""
    if not (query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)):
        return False
    return _KERNEL["name"] == "fa4" or _has_varlen_attn()


def _on_cuda(query) -> bool:
    return bool(query.is_cuda)


def _slow_path_reason(query) -> str | None:
    """Why a packed forward on CUDA takes the per-segment SDPA loop instead of a flash kernel; None off CUDA
    (where the loop is the designed path) or when a flash kernel runs."""
    if not _on_cuda(query) or _flash_eligible(query):
        return None
    if query.dtype not in (torch.float16, torch.bfloat16):
        return (f"the flash varlen kernels take bfloat16/float16 and this forward runs in {query.dtype} "
                "(model.dtype=bfloat16 takes the fast path)")
    return ("this torch has no torch.nn.attention.varlen.varlen_attn (a newer torch has it; or "
            "model.packed_attention=fa4 with flash-attn-4)")


_WARNED: set[str] = set()  # the slow-path reasons already announced in this process


@torch.compiler.disable  # a graph break only on this slow path, which breaks the graph anyway (.tolist())
def _announce_slow_path(what: str, reason: str) -> None:
    """One warning per reason and process, the first time a slower path is taken on CUDA."""
    if reason in _WARNED:
        return
    _WARNED.add(reason)
    warnings.warn(f"packed attention on CUDA: {what}, because {reason}", RuntimeWarning, stacklevel=3)


def _segments(query, key, value, cu_q, cu_k):
    """Each segment's (query, key, value), the KV heads expanded to the query heads."""
    rep = query.shape[1] // key.shape[1]
    for (qa, qb), (ka, kb) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True):
        k = key[:, :, ka:kb].repeat_interleave(rep, dim=1) if rep > 1 else key[:, :, ka:kb]
        v = value[:, :, ka:kb].repeat_interleave(rep, dim=1) if rep > 1 else value[:, :, ka:kb]
        yield query[:, :, qa:qb], k, v


def _segment_mask(q_len: int, k_len: int, window: int | None, device) -> torch.Tensor:
    """[q, k] visibility of a query segment aligned to the end of its key segment: key j is visible from query i
    when i - W < j <= i (transformers' sliding_window_overlay; no lower bound without a window)."""
    keys = torch.arange(k_len, device=device)
    queries = keys[k_len - q_len:]
    mask = keys[None, :] <= queries[:, None]
    if window is not None:
        mask &= keys[None, :] > queries[:, None] - window
    return mask


def _segment_sdpa(query, key, value, cu_q, cu_k, scaling, window=None):
    """Exact fallback: causal (optionally sliding-window) SDPA over each segment separately, a query segment
    aligned to the end of its key segment (they differ for a completion after its shared prompt).
    query [1, Hq, T, D], key/value [1, Hkv, K, D] -> [1, T, Hq, D]."""
    outs = []
    for q, k, v in _segments(query, key, value, cu_q, cu_k):
        if q.shape[2] == k.shape[2] and (window is None or k.shape[2] <= window):
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling))
        else:
            mask = _segment_mask(q.shape[2], k.shape[2], window, query.device)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2)


def _segment_eager(query, key, value, cu_q, cu_k, scaling, window=None, softcap=None, sinks=None):
    """Explicit softmax attention over each segment, for what SDPA and the flash kernels lack: an
    attention-logit cap (scores -> c * tanh(scores / c), Gemma 2) and attention sinks (one learned logit per
    head that joins each query's softmax and carries no value, GPT-OSS). The masks are `_segment_sdpa`'s.
    query [1, Hq, T, D], key/value [1, Hkv, K, D], sinks [Hq] -> [1, T, Hq, D]."""
    outs = []
    for q, k, v in _segments(query, key, value, cu_q, cu_k):
        scores = torch.matmul(q, k.transpose(2, 3)).float() * scaling  # [1, H, q, k]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~_segment_mask(q.shape[2], k.shape[2], window, query.device), float("-inf"))
        if sinks is not None:  # the sink's column joins the softmax, then is dropped: it only takes weight away
            sink = sinks.float().reshape(1, -1, 1, 1).expand(1, scores.shape[1], scores.shape[2], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        outs.append(torch.matmul(probs.to(v.dtype), v))
    return torch.cat(outs, dim=2).transpose(1, 2)


# Set only while a packed forward builds its masks; the attention kernels themselves key off cu_seq_lens,
# which autograd's checkpoint recomputation replays, so backward needs no flag.
_PACKED_MASKS = contextvars.ContextVar("cohort_packed_masks", default=False)
# id(config) -> the implementation the model had before; kept off the config so save_pretrained stays clean.
_FALLBACK: dict[int, str] = {}


def _fallback_name(config) -> str:
    """The model's own attention implementation, used for every call that is not a packed forward."""
    name = _FALLBACK.get(id(config), "sdpa")
    return name if name in ALL_ATTENTION_FUNCTIONS or name == "eager" else "sdpa"


def _fallback_attention(module):
    """The attention function the model had before packing. "eager" lives in each modeling file, not in the
    registry, and is the model's own: Gemma 2's soft-capping and GPT-OSS's sinks are only there (sdpa would
    silently drop them), so it is looked up in the module's modeling file."""
    name = _fallback_name(module.config)
    if name == "eager":
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is not None:
            return eager
        name = "sdpa"  # a modeling file without its own eager function computes plain softmax attention
    return ALL_ATTENTION_FUNCTIONS[name]


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: packed rows (cu_seq_lens_q given) or the model's own attention."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        fallback = _fallback_attention(module)
        return fallback(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise RuntimeError(f"packed forward expects one row, got a batch of {query.shape[0]}")
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    window = kwargs.get("sliding_window")
    window = int(window) if window else None
    context = kwargs.get("cohort_context")
    if context is not None:  # this rank's chunks of a context-parallel row (cohort.forward.context_attention)
        if softcap is not None or sinks is not None:
            raise ConfigError("train.context_parallel: this model's attention has "
                              f"{'attention sinks (GPT-OSS)' if sinks is not None else f'a logit softcap={softcap}'}, "
                              "which the context-parallel ring kernel does not compute; set train.context_parallel=1")
        return context.attend(query, key, value, scaling, window), None
    # a shared-prompt row (cohort.forward.shared_prompts): each key segment gathers its prompt's rows and its own
    kv_index = kwargs.get("cohort_kv_index")
    cu_k = cu if kv_index is None else kwargs["cu_seq_lens_k"]
    if kv_index is not None:
        # Gathered through fp32: the gather's backward sums the G completions' gradients into each prompt row
        # (index_add), which in bf16 needs compare-and-swap loops (47 us a call on an H100 for a 0.5B row) and
        # rounds at every addition; fp32 adds are native atomics and round once, on the cast back.
        key = key.float().index_select(2, kv_index).to(key.dtype)
        value = value.float().index_select(2, kv_index).to(value.dtype)
    if softcap is not None or sinks is not None:
        if _on_cuda(query):
            _announce_slow_path("an explicit per-segment softmax (slower than a flash varlen kernel)",
                                "this model's attention has attention sinks or a logit softcap, which the flash "
                                "varlen kernels do not compute")
        return _segment_eager(query, key, value, cu, cu_k, scaling, window, softcap, sinks), None
    if _flash_eligible(query):
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
        attend = _fa4_varlen if _KERNEL["name"] == "fa4" else _flash_varlen
        cu_q32 = cu.to(torch.int32)
        cu_k32 = cu_q32 if kv_index is None else cu_k.to(torch.int32)
        out = attend(q, k, v, cu_q32, cu_k32, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), scaling,
                     window)
        return out.unsqueeze(0), None
    reason = _slow_path_reason(query)
    if reason is not None:
        _announce_slow_path("a per-segment SDPA loop in Python (slower than a flash varlen kernel)", reason)
    return _segment_sdpa(query, key, value, cu, cu_k, scaling, window), None


def _varlen_mask(*args, config=None, **kwargs):
    """No mask tensor inside a packed forward (boundaries come from cu_seqlens); the model's own mask otherwise."""
    if _PACKED_MASKS.get():
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[_fallback_name(config)](*args, config=config, **kwargs)


def _skip_packed_search_in_packed_forwards() -> None:
    """Wrap transformers' `find_packed_sequence_indices` (once) so that it answers None inside a packed forward:
    there the mask it would feed is never built (`_varlen_mask`), and its `.all()` is a host-device sync."""
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_cohort_wrapped", False):
        return

    def find_packed_sequence_indices(position_ids):
        return None if _PACKED_MASKS.get() else original(position_ids)

    find_packed_sequence_indices._cohort_wrapped = True  # type: ignore[attr-defined]
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


def enable_packed_attention(model) -> None:
    """Route the model's attention through VARLEN_IMPL (idempotent).

    The switch is permanent on purpose: gradient checkpointing recomputes layers during backward, after any
    context manager would have exited, and the recomputation must use the same kernel. Calls without
    cu_seq_lens (generate, ordinary forwards) go to the model's previous implementation unchanged.
    Flash-attention models already understand cu_seq_lens and are left alone.
    """
    config = model.config
    current = str(config._attn_implementation)
    if current == VARLEN_IMPL or current.startswith("flash_attention"):
        return
    AttentionInterface.register(VARLEN_IMPL, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_IMPL, _varlen_mask)
    _skip_packed_search_in_packed_forwards()
    _FALLBACK[id(config)] = current
    config._attn_implementation = VARLEN_IMPL


def disable_packed_attention(model) -> None:
    """Undo `enable_packed_attention` (the model's previous attention implementation comes back)."""
    config = model.config
    if config._attn_implementation == VARLEN_IMPL:
        config._attn_implementation = _FALLBACK.pop(id(config), "sdpa")
