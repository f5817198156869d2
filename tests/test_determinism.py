"""KernelPolicy.deterministic() on the H200: bitwise-repeatable logits and batch-invariant
tokens (Llama-3-8B shapes, 2 layers, random weights; benchmarks/determinism.py runs the
whole model and the default policy beside it)."""

import pytest


@pytest.mark.gpu
def test_deterministic_policy_is_repeatable_and_batch_invariant():
    from benchmarks.determinism import check, random_model
    from jaxinfer.plan import KernelPolicy

    result = check(random_model("llama3-8b", layers=2), KernelPolicy.deterministic(), new=32)
    assert result["bitwise_repeatable"], result
    assert all(result["batch_invariant"].values()), result
