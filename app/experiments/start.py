"""The start a protocol's cells train from: the warm start its ``[start]`` recipe names, found on
this machine by its recipe hash (never "the newest warm start") and pinned by its weight hash.

Read :func:`resolve_start`. The recipe makes the same weights bit for bit only on one CPU
microarchitecture, so a start may also be imported (`casi policy import`) from the machine that
made it; :func:`pick_start` chooses among the recipe's starts here the one the asked seeds began
from. :func:`warmstart_command` is the command that makes the start, quoted by every message
that needs it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.experiments.protocol import Protocol
from app.settings import Settings
from app.training import warmstart as recipe
from app.training.policy_loader import LoadedPolicy, load_policy_ref
from app.training.warmstart import RecipeStart
from policy.prompts import DEFAULT_FEEDBACK_WORDS
from policy.warmstart import DEFAULT_WORDS

GAME_VARIABLES = ("game", "merge", "retriever", "bm25_stemmer", "bm25_rules", "retrieval_k",
                  "dataset")  # fmt: skip
"""The settings the teacher's start (``source = "prf"``) reads the game's index under: the
command that makes it sets each as ``CASI_<NAME>``, the environment's own (`cell_settings`)."""


@dataclass(frozen=True)
class Start:
    """The pinned start: the warm start's weight hash and its recipe."""

    version: str
    recipe: str  # the recipe hash (`app.training.warmstart.recipe_key`)
    settings: dict[str, Any]  # the protocol's [start] table
    imported: bool = False  # carried here (`casi policy import`), not made by this machine
    made_on: str | None = None  # an imported start: the CPU family that made it, when known

    def pin(self) -> dict[str, Any]:
        """The ``start`` record of a cell file: version and recipe, and for an imported start
        the CPU family that made it (so the machine that ran the cell is not taken for one
        whose recipe makes this start)."""
        out: dict[str, Any] = {"version": self.version, "recipe": self.recipe}
        if self.imported:
            out["made_on"] = self.made_on
        return out


def pick_start(
    here: list[RecipeStart], own: Path | None, begun: Collection[str]
) -> RecipeStart | None:
    """The start cells run from, among the protocol recipe's starts on this machine (``here``):
    the one the asked seeds began from (``begun``), else the one the recipe index names
    (``own``); None when neither is here. ValueError when the asked seeds began from two
    starts that are both here: one command runs from one start."""
    picked = [h for h in here if h.version in begun]
    if len(picked) > 1:
        raise ValueError(
            f"the asked seeds began from different starts ({', '.join(h.version for h in picked)}),"
            " all on this machine: run their cells in one command per start"
        )
    if not picked:
        picked = [h for h in here if own is not None and h.folder == own]
    return picked[0] if picked else None


def warmstart_command(
    start: dict[str, Any], dataset: str | None = None, settings: Settings | None = None
) -> str:
    """The command that makes the protocol's start (with the protocol's dataset, if it names
    one). The teacher's start (``source = "prf"``) reads the game's index: its command sets the
    environment's game settings (``settings``, `app.experiments.cell.cell_settings`'s) in front,
    :data:`GAME_VARIABLES`."""
    flags = " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(start.items()) if k != "policy"
    )
    if start.get("source") == "prf" and settings is not None:
        game = " ".join(f"CASI_{k.upper()}={getattr(settings, k)}" for k in GAME_VARIABLES)
        return f"{game} casi policy warmstart {flags}"
    return f"{f'CASI_DATASET={dataset} ' if dataset else ''}casi policy warmstart {flags}"


def resolve_start(
    protocol: Protocol, settings: Settings, factory: Any, begun: Collection[str] = ()
) -> tuple[LoadedPolicy, Start]:
    """The warm start the protocol's recipe names (its recipe hash → its folder), loaded: the one
    of ``begun`` (the starts the asked seeds began from) that this machine holds, made here or
    imported (`casi policy import`), else the one the recipe index names. ``settings``: the
    environment's (`app.experiments.cell.cell_settings`), whose game the teacher's start reads;
    the key is `casi policy warmstart`'s own (`app.training.warmstart.start_recipe`)."""
    s = protocol.start
    command = warmstart_command(s, protocol.dataset, settings)
    if not any(recipe.recipe_index(settings.var_dir).iterdir()):  # no warm start at all here
        raise FileNotFoundError(
            f"no warm start on this machine; the protocol's start is made by `{command}`"
        )
    base = load_policy_ref(s.get("policy"), settings.var_dir, factory)
    source, words = s.get("source", "titles"), int(s.get("words", DEFAULT_WORDS))
    feedback_words = int(s.get("feedback_words", DEFAULT_FEEDBACK_WORDS))
    n_actions, seed = int(s["n_actions"]), int(s["seed"])
    examples = recipe.start_examples(
        settings, n_actions, s.get("queries"), seed, source, words, feedback_words
    )
    key = recipe.start_recipe(
        base.version, examples, int(s["steps"]), int(s["batch_size"]), float(s["lr"]), seed,
        s["prompt"], s["train_precision"], source, words, None, feedback_words,
    )  # fmt: skip
    del base
    picked = pick_start(
        recipe.recipe_starts(settings.var_dir, key),
        recipe.cached_warmstart(settings.var_dir, key),
        begun,
    )
    if picked is None:
        raise FileNotFoundError(
            f"the protocol's start (warm-start recipe {key}) is not on this machine: run "
            f"`{command}` first (or `casi policy import` the "
            "start a seed began from)"
        )
    policy = load_policy_ref(
        str(picked.folder), settings.var_dir, factory, device=settings.resolved_device()
    )
    return policy, Start(policy.version, key, dict(s), picked.imported, picked.made_on)
