"""The MoE experts kernels (pallas_kernels/moe.py) in interpret mode against their pure-jnp
references and an independent per-token loop, float and quantized experts (int8, int4, fp8
blocks, GGUF K-quants), the grouped layout, bad inputs, the model's MoE fixtures through the
kernels, and benchmarks/moe.py --quick."""

import functools
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_inputs import put, put_tree
from kernel_testing import pallas_kernels_in, rel_err

import pallas_kernels as pk
from pallas_kernels.moe import default_block_sizes, max_tiles
from pallas_kernels.quantized import (
    dequantize,
    from_fp8_blocks,
    quantize_weight,
    stack_experts,
)

DATA = pathlib.Path(__file__).parent / "fixtures" / "data"
# Small tiles, so that the odd shapes below have ragged edges in D, F and the split chunks.
SMALL = pk.MoEBlockSizes(block_m=16, block_n=16, block_n_down=16, block_k=16, group_m=2,
                         num_warps=4, num_stages=2)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# XLA's CPU backend optimizations off for the larger jits here: interpret-mode kernels compile
# to long loops whose LLVM passes were most of the test time, and the results do not change
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def inputs(n, k, e, d, f, dtype, experts=None, seed=0):
    """Random x, routing weights, experts (k distinct per token unless given) and weights
    (cast on the host and sent: jnp.asarray's bits without its per-shape programs)."""
    rng = np.random.default_rng(seed)
    x = put(rng.standard_normal((n, d)), dtype)
    if experts is None:
        experts = np.stack([rng.permutation(e)[:k] for _ in range(n)])
    weights = put(rng.random((n, k)), jnp.float32)
    ws = [put(rng.standard_normal(s) / np.sqrt(s[1]), dtype)
          for s in ((e, d, f), (e, d, f), (e, f, d))]
    return x, weights, put(experts, jnp.int32), *ws


def per_token_loop(x, weights, experts, wg, wu, wd):
    """Each token's k experts one by one in float64 numpy (SwiGLU unrounded)."""
    # float32 / bfloat16 to float64 on the host: exact, as through jnp's float32
    x, wg, wu, wd = (np.asarray(a).astype(np.float64) for a in (x, wg, wu, wd))
    weights, experts = np.asarray(weights), np.asarray(experts)  # rows read on the host
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        for w, e in zip(weights[n], experts[n]):
            g, u = x[n] @ wg[e], x[n] @ wu[e]
            out[n] += w * ((g / (1 + np.exp(-g)) * u) @ wd[e])
    return out


SPLIT = pk.MoEBlockSizes(block_m=16, block_n=16, block_n_down=32, block_k=16, split_k=2)


@pytest.mark.parametrize("dtype, n, blocks", [(jnp.float32, 1, None), (jnp.bfloat16, 3, SMALL),
                                              (jnp.float32, 3, SPLIT)])
def test_decode_matches_reference(dtype, n, blocks):
    """D 40 and F 24 against 16-wide tiles (ragged K, F and D edges); with SPLIT, F in two
    chunks of 16 (the second ragged) and 32-wide down tiles over D 40."""
    args = inputs(n, 2, 5, 40, 24, dtype)
    out = pk.moe_decode(*args, interpret=True, block_sizes=blocks)
    ref = pk.moe_decode_reference(*args)
    assert out.shape == (n, 40) and out.dtype == jnp.float32
    assert rel_err(out, ref) < TOL[dtype]
    if dtype == jnp.float32:
        assert rel_err(out, per_token_loop(*args)) < 1e-5
    # The weighted chunks a consumer sums: S F chunks of each of the k experts.
    parts = pk.moe_decode(*args, partials=True, interpret=True, block_sizes=blocks)
    split = 2 if blocks is SPLIT else 1
    assert parts.shape == (split * 2, n, 40)
    np.testing.assert_allclose(parts.sum(0), out, rtol=1e-6, atol=1e-6)
    want = pk.moe_decode_reference(*args, partials=True)  # [k, N, D]
    assert rel_err(parts.reshape(split, 2, n, 40).sum(0), want) < TOL[dtype]


def routings(n: int) -> dict:
    """Expert choices for n tokens (k 2 of E 6): random; only experts 0, 2, 3, 5 (1 and 4
    empty); expert 4 in every token."""
    rng = np.random.default_rng(n)
    return {"random": np.stack([rng.permutation(6)[:2] for _ in range(n)]),
            "two empty": np.stack([rng.permutation([0, 2, 3, 5])[:2] for _ in range(n)]),
            "one takes all": np.stack([[4, 1 + i % 3] for i in range(n)])}


@pytest.mark.parametrize("dtype, n, cases", [
    (jnp.float32, 21, ("random", "two empty", "one takes all")), (jnp.float32, 1, ("random",)),
    (jnp.bfloat16, 40, ("two empty",))])
def test_grouped_matches_reference(dtype, n, cases):
    grouped = jax.jit(pk.moe_grouped, static_argnames=("interpret", "block_sizes"),
                      compiler_options=FAST_COMPILE)
    for case in cases:
        args = inputs(n, 2, 6, 40, 24, dtype, routings(n)[case], seed=n)
        out = grouped(*args, interpret=True, block_sizes=SMALL)
        assert out.shape == (n, 40) and out.dtype == jnp.float32
        assert rel_err(out, pk.moe_grouped_reference(*args)) < TOL[dtype], case
        if dtype == jnp.float32:
            assert rel_err(out, per_token_loop(*args)) < 1e-5, case
    if n == 21:  # the k weighted products, for a consumer that sums them
        parts = pk.moe_grouped(*args, partials=True, interpret=True, block_sizes=SMALL)
        assert parts.shape == (2, n, 40)
        np.testing.assert_allclose(parts.sum(0), out, rtol=1e-6, atol=1e-6)
        assert rel_err(parts, pk.moe_grouped_reference(*args, partials=True)) < TOL[dtype]


def test_group_by_expert_layout():
    """Each assignment lands in a tile of its own expert, in token order within the group;
    the used tiles come first, the rest are -1; padding rows copy token 0."""
    experts = put([[4, 1], [1, 3], [4, 3], [0, 4], [4, 1]], jnp.int32)
    groups = pk.group_by_expert(experts, 6, 2)
    tiles, dest = np.asarray(groups.tile_experts), np.asarray(groups.dest)
    assert tiles.shape == (max_tiles(10, 6, 2),) == (8,)
    # experts 0: 1 row, 1: 3, 3: 2, 4: 4 -> 1 + 2 + 1 + 2 = 6 tiles of 2 rows
    np.testing.assert_array_equal(tiles, [0, 1, 1, 3, 4, 4, -1, -1])
    flat = np.asarray(experts).reshape(-1)
    np.testing.assert_array_equal(tiles[dest // 2], flat)
    np.testing.assert_array_equal(np.asarray(groups.row_token)[dest], np.arange(10) // 2)
    assert len(set(dest.tolist())) == 10
    assert dest[0] < dest[4] < dest[7] < dest[8]  # expert 4's tokens 0, 2, 3, 4 in order
    # The bound holds with equality when every used expert has a ragged group.
    worst = put(np.arange(6 * 3).reshape(9, 2) % 6, jnp.int32)  # 3 rows per expert
    assert pk.group_by_expert(worst, 6, 2).tile_experts.shape == (max_tiles(18, 6, 2),)
    assert (np.asarray(pk.group_by_expert(worst, 6, 2).tile_experts) >= 0).all()


def test_grouped_kernels_match_their_references_and_skip_empty_tiles():
    """The two grouped kernels on a hand-made tile map (tiles of experts 2, 2, 0, then two
    empty ones): the used tiles' rows match, the empty ones are never written (interpret
    mode fills unwritten outputs with NaN)."""
    rng = np.random.default_rng(3)
    e, d, f, bm = 3, 40, 24, 16
    tiles = put([2, 2, 0, -1, -1], jnp.int32)
    xs = put(rng.standard_normal((5 * bm, d)), jnp.float32)
    wg, wu = (put(rng.standard_normal((e, d, f)), jnp.float32) for _ in range(2))
    wd = put(rng.standard_normal((e, f, d)), jnp.float32)
    act = pk.grouped_swiglu(xs, tiles, wg, wu, interpret=True, block_sizes=SMALL)
    want = pk.grouped_swiglu_reference(xs, tiles, wg, wu, block_sizes=SMALL)
    used = slice(0, 3 * bm)
    assert rel_err(act[used], want[used]) < 1e-5
    assert np.isnan(np.asarray(act[3 * bm:])).all()
    y = pk.grouped_down(want, tiles, wd, interpret=True, block_sizes=SMALL)
    want_y = pk.grouped_down_reference(want, tiles, wd, block_sizes=SMALL)
    assert y.dtype == jnp.float32 and rel_err(y[used], want_y[used]) < 1e-5
    assert np.isnan(np.asarray(y[3 * bm:])).all()
    # A tile's expert is read from the map: swapping the map changes the rows.
    other = pk.grouped_down(want, put([0, 2, 2, -1, -1], jnp.int32), wd,
                            interpret=True, block_sizes=SMALL)
    assert rel_err(other[:bm], want_y[:bm]) > 0.1
    np.testing.assert_allclose(other[bm:2 * bm], want_y[bm:2 * bm], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ quantized experts


def stacked(w, make):
    """A stacked QuantizedWeight of w [E, K, N]: make(w_e float32 numpy [K, N]) per expert."""
    w = np.asarray(w).astype(np.float32)  # bfloat16 to float32 on the host: exact
    return put_tree(stack_experts([make(w[i]) for i in range(w.shape[0])]))


def fp8_blocks(w, block=32):
    """w [K, N] as DeepSeek-V3 stores it: e4m3 values times a scale per block x block."""
    k, n = w.shape
    amax = np.abs(w).reshape(k // block, block, n // block, block).max(axis=(1, 3))
    s = np.maximum(amax, 1e-12) / 448.0  # [K / b, N / b]
    full = np.repeat(np.repeat(s, block, 0), block, 1)
    return from_fp8_blocks(put(w / full, jnp.float8_e4m3fn), put(s), block)


def gguf_blocks(type_name: str, k: int, n: int, rng):
    """A random GGUF tensor of n rows of k (gguf.quants writes no K-quants): random block
    bytes, the fp16 super-scales then set so the values' standard deviation is 1 / sqrt(k)
    (they are linear in those fields), repacked as the GGUF loader repacks it."""
    from checkpoints.gguf_blocks import BLOCK_SIZES, repack

    block, size = BLOCK_SIZES[type_name]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)
    fields = {"Q4_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,)}[type_name]

    def put(value: float):
        for off in fields:
            raw[:, off:off + 2] = np.full((raw.shape[0], 1), value, np.float16).view(np.uint8)

    put(1.0)
    std = float(np.std(dequantize(repack(raw.reshape(n, -1), type_name, k, n))))
    put(1.0 / (std * np.sqrt(k)))
    return repack(raw.reshape(n, -1), type_name, k, n)


def quantized_case(name: str, n: int):
    """(x, weights, experts, w_gate, w_up, w_down) with the experts in format `name`."""
    if name == "gguf_q4k_q6k":  # GGUF Q4_K_M's experts: gate / up Q4_K, down Q6_K
        x, w, ex, *_ = inputs(n, 2, 4, 256, 256, jnp.float32, seed=n)
        rng = np.random.default_rng(1)
        qs = [put_tree(stack_experts([gguf_blocks(t, 256, 256, rng) for _ in range(4)]))
              for t in ("Q4_K", "Q4_K", "Q6_K")]
        return (x, w, ex, *qs)
    d = 40 if name == "int8" else 64
    dtype = jnp.bfloat16 if name == "int4_g64" else jnp.float32
    x, w, ex, wg, wu, wd = inputs(n, 2, 5, d, 96, dtype, seed=n)
    make = {
        # per-column scales over the ragged D 40 (one tile past K), group 32 for down
        "int8": (lambda a: quantize_weight(a, bits=8, group_size=None),) * 2
        + (lambda a: quantize_weight(a, bits=8, group_size=32),),
        "int4_g32": (lambda a: quantize_weight(a, bits=4, group_size=32),) * 3,
        "int4_g64": (lambda a: quantize_weight(a, bits=4, group_size=64),) * 2
        + (lambda a: quantize_weight(a, bits=4, group_size=32, symmetric=False),),
        "fp8_blocks": (fp8_blocks,) * 3,
    }[name]
    return (x, w, ex, *(stacked(a, m) for a, m in zip((wg, wu, wd), make)))


@pytest.mark.parametrize("name, n, paths", [
    ("int8", 3, ("decode", "grouped")), ("int4_g32", 2, ("decode",)),
    ("int4_g64", 5, ("grouped",)), ("fp8_blocks", 3, ("grouped",)),
    ("gguf_q4k_q6k", 2, ("decode",))])
def test_quantized_experts_match_reference(name, n, paths):
    """Stacked QuantizedWeight experts through both kernels (tiles dequantized in registers)
    against the reference (the chosen experts dequantized) and, in float32, against the
    per-token loop on the whole weights dequantized; the top outputs agree."""
    args = quantized_case(name, n)
    x = args[0]
    ref = jax.jit(pk.moe_experts_reference)(*args)  # jitted: eager, its ops compile one by one
    tol = TOL[x.dtype.type]
    if x.dtype == jnp.float32:
        dense = jax.jit(lambda ws: [dequantize(w) for w in ws])(args[3:])  # [E, K, N] each
        assert rel_err(ref, per_token_loop(*args[:3], *dense)) < 1e-5
    for path in paths:
        fn = jax.jit(pk.moe_decode if path == "decode" else pk.moe_grouped,
                     static_argnames=("interpret", "block_sizes"), compiler_options=FAST_COMPILE)
        out = fn(*args, interpret=True, block_sizes=SMALL)
        assert out.shape == x.shape and out.dtype == jnp.float32
        assert rel_err(out, ref) < tol, path
        np.testing.assert_array_equal(np.argmax(out, -1), np.argmax(ref, -1))


def test_quantized_experts_are_close_to_the_float_ones():
    """int8 and int4 experts stay near the float experts they were made from (the reference
    path: what the kernels are checked against above)."""
    args = inputs(4, 2, 5, 64, 96, jnp.float32, seed=7)
    reference = jax.jit(pk.moe_experts_reference)
    want = reference(*args)
    for bits, bound in ((8, 1e-2), (4, 0.2)):
        qs = [stacked(w, lambda a, b=bits: quantize_weight(a, bits=b, group_size=32))
              for w in args[3:]]
        assert rel_err(reference(*args[:3], *qs), want) < bound, bits


def test_bad_quantized_experts_are_named():
    x, w, ex, wg, wu, wd = inputs(2, 2, 5, 64, 96, jnp.float32)
    q32 = stacked(wg, lambda a: quantize_weight(a, bits=8, group_size=32))
    q64 = stacked(wu, lambda a: quantize_weight(a, bits=8, group_size=64))
    qd = stacked(wd, lambda a: quantize_weight(a, bits=8, group_size=32))
    with pytest.raises(ValueError, match=r"w_gate.*needs every array \[E, rows, N\]"):
        pk.moe_decode(x, w, ex, jax.tree.map(lambda a: a[0], q32), q32, qd, interpret=True)
    with pytest.raises(ValueError, match=r"K tiles 32 and 128; quantize them with the same"):
        pk.moe_decode(x, w, ex, q32, q64, qd, interpret=True)
    with pytest.raises(ValueError, match=r"w_down has shape \(5, 64, 96\), expected "
                                         r"\(5, 96, 64\)"):
        pk.moe_grouped(x, w, ex, q32, q32, q32, interpret=True)


@pytest.mark.parametrize("change, match", [
    (dict(x=jnp.zeros((3, 40), jnp.int32)), r"moe_decode: x has dtype int32"),
    (dict(x=jnp.zeros((3, 1, 40))), r"moe_decode: x must have rank 2"),
    (dict(w_gate=jnp.zeros((5, 40, 24), jnp.bfloat16)),
     r"w_gate has dtype bfloat16 but x has float32"),
    (dict(w_up=jnp.zeros((5, 40, 32))), r"w_up has shape \(5, 40, 32\), expected \(5, 40, 24\)"),
    (dict(w_down=jnp.zeros((5, 40, 24))), r"w_down has shape \(5, 40, 24\), expected \(5, 24"),
    (dict(experts=jnp.zeros((3, 2), jnp.float32)), r"experts has dtype float32"),
    (dict(experts=jnp.zeros((3, 2, 1), jnp.int32)), r"experts must have rank 2"),
    (dict(experts=jnp.zeros((4, 2), jnp.int32)), r"experts has shape \(4, 2\), expected \[N=3"),
    (dict(experts=jnp.zeros((3, 6), jnp.int32)), r"1 <= k <= E=5"),
    (dict(weights=jnp.zeros((3, 3))), r"weights has shape \(3, 3\), expected \(3, 2\)"),
    (dict(weights=jnp.zeros((3, 2), jnp.bfloat16)), r"weights has dtype bfloat16"),
    (dict(block_sizes=(16, 16)), r"block_sizes must be a MoEBlockSizes"),
])
@pytest.mark.parametrize("fn", [pk.moe_decode, pk.moe_grouped, pk.moe_experts_reference])
def test_bad_inputs_are_named(fn, change, match):
    names = ("x", "weights", "experts", "w_gate", "w_up", "w_down")
    args = dict(zip(names, inputs(3, 2, 5, 40, 24, jnp.float32)))
    kwargs = {"block_sizes": change["block_sizes"]} if "block_sizes" in change else {}
    if kwargs and fn is pk.moe_experts_reference:
        pytest.skip("the reference ignores block sizes")
    args.update({k: v for k, v in change.items() if k != "block_sizes"})
    with pytest.raises(ValueError, match=match.replace("moe_decode", fn.__name__)):
        fn(*(args[n] for n in names), interpret=True, **kwargs)


def test_bad_block_sizes_and_grouped_rows():
    with pytest.raises(ValueError, match=r"MoEBlockSizes.block_n=24: must be a power of two"):
        pk.MoEBlockSizes(block_n=24)
    with pytest.raises(ValueError, match=r"MoEBlockSizes.split_k=0: must be an integer >= 1"):
        pk.MoEBlockSizes(split_k=0)
    tiles = jnp.zeros((2,), jnp.int32)
    w = jnp.zeros((3, 40, 24))
    with pytest.raises(ValueError, match=r"rows \(30, 40\) must be \[T \* block_m = 32, 40\]"):
        pk.grouped_swiglu(jnp.zeros((30, 40)), tiles, w, w, block_sizes=SMALL)
    with pytest.raises(ValueError, match=r"tile_experts has dtype float32"):
        pk.grouped_down(jnp.zeros((32, 40)), tiles.astype(jnp.float32), w, block_sizes=SMALL)


@pytest.mark.parametrize("dims", [(4096, 14336, 8, 2), (2048, 768, 128, 8)])
def test_default_blocks_fill_the_h200(dims):
    """At one token (Mixtral, Qwen3-30B-A3B) both decode kernels launch at least a program
    per SM (the SwiGLU's column tiles stay >= 32 wide); at prefill the grouped tiles are 128
    rows."""
    d, f, e, k = dims
    blocks = default_block_sizes(1, d, f, e, k, decode=True)
    swiglu = k * -(-f // blocks.block_n)
    split = max(1, min(blocks.split_k, f // blocks.block_k))
    down = k * -(-d // blocks.block_n_down) * split
    assert min(swiglu, down) >= 132, (blocks, swiglu, down)
    assert default_block_sizes(8192, d, f, e, k, decode=False).block_m == 128


# ---------------------------------------------------------------------- the model's fixtures


@pytest.mark.parametrize("variant", ["qwen3_moe"])
def test_fixture_logits_through_the_kernels(variant):
    """The HF fixture (float32) under KernelPolicy(interpret=True): its prompt takes the
    grouped GEMM, one decode step of one row the decode kernel; the logits match
    transformers' and the incremental step matches the full forward's last position."""
    import jaxinfer
    from jaxinfer.cache import KVCache
    from jaxinfer.models import llama
    from jaxinfer.plan import KernelPolicy

    ref = np.load(DATA / "hf" / variant / "ref.npz")
    model = jaxinfer.load(str(DATA / "hf" / variant), dtype="float32")
    plan = model.with_policy(KernelPolicy(interpret=True)).plan
    ids = put(ref["input_ids"][:1])  # [1, T]
    t = ids.shape[1]
    pos = put(np.arange(t, dtype=np.int32)[None])
    cache = KVCache.init(model.config, 1, t)

    def forward(ids, pos, cache):
        return llama.forward(model.params, ids, pos, plan, cache)

    prefill = jax.jit(forward, compiler_options=FAST_COMPILE)
    names = pallas_kernels_in(forward, ids[:, :-1], pos[:, :-1], cache)
    assert any(n.startswith("moe_grouped_swiglu") for n in names), names
    names = pallas_kernels_in(forward, ids[:, -1:], pos[:, -1:], cache)
    assert any(n.startswith("moe_decode_swiglu") for n in names), names
    logits, cache = prefill(ids[:, :-1], pos[:, :-1], cache)
    last, _ = prefill(ids[:, -1:], pos[:, -1:], cache)
    want = ref["logits"][:1]
    assert rel_err(logits, want[:, :-1]) < 1e-4
    assert rel_err(last, want[:, -1:]) < 1e-4
    np.testing.assert_array_equal(np.asarray(logits).argmax(-1), want[:, :-1].argmax(-1))


# ------------------------------------------------------------------------------ the benchmark


def test_benchmark_runs_quick_on_cpu(tmp_path):
    """benchmarks/moe.py --quick: every variant runs (interpret mode) and meets the reference
    (int4 experts: the float math on their dequantized weights)."""
    import json

    from benchmarks import moe as bench

    out = tmp_path / "moe.jsonl"
    impls = ("pallas_decode", "pallas_decode_int4", "dense_loop")
    assert bench.main(["--quick", "--models", "tiny-e8k2", "--tokens", "decode_1", "--impls",
                       ",".join(impls), "--quant", "int4", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["impl"] for r in rows) == sorted(impls), rows
    assert all(r["rel_err"] < 2e-2 and r["vs_loop"] > 0 for r in rows), rows
    (q,) = (r for r in rows if r["impl"] == "pallas_decode_int4")
    assert 0.01 < q["quant_err"] < 0.3, q  # int4 really moved the experts, not far


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 4, 32, 1000])
def test_kernels_on_the_gpu(n):
    """bf16 on the GPU at Mixtral-like proportions (E 8, k 2, D 1024, F 3584): both kernels
    (the decode one up to 32 tokens) at their default tiles against the reference."""
    args = inputs(n, 2, 8, 1024, 3584, jnp.bfloat16, seed=n)
    ref = pk.moe_experts_reference(*args)
    for fn in (pk.moe_grouped, pk.moe_decode) if n <= 32 else (pk.moe_grouped,):
        assert rel_err(jax.jit(fn)(*args), ref) < 2e-2, fn.__name__


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 32])
@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8_blocks", "gguf_q4k_q6k"])
def test_quantized_kernels_on_the_gpu(fmt, n):
    """bf16 activations, quantized experts at Mixtral-like proportions (E 8, k 2, D 1024,
    F 3584; int8 / int4 group 128, fp8 blocks of 128, GGUF Q4_K gate / up with Q6_K down):
    both kernels at their default tiles against the reference on the dequantized experts."""
    x, w, ex, wg, wu, wd = inputs(n, 2, 8, 1024, 3584, jnp.bfloat16, seed=n)
    if fmt == "gguf_q4k_q6k":
        rng = np.random.default_rng(2)
        qs = [jax.tree.map(jnp.asarray, stack_experts([gguf_blocks(t, k, nn, rng)
                                                       for _ in range(8)]))
              for t, k, nn in (("Q4_K", 1024, 3584), ("Q4_K", 1024, 3584),
                               ("Q6_K", 3584, 1024))]
    else:
        make = {"int8": lambda a: quantize_weight(a, bits=8, group_size=128),
                "int4": lambda a: quantize_weight(a, bits=4, group_size=128),
                "fp8_blocks": lambda a: fp8_blocks(a, 128)}[fmt]
        qs = [stacked(a, make) for a in (wg, wu, wd)]
    ref = pk.moe_experts_reference(x, w, ex, *qs)
    for fn in (pk.moe_decode, pk.moe_grouped):
        out = jax.jit(fn)(x, w, ex, *qs)
        assert rel_err(out, ref) < 2e-2, fn.__name__


@functools.cache  # the same arrays each call (immutable): made once
def _route_cases():
    """(h, router, k, scoring, norm, scaling): Mixtral's softmax top-2 renormalised, a
    sigmoid router with a scaling, E not a power of two and D past a chunk; two identical
    router columns (a tie: the lower index first, as lax.top_k)."""
    rng = np.random.default_rng(5)
    h = put(rng.standard_normal((3, 200)), jnp.bfloat16)
    router = np.asarray(rng.standard_normal((200, 6)) / 14, np.float32)
    tied = router.copy()
    tied[:, 4] = router[:, 1]
    wide = put(rng.standard_normal((200, 40)) / 14, jnp.float32)
    return [(h, put(router), 2, "softmax", True, 1.0), (h, put(tied), 3, "softmax", False, 1.0),
            (h, wide, 4, "sigmoid", True, 2.5)]


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
def test_router_kernel_chooses_as_the_routers_do(interpret):
    """moe_route (one program per row, or per row and block of D: 8 blocks of 25 rows)
    picks the experts of jaxinfer's route (transformers' rule) and of its jnp reference, ties
    to the lower index, with their weights; bad k, blocks and a non-float32 router are
    named."""
    from jaxinfer.configs import MoEConfig
    from jaxinfer.ops.moe import route, router_logits

    for (h, router, k, scoring, norm, scaling), blocks in itertools.product(_route_cases(),
                                                                            (1, 8)):
        got_w, got_e = pk.moe_route(h, router, k=k, scoring=scoring, norm_topk_prob=norm,
                                    scaling=scaling, blocks=blocks, interpret=interpret)
        ref_w, ref_e = pk.moe_route_reference(h, router, k=k, scoring=scoring,
                                              norm_topk_prob=norm, scaling=scaling)
        moe = MoEConfig(num_experts=router.shape[1], experts_per_token=k,
                        expert_intermediate_size=8, router=scoring, norm_topk_prob=norm,
                        routed_scaling_factor=scaling)
        want_w, want_e = route(router_logits(h, router), moe)
        np.testing.assert_array_equal(got_e, want_e)
        np.testing.assert_array_equal(ref_e, want_e)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
        np.testing.assert_allclose(ref_w, want_w, rtol=1e-6)
        if np.asarray(router)[0, 4] == np.asarray(router)[0, 1]:  # the tie: where both are chosen, 1 comes first
            assert all(list(r).index(1) < list(r).index(4) for r in np.asarray(got_e)
                       if 1 in r and 4 in r)
    h, router = _route_cases()[0][:2]
    with pytest.raises(ValueError, match="k=7 must be in 1..E=6"):
        pk.moe_route(h, router, k=7, interpret=True)
    with pytest.raises(ValueError, match="router must be float32"):
        pk.moe_route(h, router.astype(jnp.bfloat16), k=2, interpret=True)
    with pytest.raises(ValueError, match="blocks=16 must be a power of two that divides D=200"):
        pk.moe_route(h, router, k=2, blocks=16, interpret=True)


@pytest.mark.parametrize("interpret", [
    True, pytest.param(False, marks=[pytest.mark.gpu, pytest.mark.skipif(
        jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")])], ids=["interpret", "gpu"])
def test_boundary_and_router_in_one_kernel(interpret):
    """add_rms_norm_route (in one program a row, or in 4 blocks of D a row, each storing its
    rows) gives add_rms_norm's stream and h bitwise (the chunks summed in order, then x, one
    rounding) and route's experts on that h (weights to float32 rounding); deltas of the
    wrong shape are named."""
    from jaxinfer.configs import MoEConfig
    from jaxinfer.ops.moe import route, router_logits

    rng = np.random.default_rng(6)
    for (h, router, k, scoring, norm, scaling), blocks in itertools.product(_route_cases(),
                                                                            (1, 4)):
        x = put(rng.standard_normal(h.shape), jnp.bfloat16)  # [N, D]
        deltas = put(rng.standard_normal((3, *h.shape)), jnp.float32)  # [S, N, D]
        norm_w = put(1 + rng.standard_normal(h.shape[1]) / 8, jnp.bfloat16)
        x_new, h_got, got_w, got_e = pk.add_rms_norm_route(
            x, deltas, norm_w, router, eps=1e-5, k=k, scoring=scoring, norm_topk_prob=norm,
            scaling=scaling, blocks=blocks, interpret=interpret)
        x_want, h_want = pk.add_rms_norm(x, deltas, norm_w, eps=1e-5, interpret=interpret)
        np.testing.assert_array_equal(np.asarray(x_new, np.float32), np.asarray(x_want, np.float32))
        np.testing.assert_array_equal(np.asarray(h_got, np.float32), np.asarray(h_want, np.float32))
        moe = MoEConfig(num_experts=router.shape[1], experts_per_token=k,
                        expert_intermediate_size=8, router=scoring, norm_topk_prob=norm,
                        routed_scaling_factor=scaling)
        want_w, want_e = route(router_logits(h_want, router), moe)
        np.testing.assert_array_equal(got_e, want_e)
        np.testing.assert_allclose(got_w, want_w, rtol=1e-5)
        ref = pk.add_rms_norm_route_reference(x, deltas, norm_w, router, eps=1e-5, k=k,
                                              scoring=scoring, norm_topk_prob=norm,
                                              scaling=scaling)
        np.testing.assert_array_equal(ref[3], want_e)
    with pytest.raises(ValueError, match=r"add_rms_norm_route: deltas .* must be \[S, \*x.shape\]"):
        pk.add_rms_norm_route(x, deltas[:, :1], norm_w, router, eps=1e-5, k=2, interpret=True)
    with pytest.raises(ValueError, match="add_rms_norm_route: k=9 must be in 1..E=6"):
        pk.add_rms_norm_route(x, deltas, norm_w, _route_cases()[0][1], eps=1e-5, k=9,
                              interpret=True)
