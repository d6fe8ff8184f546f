"""The runnable examples of docs/integrations.md, run as written: each section's ```python block,
in a fresh interpreter, from a folder whose ``data`` is the repository's (the examples name
``data/scifact``) and whose ``var`` is its own (the TRL example writes ``var/trl-example``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"


def python_block(section: str) -> str:
    """The one ```python block under ``## {section}`` of docs/integrations.md."""
    text = DOC.read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    blocks = re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)
    assert len(blocks) == 1, f"## {section} should hold one python example, found {len(blocks)}"
    return blocks[0]


def run_example(section: str, folder: Path, timeout: float = 600) -> str:
    """Run the section's example in ``folder``; its stdout (a failure shows its output)."""
    (folder / "data").symlink_to(ROOT / "data")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CASI_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(
        [sys.executable, "-c", python_block(section)], cwd=folder, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
