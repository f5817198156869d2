"""Sharded generation: make a mesh, load a checkpoint onto it, generate.

    python examples/sharded_generate.py /models/Llama-3.1-70B-Instruct --tp 8
    python examples/sharded_generate.py /models/qwen2.5-7b-instruct --tp 4 --dp 2 \
        --prompt "Name a prime number." --prompt "What is the capital of France?"

Every tensor goes to its shards as it is read, so the model never has to fit one device.
Without GPUs, fake CPU devices show the same thing:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python examples/sharded_generate.py tests/fixtures/data/hf/llama_mha_untied --tp 4 --dp 2

On several hosts, run this same script on every host with `--distributed`: each calls
jax.distributed.initialize() first, and the mesh then spans every process's devices.
"""

from __future__ import annotations

import argparse

import jax

import jaxinfer


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="registered name, HF directory or .gguf file")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor parallel (default: every device, over dp)")
    parser.add_argument("--dp", type=int, default=1, help="data parallel (the batch)")
    parser.add_argument("--prompt", action="append", default=None)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=32)
    parser.add_argument("--distributed", action="store_true",
                        help="jax.distributed.initialize() first (one process per host)")
    args = parser.parse_args(argv)
    if args.distributed:  # before any other jax call: the coordinator from the environment
        jax.distributed.initialize()
    if args.tp is None:
        args.tp = jax.device_count() // args.dp

    mesh = jaxinfer.make_mesh(tp=args.tp, dp=args.dp)  # jax.devices(): every process's
    model = jaxinfer.load(args.model, mesh=mesh)
    wqkv = model.params["layers"][0]["wqkv"].w  # [D, Hkv, G + 2, hd], its KV heads over tp
    print(f"{model.config.num_layers} layers on {mesh.devices.size} devices "
          f"(tp={args.tp}, dp={args.dp}); layer 0's q/k/v weight {wqkv.shape} is "
          f"{wqkv.sharding.spec}, {wqkv.addressable_shards[0].data.shape} per device")

    # A checkpoint without a tokenizer (the tiny test fixtures) takes token ids.
    prompts = args.prompt or (["What is the capital of France?"] if model.tokenizer
                              else [[1, 2, 3, 4, 5], [6, 7, 8]])
    for prompt, out in zip(prompts, jaxinfer.generate(model, prompts,
                                                      max_new_tokens=args.max_new_tokens)):
        print(f"{prompt!r} -> {out.text!r} tokens {out.token_ids}")


if __name__ == "__main__":
    main()
