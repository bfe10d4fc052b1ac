"""The update's non-matmul kernels in isolation, on the bench workload's shapes (one GPU).

    PYTHONPATH=src:bench:. python3 bench/update_kernels.py [--tokens 23000] [--skip-autotune]

Rows (device time of each, CUDA events, median of --repeats after warm-up; `engine_profile.gpu_ms`):
- the logprob backward's elementwise pass over one chunk of logits ([--chunk, 151936] bf16): torch.compile's
  fused function (`cohort.forward.logprobs._grad_fused`) against the Triton kernel (`cohort.forward.triton_logprobs.grad`),
  with the bandwidth each moves (one read and one write of the chunk);
- the logprob forward's statistics over the same chunk: the Triton one-pass kernel at several block sizes and
  warp counts (the default first, then the same without the entropy);
- Qwen2.5-0.5B's input projections (q, k, v; gate, up) as separate GEMMs against one GEMM over concatenated
  weights, forward + backward;
- Qwen2.5-0.5B's MLP (gate and up 896 -> 4864, SiLU * up, down 4864 -> 896) forward + backward on --tokens
  rows: eager, torch.compile (the trainer's compiled layers) and torch.compile in max-autotune mode (Triton
  matmul templates that may take the SiLU * up into their epilogue), with its compile time.
"""

from __future__ import annotations

import argparse
import time

import torch
from engine_profile import gpu_ms  # bench/ is the script's folder, so on sys.path


def logprob_rows(chunk: int, vocab: int, repeats: int) -> list[str]:
    from cohort.forward import logprobs, triton_logprobs

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(chunk, vocab, device=dev, generator=gen) * 3).bfloat16()
    labels = torch.randint(0, vocab, (chunk,), device=dev, generator=gen)
    _, lse, ent = triton_logprobs.stats(logits, labels, 1.0, True)
    gl, ge = torch.randn(chunk, device=dev, generator=gen), torch.zeros(chunk, device=dev)
    buffer = logits.clone()
    gbytes = 2 * logits.numel() * logits.element_size() / 1e9  # read + write
    compiled = torch.compile(logprobs._grad_fused, dynamic=True)
    torch._dynamo.mark_static(logits, 1)
    want = compiled(logits, labels, lse, ent, gl, ge, 1.0)
    got = triton_logprobs.grad(buffer.copy_(logits), labels, lse, ent, gl, ge, 1.0)
    diff = (got.float() - want.float()).abs().max().item()
    out = [f"| logprob gradient, [{chunk}, {vocab}] bf16 | ms | GB/s (read + write) |", "| --- | ---: | ---: |"]
    for name, fn in (("torch.compile (until now)", lambda: compiled(logits, labels, lse, ent, gl, ge, 1.0)),
                     ("Triton, in place", lambda: triton_logprobs.grad(buffer, labels, lse, ent, gl, ge, 1.0))):
        ms = gpu_ms(fn, repeats)
        out.append(f"| {name} | {ms:.3f} | {gbytes / ms * 1e3:,.0f} |")
    out.append(f"(largest difference of the two gradients: {diff:.3g})")

    read = logits.numel() * logits.element_size() / 1e9
    out += ["", f"| logprob statistics, [{chunk}, {vocab}] bf16 | ms | GB/s (one read) |", "| --- | ---: | ---: |"]
    n = chunk
    chosen, lse2, ent2 = (torch.empty(n, device=dev) for _ in range(3))
    variants = [(triton_logprobs.BLOCK_V, 8, True), (triton_logprobs.BLOCK_V, 8, False), (2048, 8, True),
                (4096, 8, True), (8192, 16, True), (16384, 16, True)]
    for block, warps, entropy in variants:
        def run(block=block, warps=warps, entropy=entropy):
            triton_logprobs._stats_kernel[(n,)](logits, labels, chosen, lse2, ent2, logits.stride(0), 1.0,
                                                 VOCAB=vocab, ENTROPY=entropy, BLOCK=block, num_warps=warps)
        ms = gpu_ms(run, repeats)
        ok = torch.allclose(lse2, lse, atol=1e-4) and (not entropy or torch.allclose(ent2, ent, atol=1e-3))
        default = block == triton_logprobs.BLOCK_V and warps == 8 and entropy
        out.append(f"| block {block}, {warps} warps{'' if entropy else ', no entropy'}{' (default)' if default else ''}"
                   f"{'' if ok else ' (MISMATCH)'} | {ms:.3f} | {read / ms * 1e3:,.0f} |")
    return out


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 896, inter: int = 4864):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, inter, bias=False)
        self.up = torch.nn.Linear(hidden, inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def mlp_rows(tokens: int, repeats: int, autotune: bool) -> list[str]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(tokens, 896, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, 896, device=dev, dtype=torch.bfloat16)
    flops = 3 * 2 * tokens * 3 * 896 * 4864
    out = [f"| Qwen2.5-0.5B MLP forward + backward, {tokens} tokens | ms | TFLOP/s | compile s |",
           "| --- | ---: | ---: | ---: |"]
    modes = [("eager", None), ("torch.compile (default)", "default")]
    if autotune:
        modes.append(("torch.compile max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs"))
    for name, mode in modes:
        torch._dynamo.reset()
        mlp = MLP().to(dev, torch.bfloat16)
        fwd = mlp if mode is None else torch.compile(mlp, mode=mode, dynamic=True)

        def step(fwd=fwd, mlp=mlp):
            y = fwd(x)
            y.backward(dy)
            for p in mlp.parameters():
                p.grad = None
            x.grad = None

        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        ms = gpu_ms(step, repeats)
        out.append(f"| {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {compile_s:.1f} |")
    return out


def projection_rows(tokens: int, repeats: int) -> list[str]:
    """Qwen2.5-0.5B's input projections, forward + backward (input and weight gradients), eager: q, k and v as
    three GEMMs (896 -> 896, 128, 128, with biases, as the HF model runs them) against one GEMM over the
    concatenated weights, and gate and up as two GEMMs against one (896 -> 9,728)."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.02).bfloat16().requires_grad_()

    x = rand(tokens, 896)
    out = [f"| Qwen2.5-0.5B projections forward + backward, {tokens} tokens | ms | TFLOP/s |", "| --- | ---: | ---: |"]
    for title, sizes, bias in (("q, k, v", (896, 128, 128), True), ("gate, up", (4864, 4864), False)):
        weights = [rand(n, 896) for n in sizes]
        biases = [rand(n) for n in sizes] if bias else [None] * len(sizes)
        grads = [torch.randn(tokens, n, device=dev, generator=gen).bfloat16() for n in sizes]
        flops = 3 * 2 * tokens * 896 * sum(sizes)

        def clear(weights=weights, biases=biases):
            for t in (x, *weights, *biases):
                if t is not None:
                    t.grad = None

        def separate(weights=weights, biases=biases, grads=grads):
            clear()
            outs = [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]
            torch.autograd.backward(outs, grads)

        def fused(weights=weights, biases=biases, grads=grads, sizes=sizes):
            clear()
            w = torch.cat(weights)
            b = torch.cat(biases) if biases[0] is not None else None
            outs = torch.nn.functional.linear(x, w, b).split(list(sizes), dim=-1)
            torch.autograd.backward(list(outs), grads)

        for name, fn in ((f"{title}: {len(sizes)} GEMMs", separate), (f"{title}: one GEMM, weights concatenated", fused)):
            ms = gpu_ms(fn, repeats)
            out.append(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk", type=int, default=7340, help="logits rows (the fast row's chunk of a micro-batch)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=23000, help="MLP rows (a shared-prompt micro-batch of the fast row)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-autotune", action="store_true")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("\n".join(logprob_rows(args.chunk, args.vocab, args.repeats)) + "\n", flush=True)
    print("\n".join(projection_rows(args.tokens, args.repeats)) + "\n", flush=True)
    print("\n".join(mlp_rows(args.tokens, args.repeats, not args.skip_autotune)), flush=True)


if __name__ == "__main__":
    main()
