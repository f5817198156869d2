"""Test configuration: GPU-marked tests are skipped where no GPU is present."""

import os

# Tests compare float32 logits at 1e-4; keep XLA's CPU matmuls at full precision and quiet.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402
import pytest  # noqa: E402


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (runs on the lent H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_chat():
    """A 2-layer random Llama (float32) with a real tokenizer (a tiny byte-level BPE) and a
    ChatML template: the generation API's behaviour in seconds, where the embedded model's 30
    layers would spend most of the test compiling."""
    import pathlib

    import jax.numpy as jnp

    from checkpoints.tokenizer import Tokenizer
    from jaxinfer.configs import Config
    from jaxinfer.model import from_params
    from jaxinfer.models import llama
    from jaxinfer.weights import init_params

    tokenizer = Tokenizer.from_hf_dir(pathlib.Path(__file__).parent / "fixtures" / "data"
                                      / "tokenizer" / "tiny_hf")
    config = Config(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    max_position_embeddings=512, tie_word_embeddings=True,
                    eos_token_ids=tokenizer.eos_token_ids)
    # Weights 4x the fan-in scale: peaked logits, so greedy text varies instead of looping.
    params = jax.tree.map(lambda a: 4 * a if a.ndim > 1 else a,
                          init_params(llama.param_specs(config), jax.random.key(7), jnp.float32))
    return from_params(config, params, tokenizer, dtype="float32")
