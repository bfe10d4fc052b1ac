"""The update's packed attention, forward + backward, under torch's flash-attention implementations (one GPU).

    PYTHONPATH=src:. python3 bench/attn_train.py [--direct] [--impl FA4] [--cudnn]

The training forward's attention (`cohort.forward.packed_attention._flash_varlen`: torch's `varlen_attn`, grouped KV
heads as they are where `prepare_flash` found the kernel takes them, expanded otherwise; this script runs that
check first, as the trainer does) on the bench workload's micro-batches: Qwen2.5-0.5B (14 query /
2 KV heads of 64, 86 sequences of 128 + 256 tokens = the fast row's 33,024-token micro-batch) and 1.5B (12 / 2
of 128, 32 sequences = 12,288 tokens), each also with completions of 1-256 tokens. First with torch's built-in
FlashAttention-2, then, with --impl, after `torch.nn.attention.activate_flash_attention_impl(impl)` (FA4 needs
the flash-attn-4 package and the CUTLASS DSL), which routes the same aten flash ops to that implementation,
with --direct FA4 through its own varlen function (grouped query heads in the kernel, no KV expansion), and
with --cudnn cuDNN's attention through its aten forward and backward ops (`cudnn_varlen`, grouped KV heads),
and whether its causal mask aligns a shorter query segment to the end of its keys (`cudnn_alignment`).

Each row: the device time of one forward + backward (the sum of its kernels under torch.profiler, so the host's
launch time does not count), TFLOP/s on the causal FLOPs (forward 4 x sum(L^2 / 2) x heads x head size,
backward 2.5x that), and the largest difference of the output and of dQ, dK, dV from the FlashAttention-2 run.
"""

from __future__ import annotations

import argparse
import random

import torch

SHAPES = {"0.5b": (14, 2, 64, 86), "1.5b": (12, 2, 128, 32)}  # query heads, KV heads, head size, sequences


def lengths(kind: str, seqs: int, prompt: int = 128, completion: int = 256) -> list[int]:
    if kind == "equal":
        return [prompt + completion] * seqs
    rng = random.Random(0)
    return [prompt + rng.randint(1, completion) for _ in range(seqs)]


def device_ms(fn, repeats: int) -> float:
    """Mean device time of fn() in ms: the kernels' own durations under the profiler (host launch excluded)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1000 / repeats


def fa4_direct(q, k, v, cu, cu_k, max_len, max_k, scale):
    """FlashAttention-4's own varlen entry point (flash_attn.cute): query heads grouped over the KV heads in the
    kernel, where torch's flash ops need the KV heads expanded first."""
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, max_seqlen_q=max_len,
                                 max_seqlen_k=max_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


class _CudnnVarlen(torch.autograd.Function):
    """cuDNN's ragged (THD) attention through its aten forward and backward ops, called explicitly (torch's
    `varlen_attn` keeps this backend switched off). KV heads as given: grouped where cuDNN takes them."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True,
                                                      False, scale=scale)
        out, lse, seed, offset = res[0], res[1], res[6], res[7]
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, seed, offset, cu_q, cu_k = ctx.saved_tensors
        max_q, max_k, scale = ctx.args
        dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
            dout.contiguous(), q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0, True,
            scale=scale)
        return dq, dk, dv, None, None, None, None, None


def cudnn_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """cuDNN's attention on the same packed rows, KV heads grouped (expanded if cuDNN refuses them)."""
    try:
        return _CudnnVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)
    except RuntimeError as exc:
        rep = q.shape[1] // k.shape[1]
        if rep == 1:
            raise
        print(f"(cuDNN refused grouped KV heads: {exc!r:.160}; expanding)", flush=True)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _CudnnVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def cudnn_alignment() -> None:
    """Whether cuDNN's causal mask is aligned to the end of a longer key segment (FlashAttention's convention,
    which shared-prompt rows need): completions of 1-256 tokens after their own 128-token prompt keys."""
    from torch.nn.attention.varlen import varlen_attn

    dev = torch.device("cuda")
    rng = random.Random(1)
    comp = [rng.randint(1, 256) for _ in range(16)]
    cu_q = torch.tensor([0, *torch.tensor(comp).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    klen = [128 + c for c in comp]
    cu_k = torch.tensor([0, *torch.tensor(klen).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(sum(comp), 14, 64, device=dev, dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(sum(klen), 14, 64, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2))
    want = varlen_attn(q, k, v, cu_q, cu_k, max(comp), max(klen), scale=0.125)
    try:
        got = cudnn_varlen(q, k, v, cu_q, cu_k, max(comp), max(klen), 0.125)
        print(f"cuDNN, query segments shorter than key segments: largest difference from FA2 "
              f"{(got.float() - want.float()).abs().max().item():.3g} (small: aligned to the end)", flush=True)
    except Exception as exc:
        print(f"cuDNN with cu_k != cu_q failed: {exc!r:.300}", flush=True)


def run(impl: str, results: dict, repeats: int, attend=None) -> None:
    from cohort.forward.packed_attention import _flash_varlen

    attend = attend or _flash_varlen

    dev = torch.device("cuda")
    for size, (hq, hk, d, seqs) in SHAPES.items():
        for kind in ("equal", "mixed"):
            lens = lengths(kind, seqs)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            gen = torch.Generator(device=dev).manual_seed(0)
            total = sum(lens)

            def rand(h, gen=gen, total=total, d=d):
                return torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=gen)

            q, k, v, grad = rand(hq).requires_grad_(), rand(hk).requires_grad_(), rand(hk).requires_grad_(), rand(hq)

            def once(q=q, k=k, v=v, grad=grad, cu=cu, lens=lens, d=d):
                for t in (q, k, v):
                    t.grad = None
                out = attend(q, k, v, cu, cu, max(lens), max(lens), d ** -0.5)
                out.backward(grad)
                return out

            try:
                ms = device_ms(once, repeats)
                out = once().detach()
            except Exception as exc:  # one implementation failing on a shape must not hide the others
                print(f"| {size} | {kind} | {impl} | failed: {exc!r:.200} | | |", flush=True)
                continue
            grads = [t.grad.detach().clone() for t in (q, k, v)]
            ref = results.setdefault((size, kind), (out, grads))
            d_out = (out.float() - ref[0].float()).abs().max().item()
            d_grad = max((g.float() - r.float()).abs().max().item() for g, r in zip(grads, ref[1]))
            flops = 3.5 * sum(4 * n * n / 2 * hq * d for n in lens)
            print(f"| {size} | {kind} ({total} tokens) | {impl} | {ms:.3f} | {flops / ms / 1e9:.0f} | "
                  f"{d_out:.1e} / {d_grad:.1e} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", default=None, help="also after activate_flash_attention_impl(IMPL), e.g. FA4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--direct", action="store_true",
                   help="also FA4 through flash_attn.cute.flash_attn_varlen_func (needs flash-attn-4)")
    p.add_argument("--cudnn", action="store_true", help="also cuDNN's attention through its aten op (cudnn_varlen)")
    args = p.parse_args()
    import torch.nn.attention as tna

    listed = tna.list_flash_attention_impls() if hasattr(tna, "list_flash_attention_impls") else []
    print(f"torch {torch.__version__}; flash-attention implementations this torch can activate: {listed}")
    print("| model | micro-batch | flash attention | fwd + bwd device ms | TFLOP/s | max diff out / grads vs FA2 |")
    print("| --- | --- | --- | ---: | ---: | --- |")
    from cohort.forward.packed_attention import GROUPED_KV, prepare_flash

    prepare_flash("cuda")
    print(f"grouped KV heads into torch's FA2: {GROUPED_KV['native']}")
    results: dict = {}
    run("FA2 (torch built-in)", results, args.repeats)
    if args.direct:
        run("FA4 (flash_attn.cute, GQA in the kernel)", results, args.repeats, fa4_direct)
    if args.cudnn:
        run("cuDNN (aten._cudnn_attention_forward, THD)", results, args.repeats, cudnn_varlen)
        cudnn_alignment()
    if args.impl:
        try:
            tna.activate_flash_attention_impl(args.impl)
        except Exception as exc:  # missing package: say which, keep the FA2 rows
            print(f"activate_flash_attention_impl({args.impl!r}) failed: {exc!r:.300}")
            return
        run(args.impl, results, args.repeats)


if __name__ == "__main__":
    main()
