"""Session fixtures for policy tests: the real SmolLM2 tokenizer and a tiny seeded Llama.

The tokenizer fixture ``smol_tokenizer`` lives in tests/conftest.py. The tiny model
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
def tiny_policy(smol_tokenizer: Any) -> torch.nn.Module:
    """Shared, read-only tiny model; init_std 0.2 makes it peaked enough for precision effects."""
    from policy.model import build_tiny_policy

    return build_tiny_policy(smol_tokenizer, seed=0, init_std=0.2)
