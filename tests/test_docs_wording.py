"""The README and the documentation speak of the product: its commands, its results and the
machines they were measured on (CPU model, date) — never of how or when the work was done.

Every Markdown file under docs/ is read, except the tables CASI's own commands generate
(`casi experiment aggregate` → docs/experiments/**/table.md, `casi audit credits` →
docs/audits/*.md, `casi report run` → docs/demo/summary.md). The README also stays a product
page: at most 300 lines, with the two commands that matter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Case-insensitive. "session" alone is legitimate product wording (the dashboard's session
# cookie, a signed session that expires, the database's session factory), so only the phrases
# that speak of a working session are listed.
FORBIDDEN = [
    r"\b(?:this|that|the|a|an|one|previous|earlier|later|last|prior|next|same|another)\s+"
    r"session\b(?!\s*(?:cookie|key|secret|factory|token|expir))",
    r"\bwe did(?:\s+not|n['’]t)\b",
    r"\bdid(?:\s+not|n['’]t)\s+have\s+(?:the\s+)?time\b",
    r"\bTODO\b",
    r"\bleft\s+unrun\b",
    r"\bha(?:s|ve)\s+not\s+been\s+run\b",
    r"\bthis\s+(?:[\w-]+\s+)?machine\b",
    r"\b(?:earlier|previous)\s+machine\b",
    r"\bshared\s+(?:its|the)\s+(?:\d+\s+)?(?:CPU\s+)?cores\b",
    r"\bshared\s+the\s+machine\b",
    r"\bwhen\s+the\s+issue\s+was\s+filed\b",
]
PATTERNS = [re.compile(p, re.IGNORECASE) for p in FORBIDDEN]

GENERATED = ("docs/experiments/**/table.md", "docs/audits/*.md", "docs/demo/summary.md")


def documents() -> list[Path]:
    skip = {p for pattern in GENERATED for p in ROOT.glob(pattern)}
    docs = sorted(p for p in (ROOT / "docs").rglob("*.md") if p not in skip)
    return [ROOT / "README.md", *docs]


def offences(text: str) -> list[str]:
    """Each forbidden phrase in `text`, as 'line N: phrase'."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern in PATTERNS:
            for match in pattern.finditer(line):
                found.append(f"line {number}: {match.group(0)!r}")
    return found


@pytest.mark.parametrize("path", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_speaks_of_the_product(path: Path) -> None:
    assert offences(path.read_text(encoding="utf-8")) == [], path.relative_to(ROOT)


def test_the_documents_are_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in documents()}
    assert {"README.md", "docs/index.md", "docs/experiments/credit-units/README.md"} <= names
    assert "docs/experiments/credit-units/table.md" not in names


@pytest.mark.parametrize(
    "text",
    [
        "(Behind a TLS proxy the session cookie is marked `Secure`.)",
        "an HttpOnly cookie holding a signed session that expires after 8 hours",
        "revoking the key ends its sessions at once",
        "engines and sessions; THE engine + session factory from settings",
        "AMD EPYC, 2 cores, AVX2, 2026-12-01; under load",
        "the machine's state",
    ],
)
def test_product_wording_passes(text: str) -> None:
    assert offences(text) == []


@pytest.mark.parametrize(
    "text",
    [
        "(measured 2026-12-01, later session)",
        "Re-run at the end of the session on a quiet machine",
        "as a previous session showed",
        "we did not have time to run it",
        "the full configuration was left unrun",
        "TODO: rerun",
        "Measured 2026-11-30 on this 2-core machine while other jobs shared it",
        "while the full test suite shared its 2 cores",
        "22 req/s when the issue was filed",
        "The issue's full configuration (32 × 45 s) has not been run yet",
    ],
)
def test_process_wording_fails(text: str) -> None:
    assert offences(text) != []


def test_readme_is_a_product_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    assert "make demo" in text
    assert "make test" in text
