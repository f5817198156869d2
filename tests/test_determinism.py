"""KernelPolicy.deterministic() on the H200: bitwise-repeatable logits and batch-invariant
tokens and logits (Llama-3-8B shapes, 2 layers, random weights; benchmarks/determinism.py runs
the whole model and the default policy beside it; tests/test_batch_invariance.py the same in
interpret mode)."""

import pytest


@pytest.mark.gpu
def test_deterministic_policy_is_repeatable_and_batch_invariant():
    from benchmarks.determinism import check, random_model
    from jaxinfer.plan import KernelPolicy

    result = check(random_model("llama3-8b", layers=2), KernelPolicy.deterministic(), new=32)
    assert result["bitwise_repeatable"], result
    assert all(result["batch_invariant"].values()), result


@pytest.mark.gpu
def test_deterministic_decode_step_is_the_same_alone_and_in_batches_of_16_64_256():
    """Past the fused_rows limit of old: one decode step's logits, logsumexp and new K/V of a
    request alone and at the first, a middle and the last row of batches of 16, 64 and 256;
    and a 48-token prefill in one call and as 16 + 32 (the prefill_chunk path)."""
    from benchmarks.determinism import chunks_check, random_model, rows_check
    from jaxinfer.plan import KernelPolicy

    model = random_model("llama3-8b", layers=2)
    rows = rows_check(model, KernelPolicy.deterministic(), (16, 64, 256), 512)
    assert all(rows.values()), rows
    chunks = chunks_check(model, KernelPolicy.deterministic())
    assert all(chunks.values()), chunks
