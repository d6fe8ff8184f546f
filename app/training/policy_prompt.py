"""The prompt a policy was trained with, kept beside its weights.

A policy answers well only in the prompt style it learned (`policy.prompts.PROMPT_STYLES`): a
warm start taught the ``short`` or ``feedback`` prompt, and a run trained with it. Every
checkpoint CASI writes (`casi policy warmstart`, `casi train`'s checkpoints) holds
:data:`PROMPT_FILE`, and whatever serves or samples a policy reads it (:func:`read_prompt`):
``POST /v1/rewrites`` and `casi rewrite` prompt it as it was trained. A folder without the file
(the base model, any checkpoint written before it existed, a Hugging Face folder) is prompted
``oneshot``, the style the untrained model needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from policy.prompts import DEFAULT_FEEDBACK_WORDS
from policy.rollout import RolloutConfig

PROMPT_FILE = "casi-prompt.json"


@dataclass(frozen=True)
class PolicyPrompt:
    """How a policy is prompted: its style, and the feedback context's size (style feedback)."""

    style: str = "oneshot"
    feedback_words: int = DEFAULT_FEEDBACK_WORDS

    def __post_init__(self) -> None:
        RolloutConfig(prompt=self.style, feedback_words=self.feedback_words)  # the same checks

    def file_text(self) -> str:
        return json.dumps({"prompt": self.style, "feedback_words": self.feedback_words}) + "\n"


def prompt_of(rollout: RolloutConfig) -> PolicyPrompt:
    """The prompt of a rollout shape (a run's, a warm start's)."""
    return PolicyPrompt(rollout.prompt, rollout.feedback_words)


def read_prompt(folder: str | Path | None) -> PolicyPrompt:
    """The prompt recorded in ``folder`` (``oneshot`` where none is: see the module docstring);
    a file that is unreadable or names an unknown style is a ValueError naming it."""
    if folder is None:
        return PolicyPrompt()
    path = Path(folder) / PROMPT_FILE
    if not path.is_file():
        return PolicyPrompt()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return PolicyPrompt(str(data["prompt"]), int(data["feedback_words"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a CASI prompt record ({exc})") from exc


def write_prompt(folder: Path, prompt: PolicyPrompt) -> None:
    """Record ``prompt`` in a checkpoint ``folder`` written just now (outside its manifest, which
    covers the weights and tokenizer files)."""
    (Path(folder) / PROMPT_FILE).write_text(prompt.file_text(), encoding="utf-8")
