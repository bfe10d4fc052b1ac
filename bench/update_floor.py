"""The floor of the bench's 0.5B update on this GPU, and the update MFU that floor allows.

    PYTHONPATH=src:bench:. python3 bench/update_floor.py --attention-ms MS [--step-matmul-ms MS] [--update-s S]

The floor is the update with every matmul as fast as cuBLAS runs it alone, every elementwise pass moving only
the bytes it must at the device's copy bandwidth, and no idle time. Its parts:

- **matmuls, measured**: each GEMM of the update at the bench's shapes (median of --repeats replays of a CUDA
  graph of 10 calls, so that launches and events do not weigh on the thin GEMMs). Per
  decoder layer and micro-batch: q, k, v (with bias), o, gate, up and down, each as forward, input gradient and
  weight gradient; q, k and v also as one GEMM over concatenated weights (the faster counts). Per logprob chunk:
  the LM head's three GEMMs on the completion tokens. A large square GEMM (8192^3) gives the device's best rate.
- **elementwise passes, computed**: the least bytes each must read and write (SiLU-and-multiply, RMSNorm with
  its residual add, rotary on q and k, the logprob statistics and gradient, the optimizer over master weights
  and moments) over the bandwidth of a measured 2 GiB device-to-device copy.
- **attention, given**: --attention-ms, FlashAttention-2's forward and backward in the update as the step's
  profile measures them (`--profile-update`'s "device time by kernel kind"), and at FlashAttention-4's kernel
  time ratio against FlashAttention-2 (0.646, measured 2026-11-26, docs/benchmarks.md).
- **the step's own matmuls**, optionally: --step-matmul-ms (the profile's "matmul"), less what q, k and v as one
  GEMM would save, as a second floor, for when the GEMMs run faster in the step than alone.

Not counted: gradient accumulation across micro-batches (a GEMM can add into the gradient), the embedding's
backward, the shared prompts' K/V gather, the loss. So the floor is optimistic: with these kernels (no
elementwise work moved into the GEMMs) the real update can only be slower.

Shapes default to the bench's fast 0.5B row: 256 sequences of 128 + 256 tokens, 8 completions sharing each
prompt, packed as 2 micro-batches of 34,816 tokens (32,768 of them completion tokens), logprobs in chunks of
8,192 tokens.
"""

from __future__ import annotations

import argparse

import torch
from engine_profile import gpu_ms, graph_ms  # bench/ is the script's folder, so on sys.path
from flops import decoder_params, head_params, update_flops
from grpo_step import PEAK_FLOPS, SIZES

FA4_RATIO = 0.646  # FlashAttention-4 / FlashAttention-2 kernel time, 0.5B packed layer (docs/benchmarks.md)
SPEC = SIZES["0.5b"]  # Qwen2.5-0.5B


def qwen2_params(spec: dict) -> int:
    """Parameters of a Qwen2 model with tied embeddings (q, k, v with biases; two norms a layer; final norm)."""
    h, i, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    layer = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return v * h + spec["num_hidden_layers"] * layer + h


def gemm_ms(m: int, n: int, k: int, repeats: int, bias: bool = False) -> dict[str, float]:
    """Forward (x[m,k] @ W[n,k]^T), input gradient (dy[m,n] @ W) and weight gradient (dy^T @ x), ms each."""
    dev = torch.device("cuda")
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    forward = (lambda: torch.addmm(b, x, w.t())) if bias else (lambda: x @ w.t())
    # replayed from a CUDA graph: the thin GEMMs (45 us) would otherwise carry launch and event overhead
    return {"forward": graph_ms(forward, repeats), "input grad": graph_ms(lambda: dy @ w, repeats),
            "weight grad": graph_ms(lambda: dy.t() @ x, repeats)}


def copy_tb_s(repeats: int) -> float:
    """Device-to-device copy bandwidth, read + write, TB/s (2 GiB)."""
    src = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / gpu_ms(lambda: dst.copy_(src), repeats) / 1e9


def elementwise_bytes(spec: dict, tokens: int, completion: int, params: int) -> dict[str, float]:
    """Least bytes each elementwise pass moves over one micro-batch (bf16 activations); the optimizer's once."""
    h, i, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    layers = spec["num_hidden_layers"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    return {
        # forward reads gate and up, writes h; backward reads dh, gate, up, writes dgate, dup
        "SiLU-and-multiply": layers * (3 + 5) * tokens * i * 2,
        # two a layer and the final one; forward reads the residual and the branch, writes their sum and the
        # normed copy; backward reads dy, x and the residual's gradient, writes the input's
        "norm": (2 * layers + 1) * (4 + 4) * tokens * h * 2,
        # q and k read and written, forward and backward
        "rotary": layers * 4 * tokens * (h + kv) * 2,
        # statistics read the logits once; the gradient reads them and writes over them
        "logprob": 3 * completion * v * 2,
        # once per update, not per micro-batch (main scales the others): bf16 gradient read, fp32 master weight
        # and two moments read and written, bf16 weight written
        "optimizer": params * (2 + 8 + 16 + 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention-ms", type=float, required=True,
                   help="FlashAttention-2 forward + backward in the update, ms (the step profile's 'attention')")
    p.add_argument("--update-s", type=float, default=None, help="the measured update, s (for its MFU)")
    p.add_argument("--step-matmul-ms", type=float, default=None,
                   help="the step profile's matmul ms: also the floor with the step's own matmul time")
    p.add_argument("--tokens", type=int, default=34816, help="tokens per micro-batch")
    p.add_argument("--completion-tokens", type=int, default=32768, help="completion tokens per micro-batch")
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--chunk", type=int, default=8192, help="logprob chunk, tokens")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("update_floor.py measures cuBLAS and the copy bandwidth: it needs a CUDA device")

    spec, t, mbs = SPEC, args.tokens, args.micro_batches
    h, i, v, layers = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"], spec["num_hidden_layers"]
    kv = spec["num_key_value_heads"] * h // spec["num_attention_heads"]
    params = qwen2_params(spec)
    # the bench workload's FLOPs (grpo_step.py's defaults), whatever the micro-batch shapes given here
    flops = update_flops(spec, num_params=params, tied=True, sequences=256, prompt_len=128, completion_len=256,
                         shared=8)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {mbs} micro-batches of {t} tokens "
          f"({args.completion_tokens} completion), {params:,} parameters, {flops / 1e12:.1f} TFLOP counted\n")

    gemms = {  # name: (n, k, bias) of y[t, n] = x[t, k] @ W[n, k]^T
        "q": (h, h, True), "k": (kv, h, True), "v": (kv, h, True), "q, k, v as one": (h + 2 * kv, h, True),
        "o": (h, h, False), "gate": (i, h, False), "up": (i, h, False), "down": (h, i, False),
    }
    rows = ["| GEMM, one layer and micro-batch | forward ms | input grad ms | weight grad ms | TFLOP/s |",
            "| --- | ---: | ---: | ---: | ---: |"]
    per_layer = {}
    for name, (n, k, bias) in gemms.items():
        ms = gemm_ms(t, n, k, args.repeats, bias)
        per_layer[name] = sum(ms.values())
        rows.append(f"| {name} ({t} x {k} -> {n}) | {ms['forward']:.3f} | {ms['input grad']:.3f} | "
                    f"{ms['weight grad']:.3f} | {3 * 2 * t * n * k / per_layer[name] / 1e9:.0f} |")
    head = gemm_ms(args.chunk, v, h, max(5, args.repeats // 4))
    chunks = args.completion_tokens / args.chunk
    rows.append(f"| LM head, one chunk ({args.chunk} x {h} -> {v}) | {head['forward']:.3f} | "
                f"{head['input grad']:.3f} | {head['weight grad']:.3f} | "
                f"{3 * 2 * args.chunk * v * h / sum(head.values()) / 1e9:.0f} |")
    square = 2 * 8192**3 / gemm_ms(8192, 8192, 8192, args.repeats)["forward"] / 1e9
    print("\n".join(rows) + f"\n\nlarge square GEMM (8192^3, forward): {square:.0f} TFLOP/s\n", flush=True)

    apart = per_layer["q"] + per_layer["k"] + per_layer["v"]
    qkv = min(apart, per_layer["q, k, v as one"])
    layer_ms = qkv + per_layer["o"] + per_layer["gate"] + per_layer["up"] + per_layer["down"]
    matmul_ms = mbs * (layers * layer_ms + chunks * sum(head.values()))
    bw = copy_tb_s(args.repeats)
    moved = elementwise_bytes(spec, t, args.completion_tokens, params)
    pass_gb = {name: b * (1 if name == "optimizer" else mbs) / 1e9 for name, b in moved.items()}
    step_matmul = None
    if args.step_matmul_ms is not None:  # the step runs q, k, v apart: take off what one GEMM would save
        step_matmul = args.step_matmul_ms - mbs * layers * (apart - qkv)
    print("\n".join(floor_rows(
        flops=flops, matmul_ms=matmul_ms, pass_gb=pass_gb, tb_s=bw, attention_ms=args.attention_ms,
        square_matmul_ms=_at_rate(spec, t, args.chunk, mbs, chunks, square), step_matmul_ms=step_matmul,
        update_ms=args.update_s * 1e3 if args.update_s else None)), flush=True)


def floor_rows(*, flops: float, matmul_ms: float, pass_gb: dict[str, float], tb_s: float, attention_ms: float,
               square_matmul_ms: float, step_matmul_ms: float | None = None,
               update_ms: float | None = None) -> list[str]:
    """The floor's parts and the update MFU of each floor, as markdown rows (pure: tested on the CPU).

    matmul_ms: cuBLAS alone at the update's shapes; pass_gb: the elementwise passes' least traffic, moved at
    tb_s; attention_ms: FlashAttention-2 as the step measured it (FlashAttention-4 at FA4_RATIO of it);
    square_matmul_ms: the matmul FLOPs at the square GEMM's rate; step_matmul_ms: the step's own matmul time
    (its profile), less what q, k, v as one GEMM would save."""
    def mfu(ms: float) -> str:
        return f"{100 * flops / (ms / 1e3) / PEAK_FLOPS:.1f}%"

    passes = {name: gb / tb_s for name, gb in pass_gb.items()}
    out = ["| part of the update | floor ms | how |", "| --- | ---: | --- |",
           f"| matmuls | {matmul_ms:.1f} | cuBLAS alone at these shapes, q, k, v as the faster of one GEMM or three |"]
    out += [f"| {name} | {ms:.1f} | {pass_gb[name]:.1f} GB at {tb_s:.2f} TB/s (copy) |" for name, ms in passes.items()]
    out.append(f"| attention, FlashAttention-2 | {attention_ms:.1f} | the step's profile |")
    other = sum(passes.values())
    fa4 = attention_ms * FA4_RATIO
    floors = [("cuBLAS alone, FlashAttention-2", matmul_ms + other + attention_ms),
              (f"cuBLAS alone, FlashAttention-4 ({FA4_RATIO} x)", matmul_ms + other + fa4)]
    if step_matmul_ms is not None:
        floors += [("the step's matmuls, q, k, v as one GEMM, FlashAttention-2", step_matmul_ms + other + attention_ms),
                   ("the step's matmuls, q, k, v as one GEMM, FlashAttention-4", step_matmul_ms + other + fa4)]
    floors.append(("every matmul at the square GEMM's rate, FlashAttention-4", square_matmul_ms + other + fa4))
    out += ["", "| floor | update ms | update MFU |", "| --- | ---: | ---: |"]
    out += [f"| {name} | {ms:.1f} | {mfu(ms)} |" for name, ms in floors]
    out.append(f"| 50% MFU needs | {flops / (0.5 * PEAK_FLOPS) * 1e3:.1f} | 50.0% |")
    if update_ms:
        out.append(f"| measured update | {update_ms:.1f} | {mfu(update_ms)} |")
    return out


def _at_rate(spec: dict, tokens: int, chunk: int, mbs: int, chunks: float, tflops: float) -> float:
    """ms of the update's matmul FLOPs at `tflops` (the square GEMM's rate)."""
    body = decoder_params(qwen2_params(spec), spec, tied=True)
    total = 6 * mbs * (tokens * body + chunks * chunk * head_params(spec))
    return total / tflops / 1e9


if __name__ == "__main__":
    main()
