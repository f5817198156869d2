"""The static plan: hashable, validated, and the only way kernel choices reach the model."""

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

from jaxinfer.configs import PRESETS
from jaxinfer.plan import At, Boundary, Flash, Impl, KernelPolicy, Kernels, Plan, Prefetch
from pallas_kernels import MatmulBlockSizes

ROOT = pathlib.Path(__file__).parent.parent


def test_policies_and_plans_hash_and_compare_by_value():
    a, b = KernelPolicy(), KernelPolicy()
    assert a == b and hash(a) == hash(b)
    det = KernelPolicy.deterministic()
    assert det != a and det.batch_invariant and det.one_kernel_mlp_rows == 0
    plan = Plan(PRESETS["llama3-8b"], det)
    assert hash(plan) == hash(Plan(PRESETS["llama3-8b"], KernelPolicy.deterministic()))
    assert len({Plan(PRESETS["llama3-8b"], p) for p in (a, b, det, KernelPolicy.reference())}) == 3
    tiles = a.replace(matmul_tiles=(((4096, 4096, 1), MatmulBlockSizes()),))
    assert hash(tiles) != hash(a) and tiles.tiles(4096, 4096, 1) is not None


def test_a_policy_field_is_part_of_the_compile_key():
    """Two plans differing in one field trace twice; equal plans trace once."""
    traces = []

    def traced(x, plan):
        traces.append(plan)
        return x + 1

    g = jax.jit(traced, static_argnames=("plan",))
    cfg = PRESETS["smollm2-135m"]
    x = jnp.zeros(3)
    g(x, Plan(cfg, KernelPolicy()))
    g(x, Plan(cfg, KernelPolicy()))
    g(x, Plan(cfg, KernelPolicy(one_kernel_mlp_rows=0)))
    assert len(traces) == 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(kernels="pallas"), "kernels='pallas': must be a Kernels"),
    (dict(norm_linear_boundary="consumers"), "must be a Boundary"),
    (dict(one_kernel_mlp_rows=-1), "one_kernel_mlp_rows=-1: must be an integer >= 0"),
    (dict(fused_rows=2.5), "fused_rows=2.5"),
    (dict(attention_chunk=100), "power of two"),
    (dict(prefetch_down=(128, "start")), "must be a Prefetch or None"),
    (dict(batch_invariant=True), "one_kernel_mlp_rows=0.*lm_head=Impl.PALLAS.*deterministic"),
    (dict(steps_per_sync=0), "steps_per_sync=0"),
    (dict(matmul_tiles=((1, 2),)), "matmul_tiles takes"),
])
def test_bad_policies_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KernelPolicy(**kwargs)


def test_bad_prefetch_and_plan():
    with pytest.raises(ValueError, match="rows=0"):
        Prefetch(0)
    with pytest.raises(ValueError, match="At.START"):
        Prefetch(64, "end")
    with pytest.raises(ValueError, match="Plan.config must be a Config"):
        Plan({"hidden_size": 4})
    with pytest.raises(ValueError, match="Plan.policy must be a KernelPolicy"):
        Plan(PRESETS["llama3-8b"], "deterministic")


def test_policy_fields_set_from_text():
    """`jaxinfer bench --policy-field FIELD=VALUE`: ints, bools, enums (name or value),
    strings, None where allowed; an unknown field, a bad value or a tile field is named."""
    p = KernelPolicy()
    for text, field, want in (("moe_route_rows=8", "moe_route_rows", 8),
                              ("int4_fragment_order=false", "int4_fragment_order", False),
                              ("lm_head=pallas", "lm_head", Impl.PALLAS),
                              ("gated_mlp_boundary=KERNEL", "gated_mlp_boundary", Boundary.KERNEL),
                              ("quant_matmul=triton", "quant_matmul", "triton"),
                              ("prefetch_down=none", "prefetch_down", None),
                              ("moe_decode_rows = 4", "moe_decode_rows", 4)):
        assert getattr(p.with_text(text), field) == want, text
    assert p.with_text("moe_route_rows=8") == p.replace(moe_route_rows=8)
    for text, match in (("moe_rows=1", "FIELD one of KernelPolicy's: kernels"),
                        ("moe_route_rows", "expected FIELD=VALUE"),
                        ("moe_route_rows=lots", "moe_route_rows takes an integer, not 'lots'"),
                        ("interpret=yes", "interpret takes true or false"),
                        ("lm_head=cublas", "lm_head takes one of xla, pallas"),
                        ("quant_matmul=cuda", "quant_matmul='cuda': one of"),
                        ("fused_rows=none", "fused_rows takes an integer"),
                        ("attention_blocks=4", "set it in Python")):
        with pytest.raises(ValueError, match=match):
            p.with_text(text)


def test_deterministic_policy_refuses_the_references():
    with pytest.raises(ValueError, match="kernels=Kernels.AUTO or PALLAS"):
        KernelPolicy.deterministic(kernels=Kernels.REFERENCE)
    assert KernelPolicy.deterministic(kernels=Kernels.PALLAS).batch_invariant


def test_enums_name_every_choice():
    assert KernelPolicy.reference().kernels is Kernels.REFERENCE
    det = KernelPolicy.deterministic()
    assert det.lm_head is Impl.PALLAS and det.flash is Flash.TRITON
    assert KernelPolicy().prefetch_norm_linear == Prefetch(64, At.END)
    assert KernelPolicy().norm_linear_boundary is Boundary.CONSUMER


def test_no_module_level_switch_is_read_at_trace_time():
    """No `global` statement, and no module-level mutable default read by the kernels or the
    model: every choice is a KernelPolicy field."""
    for folder in ("jaxinfer", "pallas_kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"^\s*global\s", text, re.M), f"`global` in {path}"
            # module-level assignments of mutable containers or bool/int switches in CAPS
            for m in re.finditer(r"^([A-Z][A-Z0-9_]+)\s*(?::[^=]+)?=\s*(.+)$", text, re.M):
                name, value = m.groups()
                assert not value.startswith(("{", "[", "True", "False")), \
                    f"{path.relative_to(ROOT)}: module-level switch {name} = {value}"
