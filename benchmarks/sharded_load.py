"""A sharded load's cost: `jaxinfer.load(dir, mesh=make_mesh(tp=N))` of a random HF checkpoint.

    PYTHONPATH=. python benchmarks/sharded_load.py --preset llama3-8b --tp 8 [--num-layers L]
        [--quantization int4] [--dir /tmp/ckpt] [--json]

Writes the preset's shapes as an HF directory (bfloat16 safetensors, one file per layer, an
index), then loads it in a fresh process onto a mesh of tp devices and reports the load time,
each device's bytes, and the peak of the process's host buffers (anonymous memory, not the
checkpoint's mapped file pages) against the checkpoint's size: a load that places every
tensor as it is read peaks near the largest layer, not the model (on GPUs; on a CPU the
devices' buffers are host memory too). --one-device: also the time of a load
onto one device, for comparison. On a CPU,
XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu gives 8 devices.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time


def write_checkpoint(preset: str, num_layers: int | None, path: pathlib.Path) -> int:
    """The preset's HF tensors, random bfloat16 [out, in], one file per layer; its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    from jaxinfer.bench import _preset
    from jaxinfer.models import registry

    config = _preset(preset, "bfloat16", num_layers)
    if config.family != "llama" or config.moe is not None:
        raise ValueError(f"{preset}: this writer knows dense Llama-family presets only")
    family = registry.family(config)
    names, shapes = family.hf_tensors, family.checkpoint_shapes(config)
    rng = np.random.default_rng(0)

    def tensor(shape, transpose):  # ours [in, out] -> stored [out, in]
        shape = shape[::-1] if transpose else shape
        return (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)

    def files():  # one file's tensors at a time in memory
        yield "top", {hf: tensor(shapes["top"][ours], tr) for ours, (hf, tr) in names.top.items()
                      if ours in shapes["top"]}
        for i in range(config.num_layers):
            yield f"layer{i:03d}", {f"model.layers.{i}.{hf}": tensor(shapes["layer"][ours], tr)
                                    for ours, (hf, tr) in names.layer.items()
                                    if ours in shapes["layer"]}

    path.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for stem, tensors in files():
        save_file(tensors, str(path / f"{stem}.safetensors"))
        weight_map.update(dict.fromkeys(tensors, f"{stem}.safetensors"))
        total += sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    rope = config.rope_scaling
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": {"rope_type": rope.kind, "factor": rope.factor,
                         "low_freq_factor": rope.low_freq_factor,
                         "high_freq_factor": rope.high_freq_factor,
                         "original_max_position_embeddings":
                             rope.original_max_position_embeddings},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings}))
    return total


class AnonPeak:
    """The peak of this process's anonymous resident memory (RssAnon, Linux), sampled every
    20 ms on a thread: host buffers, without the checkpoint's file pages that safetensors
    maps (they count in RSS while mapped, yet are page cache the kernel can drop)."""

    def __init__(self):
        self.peak, self._stop = self.now(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def load_once(path: str, tp: int, quantization: str | None) -> dict:
    """Load path onto a tp mesh in this process: time, bytes per device, peak host memory."""
    import jax

    import jaxinfer
    from jaxinfer.sharding import per_device_bytes
    from jaxinfer.weights import param_bytes

    jax.devices()  # the backend up before the baseline
    before = AnonPeak.now()
    t0 = time.perf_counter()
    with AnonPeak() as peak:
        model = jaxinfer.load(path, dtype="bfloat16", quantization=quantization,
                              mesh=jaxinfer.make_mesh(tp=tp) if tp > 1 else None)
        jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    per = per_device_bytes(model.params)
    return {"backend": jax.default_backend(), "devices": len(per), "load_s": round(load_s, 2),
            "param_bytes": param_bytes(model.params),
            "param_bytes_per_device": max(per.values()),
            "host_anon_bytes_before_load": before, "host_anon_peak_bytes": peak.peak}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--quantization", choices=("int8", "int4", "fp8"), default=None)
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a "
                                                "temporary directory, removed after)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one-device", action="store_true",
                   help="also time a load of the same checkpoint onto one device")
    p.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.load:
        print(json.dumps(load_once(args.load, args.tp, args.quantization)))
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        t0 = time.perf_counter()
        size = write_checkpoint(args.preset, args.num_layers, pathlib.Path(tmp))
        write_s = time.perf_counter() - t0
        runs = {}
        for tp in (args.tp, 1) if args.one_device else (args.tp,):
            child = [sys.executable, __file__, "--load", tmp, "--tp", str(tp)]
            child += ["--quantization", args.quantization] if args.quantization else []
            proc = subprocess.run(child, capture_output=True, text=True, check=False)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return proc.returncode
            runs[tp] = json.loads(proc.stdout.strip().splitlines()[-1])
    r = {"preset": args.preset, "layers": args.num_layers, "tp": args.tp,
         "quantization": args.quantization, "checkpoint_bytes": size,
         "write_s": round(write_s, 2), **runs[args.tp]}
    if args.one_device:
        r["one_device_load_s"] = runs[1]["load_s"]
    r["host_peak_over_checkpoint"] = round(
        (r["host_anon_peak_bytes"] - r["host_anon_bytes_before_load"]) / size, 3)
    if args.json:
        print(json.dumps(r))
    else:
        gb = 1e9
        print(f"{args.preset} ({size / gb:.2f} GB bf16) onto {r['devices']} {r['backend']} "
              f"devices (tp={args.tp}) in {r['load_s']} s: {r['param_bytes_per_device'] / gb:.2f}"
              f" GB per device; the load's host buffers peaked at "
              f"{(r['host_anon_peak_bytes'] - r['host_anon_bytes_before_load']) / gb:.2f} GB "
              f"({r['host_peak_over_checkpoint']:.0%} of the checkpoint)"
              + (f"; one device: {r['one_device_load_s']} s" if args.one_device else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
