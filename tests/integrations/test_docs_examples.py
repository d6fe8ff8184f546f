"""docs/integrations.md's TRL example runs as written (its verl example: tests/integrations/
test_verl.py, in verl's environment)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trl extra: pip install -e '.[trl]'")

from docs_examples import run_example  # noqa: E402

# slow: ~1.5 min alone, ~5 min beside other work (MiniLM over 300 abstracts, two GRPO steps);
# `make test-all` runs it, CI's `make test` does not
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_trl_example_runs_as_written(tmp_path: Path) -> None:
    """It prints the (B, T) shape of the last batch's token advantages, then each completion's
    actions and the mean advantage on each action's tokens: per-action credit shows, some
    completion's actions get different advantages."""
    out = run_example("TRL", tmp_path, timeout=1500)  # ~7 min beside other work
    lines = out.strip().splitlines()
    assert any(line.startswith("torch.Size([8, ") for line in lines), lines[-10:]
    per_action = [re.search(r"-> \[(.*)\]$", line) for line in lines]
    means = [[float(x) for x in m.group(1).split(",") if x.strip()] for m in per_action if m]
    assert len(means) == 8, lines[-10:]
    assert any(len(set(row)) > 1 for row in means), f"no completion's actions differ: {means}"
    assert (tmp_path / "var" / "trl-example").is_dir()
