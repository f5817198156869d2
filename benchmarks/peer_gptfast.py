"""The decode workload of `jaxinfer bench` through a gpt-fast-style torch model, the int4 peer.

Issue 37's end-to-end peer: a Llama decoder in plain torch as pytorch-labs/gpt-fast writes it
(fused wqkv and w1/w3, a static KV cache [B, H_kv, S_max, D] written with index_copy_ at
input_pos, SDPA over the whole cache with a causal mask row, K/V repeated to the query heads),
greedy decode steps compiled with torch.compile(mode="reduce-overhead", fullgraph=True) (CUDA
graphs, gpt-fast's coordinate-descent tuning on), prefill compiled without CUDA graphs. Random
bf16 weights of a preset's shapes (std K^-1/2), drawn on the device one weight at a time and,
with --quant int4, quantized there as drawn (an 8B model needs no host copy).

--quant int4 is gpt-fast's WeightOnlyInt4Linear (tinygemm): codes per group of --group-size
along K, two a byte (even k in the high nibble: uint8 [N, K/2], torch >= 2.5; an older torch's
int32 [N, K] is tried when that fails), `_convert_weight_to_int4pack(w, inner_k_tiles)` (8, or
4 / 2 where 16 * 8 does not divide K) and scales_and_zeros [K/g, N, 2] bf16; the matmul is
`_weight_int4pack_mm(x, w, g, scales_and_zeros)`, whose value is (q - 8) * scale + zero.
Symmetric like jaxinfer's `--quantization int4` (quantize_weight's default: scale = absmax / 7,
q in [-8, 7], zero 0); gpt-fast's asymmetric min/max costs the same (the kernel reads the zeros
either way). Which weights: as jaxinfer's quantize_params, every matmul weight including the
LM head (untied: its own int4 linear; tied: an int4 copy of the table); the embedding lookup
stays a bf16 table as in gpt-fast (jaxinfer quantizes it too, but a step reads B rows of it).
The first int4 linear is checked against x @ dequantize(codes) before anything is timed.

Llama 3's RoPE frequency scaling is skipped (plain RoPE at theta 500000): it changes the
tables' values, not the cost. Figures: one JSON line per batch with `jaxinfer bench --json`'s
field names (decode = the gen_len - 1 steps after the prefill's token; floor = bytes a step
must move / 4.27 TB/s, counted as jaxinfer/bench.py's decode_bytes_per_step at context
prompt_len + gen_len / 2, with this model's own weight bytes: int4 codes K N / 2 plus 4 bytes
per group and column of scales and zeros, against jaxinfer's 2 of fp16 scales), so
benchmarks/compare_peer.py pairs them (it keys on model, batch and lengths, not the weights:
give it ours and the peer's int4 lines in files of their own). smollm2-135m's K = 576 takes
int4 at --group-size 64. On the H200 (torch with CUDA; no transformers needed):

    python3 benchmarks/peer_gptfast.py --preset llama3-8b --quant int4 --batch 1 --prompt-len 128 --gen-len 256
    python3 benchmarks/peer_gptfast.py --preset llama3-8b --quant none --batch 1 --prompt-len 128 --gen-len 256
    # smoke test on a CPU (bf16, eager):
    python3 benchmarks/peer_gptfast.py --device cpu --no-compile --preset smollm2-135m --layers 2 \
        --prompt-len 8 --gen-len 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as exc:
    sys.exit(f"peer_gptfast: needs torch ({exc})")

PRESETS = {  # jaxinfer/configs.py's shapes
    "llama3-8b": dict(vocab=128256, dim=4096, inter=14336, layers=32, heads=32, kv_heads=8,
                      head_dim=128, theta=500000.0, eps=1e-5, tied=False),
    "smollm2-135m": dict(vocab=49152, dim=576, inter=1536, layers=30, heads=9, kv_heads=3,
                         head_dim=64, theta=100000.0, eps=1e-5, tied=True),
}


def pack_int4_pairs(codes):
    """codes [N, K] uint8 in 0..15 (numpy or torch) -> [N, K/2] uint8, even k in the high nibble."""
    return (codes[:, ::2] << 4) | codes[:, 1::2]


def unpack_int4_pairs(packed: np.ndarray) -> np.ndarray:
    """The inverse of pack_int4_pairs, numpy: [N, K/2] -> [N, K]."""
    return np.stack([packed >> 4, packed & 15], axis=-1).reshape(packed.shape[0], -1)


def quantize_int4(w, group: int):
    """w [N, K] (numpy or torch) -> (codes [N, K] uint8 = q + 8, q in [-8, 7]; scales [N, K/g]
    float32, rounded to bf16, absmax / 7); w ~ (codes - 8) * scale, tinygemm's value, zero 0."""
    n, k = w.shape
    if isinstance(w, np.ndarray):
        wf = w.astype(np.float32).reshape(n, k // group, group)
        s = np.abs(wf).max(-1) / 7  # (float32: the numpy path is the reference's)
        q = np.clip(np.round(wf / np.where(s > 0, s, 1)[..., None]), -8, 7) + 8
        return q.astype(np.uint8).reshape(n, k), s
    wf = w.float().reshape(n, k // group, group)
    s = (wf.abs().amax(-1) / 7).to(torch.bfloat16).float()
    q = torch.round(wf / torch.where(s > 0, s, 1)[..., None]).clamp(-8, 7) + 8
    return q.to(torch.uint8).reshape(n, k), s


def dequantize_int4(codes, scales, group: int):
    """Reference (numpy or torch): (codes - 8) * scale, [N, K] float32."""
    n, k = codes.shape
    q = codes.reshape(n, k // group, group).astype(np.float32) if isinstance(codes, np.ndarray) \
        else codes.reshape(n, k // group, group).float()
    return ((q - 8) * scales[..., None]).reshape(n, k)


def inner_k_tiles(k: int) -> int | None:
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


class Dense(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.register_buffer("weight", w)

    def forward(self, x):
        return F.linear(x, self.weight)


class Int4(nn.Module):
    """gpt-fast's WeightOnlyInt4Linear, built from a bf16 weight [N, K] on its (CUDA) device."""

    def __init__(self, w, group: int, check: bool = False):
        super().__init__()
        (self.n, self.k), self.group = w.shape, group
        codes, s = quantize_int4(w, group)
        try:  # torch >= 2.5: uint8 [N, K/2]
            packed = torch.ops.aten._convert_weight_to_int4pack(
                pack_int4_pairs(codes).contiguous(), inner_k_tiles(self.k))
        except RuntimeError:  # older torch: int32 [N, K]
            packed = torch.ops.aten._convert_weight_to_int4pack(
                codes.to(torch.int32).contiguous(), inner_k_tiles(self.k))
        self.register_buffer("weight", packed)
        sz = torch.stack([s.t(), torch.zeros_like(s.t())], dim=2)
        self.register_buffer("scales_and_zeros", sz.to(torch.bfloat16).contiguous())
        if check:  # the packing and scale convention, against the reference
            x = torch.randn(4, self.k, device=w.device, dtype=torch.bfloat16)
            ref = x.float() @ dequantize_int4(codes, s, group).t()
            err = ((self(x).float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                sys.exit(f"peer_gptfast: tinygemm disagrees with the reference (rel err {err:.3g})")

    def forward(self, x):
        y = torch.ops.aten._weight_int4pack_mm(x.reshape(-1, self.k).contiguous(), self.weight,
                                               self.group, self.scales_and_zeros)
        return y.reshape(*x.shape[:-1], self.n)


class Maker:
    """Draws each weight on the device as it is built, bf16 or int4."""

    def __init__(self, device, quant: str, group: int):
        self.device, self.quant, self.group, self.checked = device, quant, group, False

    def draw(self, n: int, k: int):
        return torch.randn(n, k, device=self.device, dtype=torch.bfloat16) * k ** -0.5

    def linear(self, n: int, k: int, w=None):
        w = self.draw(n, k) if w is None else w
        if self.quant == "none":
            return Dense(w)
        check, self.checked = not self.checked, True
        return Int4(w, self.group, check)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim, device=device, dtype=torch.bfloat16))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):  # x [B, T, H, D]; cos, sin [T, D/2] float32 (gpt-fast's pairs)
    xf = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = cos[None, :, None], sin[None, :, None]
    out = torch.stack([xf[..., 0] * c - xf[..., 1] * s, xf[..., 1] * c + xf[..., 0] * s], -1)
    return out.flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self, c: dict, mk: Maker):
        super().__init__()
        self.c, dim, h, hkv, d = c, c["dim"], c["heads"], c["kv_heads"], c["head_dim"]
        self.attn_norm, self.ffn_norm = (RMSNorm(dim, c["eps"], mk.device) for _ in range(2))
        self.wqkv, self.wo = mk.linear((h + 2 * hkv) * d, dim), mk.linear(dim, h * d)
        self.w13, self.w2 = mk.linear(2 * c["inter"], dim), mk.linear(dim, c["inter"])

    def forward(self, x, pos, cos, sin, mask):
        b, t, _ = x.shape
        h, hkv, d = self.c["heads"], self.c["kv_heads"], self.c["head_dim"]
        q, k, v = self.wqkv(self.attn_norm(x)).split([h * d, hkv * d, hkv * d], dim=-1)
        q, k = rope(q.view(b, t, h, d), cos, sin), rope(k.view(b, t, hkv, d), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(b, t, hkv, d).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        kk = self.k_cache.repeat_interleave(h // hkv, dim=1)
        vv = self.v_cache.repeat_interleave(h // hkv, dim=1)
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, h * d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class Transformer(nn.Module):
    def __init__(self, c: dict, mk: Maker):
        super().__init__()
        self.c, dev = c, mk.device
        self.register_buffer("embed", mk.draw(c["vocab"], c["dim"]))
        self.layers = nn.ModuleList(Block(c, mk) for _ in range(c["layers"]))
        self.norm = RMSNorm(c["dim"], c["eps"], dev)
        self.head = None if c["tied"] and mk.quant == "none" else \
            mk.linear(c["vocab"], c["dim"], self.embed if c["tied"] else None)
        self.inv_freq = 1.0 / c["theta"] ** (torch.arange(0, c["head_dim"], 2, device=dev).float()
                                             / c["head_dim"])

    def setup_caches(self, batch: int, max_seq: int):
        c, dev = self.c, self.embed.device
        shape = (batch, c["kv_heads"], max_seq, c["head_dim"])
        for layer in self.layers:  # buffers outside state_dict (weight_bytes: weights only)
            for name in ("k_cache", "v_cache"):
                layer.register_buffer(name, torch.zeros(shape, device=dev, dtype=torch.bfloat16),
                                      persistent=False)
        ang = torch.outer(torch.arange(max_seq, device=dev).float(), self.inv_freq)
        mask = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device=dev))
        for name, t in (("cos", ang.cos()), ("sin", ang.sin()), ("causal_mask", mask)):
            self.register_buffer(name, t, persistent=False)

    def forward(self, idx, pos):  # idx [B, T], pos [T]
        mask, cos, sin = self.causal_mask[None, None, pos], self.cos[pos], self.sin[pos]
        x = F.embedding(idx, self.embed)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        x = self.norm(x)
        return F.linear(x, self.embed) if self.head is None else self.head(x)


def prefill(model, idx, pos):  # two functions: one compiled without CUDA graphs, one with
    return model(idx, pos)[:, -1].argmax(-1, keepdim=True)


def decode_one_token(model, idx, pos):
    return model(idx, pos)[:, -1].argmax(-1, keepdim=True)


def weight_bytes(model) -> tuple[int, int]:
    """(all weights' bytes, the embedding table's), as held (the caches are not in state_dict)."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return total, model.embed.numel() * model.embed.element_size()


def check(args, c: dict) -> str | None:
    """What is wrong with the request, as one line (None: nothing)."""
    if args.gen_len < 2:
        return "--gen-len must be >= 2 (decode = the steps after the first token)"
    if args.quant == "int4":
        if args.group_size not in (32, 64, 128, 256):
            return f"tinygemm takes --group-size 32, 64, 128 or 256, not {args.group_size}"
        for k in (c["dim"], c["heads"] * c["head_dim"], c["inter"]):
            if k % args.group_size or inner_k_tiles(k) is None:
                return (f"int4 needs each K a multiple of the group size (and of 32): K={k} of "
                        f"{args.preset} and --group-size {args.group_size}")
        for n in (c["dim"], (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"], c["vocab"]):
            if n % 8:
                return f"tinygemm needs each N a multiple of 8: N={n} of {args.preset}"
        if args.device == "cpu":
            return "--quant int4 is CUDA only here (tinygemm); on a CPU run --quant none"
        if not hasattr(torch.ops.aten, "_weight_int4pack_mm"):
            return f"torch {torch.__version__} has no aten._weight_int4pack_mm (tinygemm)"
    if args.device == "cuda" and not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (--device cpu for a smoke test)"
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override the layer count")
    ap.add_argument("--quant", default="none", choices=("none", "int4"))
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--no-compile", action="store_true", help="eager (the CPU smoke test)")
    args = ap.parse_args()
    c = dict(PRESETS[args.preset], **({"layers": args.layers} if args.layers else {}))
    error = check(args, c)
    if error:
        sys.exit(f"peer_gptfast: {error}")
    torch.manual_seed(0)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.no_grad():
        model = Transformer(c, Maker(dev, args.quant, args.group_size)).eval()
    total, embed = weight_bytes(model)
    if args.device == "cuda":
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = True  # as gpt-fast's generate.py
        inductor_config.triton.unique_kernel_names = True
    compiled = not args.no_compile
    max_seq = -(-(args.prompt_len + args.gen_len) // 8) * 8  # gpt-fast's find_multiple(, 8)
    kv_row = 2 * c["layers"] * c["kv_heads"] * c["head_dim"] * 2  # bytes per token, bf16
    for b in args.batch:
        torch._dynamo.reset()
        model.setup_caches(b, max_seq)
        first = torch.compile(prefill, fullgraph=True) if compiled else prefill
        step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True) \
            if compiled else decode_one_token
        prompt = torch.randint(0, c["vocab"], (b, args.prompt_len), device=dev)

        @torch.no_grad()
        def run():
            sync()
            t0 = time.perf_counter()
            tok = first(model, prompt, torch.arange(args.prompt_len, device=dev)).clone()
            sync()
            t1 = time.perf_counter()
            pos = torch.tensor([args.prompt_len], device=dev)
            for _ in range(args.gen_len - 1):
                tok = step(model, tok, pos).clone()  # clone: CUDA graphs reuse their outputs
                pos += 1
            sync()
            return t1 - t0, time.perf_counter() - t1

        t0 = time.perf_counter()
        run()
        run()  # warm-up: the first compiles, the second records the CUDA graph
        compile_s = time.perf_counter() - t0
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = [run() for _ in range(args.repeats)]
        prefill_s = statistics.median(t[0] for t in times)
        decode_s = statistics.median(t[1] for t in times) / (args.gen_len - 1)
        context = args.prompt_len + args.gen_len // 2
        weights = total - embed + (embed if model.head is None else 0) + b * c["dim"] * 2
        nbytes = weights + b * (context + 1) * kv_row
        peer = "gpt-fast-style torch.compile" + (" int4 tinygemm" if args.quant == "int4" else "")
        bw = None
        if args.device == "cuda":  # the same floor as `jaxinfer bench` on this card
            from jaxinfer.bench import hbm_bytes_per_s
            bw = hbm_bytes_per_s(torch.cuda.get_device_name())
        print(json.dumps({
            "model": args.preset, "backend": "gpu" if args.device == "cuda" else "cpu",
            "device": args.device, "peer": peer + ("" if compiled else " (eager)"),
            "quant": args.quant, "torch": torch.__version__, "dtype": "bfloat16",
            "layers": c["layers"], "batch": b, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "compile_s": compile_s,
            "prefill_tokens_per_s": b * args.prompt_len / prefill_s,
            "decode_ms_per_token": decode_s * 1e3, "decode_tokens_per_s": b / decode_s,
            "bytes_per_step": nbytes, "achieved_gb_per_s": nbytes / decode_s / 1e9,
            "floor_fraction": nbytes / bw / decode_s if bw else None,
            "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else None,
            "kv_cache_bytes": b * max_seq * kv_row,
            "weights": "dense" if args.quant == "none" else "int4",
            "group_size": args.group_size if args.quant == "int4" else None, "param_bytes": total,
        }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
