"""The model families, as data: everything outside a family's own module goes through here.

    family(config)                  the Family of a Config (by config.family)
    for_hf_architecture(name)       the Family that loads an HF `architectures` entry, or None
    for_gguf_architecture(name)     the same for a GGUF `general.architecture`
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from jaxinfer.configs import Config
from jaxinfer.models import deepseek, gemma, llama
from jaxinfer.models.family import Family

FAMILIES: Mapping[str, Family] = types.MappingProxyType(
    {f.name: f for f in (llama.FAMILY, deepseek.FAMILY, gemma.FAMILY)})


def family(config: Config) -> Family:
    if config.family not in FAMILIES:
        raise ValueError(f"unknown model family {config.family!r}; known: "
                         f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[config.family]


def hf_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.hf_architectures]


def gguf_architectures() -> list[str]:
    return [a for f in FAMILIES.values() for a in f.gguf_architectures]


def for_hf_architecture(name: str) -> Family | None:
    return next((f for f in FAMILIES.values() if name in f.hf_architectures), None)


def for_gguf_architecture(name: str) -> Family | None:
    return next((f for f in FAMILIES.values() if name in f.gguf_architectures), None)
