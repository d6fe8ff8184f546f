"""docs/integrations.md's TRL example runs as written (its verl example: tests/integrations/
test_verl.py, in verl's environment)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl", reason="the trl extra: pip install -e '.[trl]'")

from docs_examples import run_example  # noqa: E402

# slow: ~1.5 min alone, ~5 min beside other work (MiniLM over 300 abstracts, two GRPO steps);
# `make test-all` runs it, CI's `make test` does not
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_trl_example_runs_as_written(tmp_path: Path) -> None:
    out = run_example("TRL", tmp_path)
    # the last line: the (B, T) token advantages of the last batch, B = 8 completions
    assert out.strip().splitlines()[-1].startswith("torch.Size([8, ")
    assert (tmp_path / "var" / "trl-example").is_dir()
