"""`casi policy warmstart`'s pieces: the SFT examples, the recipe that names a warm start, the
checkpoint written once, and its registration. `casi policy merge`: a LoRA adapter merged into
full weights, saved and registered.

A warm start is identified by its *recipe* — the content hash of the starting weights, the
examples and the settings (:func:`recipe_key`). ``var/models/recipes/<recipe>`` names the folder
an earlier run of the same recipe wrote, so an identical run reuses it instead of training again
(:func:`cached_warmstart`); a checkpoint folder holding this very version is kept as it is
(:func:`save_once`); registering is idempotent (:func:`register_warmstart`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import repositories as repo
from app.db import session_scope
from app.errors import CasiError
from app.runtime import Retrieval, build_retrieval
from app.settings import Settings
from app.training.policy_loader import resolve_path
from app.training.policy_prompt import PROMPT_FILE, PolicyPrompt
from app.training.splits import train_val_ids
from evaluator.artifacts import ArtifactError, atomic_write_text
from evaluator.corpus import Dataset, load_dataset
from policy.model import check_model_folder, load_policy, policy_version, save_checkpoint
from policy.params import adapter_base, is_adapter_folder
from policy.warmstart import DEFAULT_WORDS, boilerplate, make_warmstart_examples
from policy.warmstart import teacher_examples as make_teacher_examples

VERSION_FILE = "casi-version.txt"  # the policy version a warm-start folder holds


def warmstart_examples(
    dataset: Dataset,
    n_actions: int,
    queries: int | None,
    seed: int,
    source: str = "titles",
    words: int = DEFAULT_WORDS,
) -> list[Any]:
    """SFT examples from the first ``queries`` TRAIN queries (never the validation slice): each
    query with the titles of its judged documents (``titles``), or their texts, most relevant
    first (``openings`` / ``keywords``), as the m numbered rewrites."""
    by_id = {d.doc_id: d for d in dataset.documents}
    qids = train_val_ids(dataset)[0][:queries]
    items = []
    for q in qids:
        rels = dataset.qrels["train"][q]
        docs = [by_id[d] for d in sorted(rels, key=lambda d: -rels[d]) if d in by_id]
        texts = [d.title if source == "titles" else f"{d.title} {d.text}" for d in docs]
        items.append((dataset.queries[q], texts))
    noise = (
        frozenset()
        if source == "titles"
        else boilerplate([d.retrieval_text for d in dataset.documents])
    )
    return make_warmstart_examples(
        items, n_actions, seed=seed, source=source, words=words, noise=noise
    )


def teacher_examples(
    retrieval: Retrieval, n_actions: int, queries: int | None, feedback_words: int
) -> list[Any]:
    """The teacher's SFT examples (source ``prf``) from the first ``queries`` TRAIN queries
    (never the validation slice): each query's feedback context (the game's
    :meth:`~app.runtime.Retrieval.feedback`, the one context builder) and keyword expansion's
    rewrites of it as the answer."""
    qids = train_val_ids(retrieval.dataset)[0][:queries]
    texts = [retrieval.dataset.queries[q] for q in qids]
    feedback = retrieval.feedback()
    return make_teacher_examples(
        texts,
        feedback.contexts(texts, feedback_words, n_actions),
        feedback.teacher(texts, n_actions),
        n_actions,
    )


def recipe_extra(
    source: str, words: int, top_layers: int | None, feedback_words: int | None = None
) -> list[str]:
    """The recipe-key settings beyond the original ones, only where they differ from the
    defaults (so a recipe written before they existed keeps its key)."""
    extra = [f"top_layers={top_layers}"] if top_layers is not None else []
    if source == "prf":
        extra += [f"source={source}", f"feedback_words={feedback_words}"]
    elif source != "titles":
        extra += [f"source={source}", f"words={words}"]
    return extra


def start_examples(
    settings: Settings, n_actions: int, queries: int | None, seed: int, source: str, words: int,
    feedback_words: int, progress_factory: Any = None,
) -> list[Any]:  # fmt: skip
    """A warm start's SFT examples under ``settings``: the teacher's (source ``prf``, from the
    game's retrieval: its index, depth and dataset) or the pseudo-rewrites of the dataset's
    TRAIN queries. The one place `casi policy warmstart` and the experiment's start build them."""
    if source == "prf":
        retrieval = build_retrieval(settings, progress_factory=progress_factory)
        return teacher_examples(retrieval, n_actions, queries, feedback_words)
    dataset = load_dataset(settings.dataset, splits=("train",))
    return warmstart_examples(dataset, n_actions, queries, seed, source, words)


def start_recipe(
    parent: str, examples: Any, steps: int, batch_size: int, lr: float, seed: int, prompt: str,
    train_precision: str, source: str, words: int, top_layers: int | None, feedback_words: int,
) -> str:  # fmt: skip
    """The recipe key of a warm start (`casi policy warmstart`'s options): :func:`recipe_key`
    over the settings and :func:`recipe_extra`."""
    extra = recipe_extra(source, words, top_layers, feedback_words)  # defaults: the old key
    return recipe_key(
        parent, examples, steps, batch_size, lr, seed, prompt, train_precision, *extra
    )


def recipe_key(parent: str, examples: Any, *settings: Any) -> str:
    """Content hash of everything a warm start depends on (start weights, data, settings); an
    example's feedback context is part of its data (where it has one)."""
    pairs = [
        (e.query, e.answer) if e.context is None else (e.query, e.context, e.answer)
        for e in examples
    ]
    data = json.dumps([parent, pairs, list(settings)])
    return hashlib.sha256(data.encode()).hexdigest()[:16]


def recipe_index(var_dir: Path) -> Path:
    folder = Path(var_dir) / "models" / "recipes"  # recipe hash → warm-start folder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def cached_warmstart(var_dir: Path, recipe: str) -> Path | None:
    """The intact checkpoint an earlier run of the same recipe wrote, if any."""
    entry = recipe_index(var_dir) / recipe
    if not entry.is_file():
        return None
    folder = Path(entry.read_text().strip())
    try:
        check_model_folder(folder)
    except (ArtifactError, OSError):
        return None
    return folder


def remember_warmstart(var_dir: Path, recipe: str, folder: Path) -> None:
    (recipe_index(var_dir) / recipe).write_text(str(folder))


RECIPE_RE = re.compile(r"^[0-9a-f]{16}$")  # recipe_key's hex digest
IMPORTED_SEP = "@"  # var/models/recipes/<recipe>@<version>: a start imported for that recipe


@dataclass(frozen=True)
class RecipeStart:
    """A start on this machine that a recipe made: its version, its folder, and whether it was
    imported (`casi policy import`; ``made_on``: the CPU family that made it, when known)
    rather than made here by `casi policy warmstart`."""

    version: str
    folder: Path
    imported: bool
    made_on: str | None


def folder_version(folder: Path) -> str | None:
    """The version a warm-start folder's :data:`VERSION_FILE` names (None: no marker)."""
    try:
        return (Path(folder) / VERSION_FILE).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def _imported_entries(var_dir: Path, recipe: str | None) -> list[tuple[str, str, Path]]:
    """(recipe, version, entry file) of every imported start (of one recipe, if given)."""
    folder = Path(var_dir) / "models" / "recipes"
    pattern = f"{recipe or '*'}{IMPORTED_SEP}*"
    out = []
    for entry in sorted(folder.glob(pattern)) if folder.is_dir() else []:
        key, _, version = entry.name.partition(IMPORTED_SEP)
        out.append((key, version, entry))
    return out


def _read_import(entry: Path) -> tuple[Path, str | None] | None:
    try:
        data = json.loads(entry.read_text(encoding="utf-8"))
        return Path(data["folder"]), data.get("made_on")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recipe_starts(var_dir: Path, recipe: str) -> list[RecipeStart]:
    """Every intact start on this machine for ``recipe``: the imported ones, then the one the
    recipe index names (made here, or an import that took a free slot: listed once)."""
    found: list[RecipeStart] = []
    for _key, version, entry in _imported_entries(var_dir, recipe):
        read = _read_import(entry)
        if read is None:
            continue
        try:
            check_model_folder(read[0])
        except (ArtifactError, OSError):
            continue
        found.append(RecipeStart(version, read[0], True, read[1]))
    own = cached_warmstart(var_dir, recipe)
    own_version = folder_version(own) if own is not None else None
    if (
        own is not None
        and own_version is not None
        and own_version not in {s.version for s in found}
    ):
        found.append(RecipeStart(own_version, own, False, None))
    return found


def _index_entries(var_dir: Path) -> Iterator[tuple[str, Path]]:
    """(recipe, the folder its entry names) of every plain recipe index entry (made here, or an
    import that took a free slot); creates nothing."""
    index = Path(var_dir) / "models" / "recipes"
    for entry in sorted(index.iterdir()) if index.is_dir() else []:
        if not RECIPE_RE.match(entry.name):  # an imported entry (<recipe>@<version>), a lock
            continue
        try:
            yield entry.name, Path(entry.read_text(encoding="utf-8").strip())
        except OSError:
            continue


def local_start_versions(var_dir: Path) -> set[str]:
    """The versions of the warm starts this machine holds for any recipe (made or imported);
    reads the recipe index and the folders' version markers only, creates nothing."""
    versions = {
        version
        for _key, version, entry in _imported_entries(var_dir, None)
        if (read := _read_import(entry)) is not None and read[0].is_dir()
    }
    for _key, folder in _index_entries(var_dir):
        if folder.is_dir() and (version := folder_version(folder)) is not None:
            versions.add(version)
    return versions


def recipes_naming(var_dir: Path, folder: Path, version: str) -> list[str]:
    """The recipes whose start on this machine is ``folder`` (or the imported ``version``)."""
    keys = [key for key, v, _ in _imported_entries(var_dir, None) if v == version]
    mine = Path(folder).resolve()
    keys += [
        key for key, named in _index_entries(var_dir) if named.is_dir() and named.resolve() == mine
    ]
    return keys


def remember_import(
    var_dir: Path, recipe: str, folder: Path, version: str, made_on: str | None
) -> str | None:
    """Record the imported ``version`` (in ``folder``) as a start of ``recipe``; it also answers
    the recipe (`cached_warmstart`) unless this machine has an intact start of another version
    for it, whose version is then returned (kept: an import never replaces a start). A version
    the recipe index already names (made here) stays recorded as made here."""
    own = cached_warmstart(var_dir, recipe)
    other = folder_version(own) if own is not None else None
    if own is not None and other == version:
        return None
    entry = recipe_index(var_dir) / f"{recipe}{IMPORTED_SEP}{version}"
    atomic_write_text(entry, json.dumps({"folder": str(folder), "made_on": made_on}))
    if own is not None:
        return other or "?"
    remember_warmstart(var_dir, recipe, folder)
    return None


OUT_FIX = "choose another --out (a new or empty folder); nothing in it was changed"


def occupied(folder: Path) -> bool:
    """Whether saving at ``folder`` would replace something: a file, a link, a folder with
    anything in it (an empty folder, or nothing at all, is free)."""
    folder = Path(folder)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        return True
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError:  # unreadable: not ours to replace
        return True


def check_out(out: Path) -> None:
    """Refuse, before any work, an ``--out`` the user names that holds anything but a CASI
    checkpoint (:data:`VERSION_FILE`): a save there would replace — delete — it. Whether the
    checkpoint is the version about to be saved is known after the work (:func:`save_once`)."""
    if occupied(out) and folder_version(out) is None:
        raise CasiError(f"{out} exists and is not empty", "--out", OUT_FIX)


def save_once(
    model: Any,
    tok: Any,
    target: Path,
    version: str,
    *,
    keep_other: bool = False,
    prompt: PolicyPrompt | None = None,
) -> tuple[Path, bool]:
    """(folder, reused): an intact checkpoint of this very version at ``target`` is kept.

    ``keep_other``: ``target`` is a folder the user named (``--out``): anything else there — a
    file, other files, another version, a damaged checkpoint — is refused (:class:`CasiError`),
    never replaced. A folder CASI names (``var/models/warmstart-<version>``) that is damaged
    is written again. ``prompt``: the prompt the weights were taught, recorded beside them
    (`app.training.policy_prompt`)."""
    marker = target / VERSION_FILE
    if marker.is_file() and marker.read_text(encoding="utf-8").strip() == version:
        try:
            check_model_folder(target)
            return target, True
        except ArtifactError as exc:
            if keep_other:
                raise CasiError(
                    f"{target} holds a damaged checkpoint of version {version} ({exc.problem})",
                    "--out",
                    OUT_FIX,
                ) from None
            # damaged: written again below
    if keep_other and occupied(target):
        held = folder_version(target)
        what = f"holds version {held}, not {version}" if held else "exists and is not empty"
        raise CasiError(f"{target} {what}", "--out", OUT_FIX)
    extra = {VERSION_FILE: version + "\n"}
    if prompt is not None:
        extra[PROMPT_FILE] = prompt.file_text()
    return save_checkpoint(model, tok, target, extra_files=extra), False


def register_warmstart(
    factory: sessionmaker[Session],
    *,
    parent: str,
    version: str,
    folder: Path,
    policy: str | None,
    meta: dict[str, Any],
    steps: int,
) -> bool:
    """Register base + warm-start versions unless present (idempotent); True if new."""
    with session_scope(factory) as session:
        if repo.get_policy_version_by_version(session, version) is not None:
            return False
        base = repo.get_policy_version_by_version(session, parent) or repo.add_policy_version(
            session, version=parent, name="base", base_model=policy or "SmolLM2-135M-Instruct",
            path=policy or "default", kind="base",
        )  # fmt: skip
        repo.add_policy_version(
            session, version=version, name="warmstart", base_model=base.base_model,
            path=str(folder), kind="warmstart", step=steps, parent_id=base.id, meta=meta,
        )  # fmt: skip
        return True


def merge_lora(
    factory: sessionmaker[Session], var_dir: Path, ref: str, out: Path | None
) -> tuple[str, Path]:
    """Merge the LoRA adapter checkpoint ``ref`` (version, prefix or folder) into full weights,
    saved to ``out`` (default: beside it, ``-merged``) and registered: (version, folder). An
    ``out`` that exists and holds anything but this version's checkpoint is refused."""
    path, name, _ = resolve_path(ref, factory)
    folder = Path(path) if path else None
    if folder is None or not is_adapter_folder(folder):
        raise ValueError(f"{ref} is not a LoRA adapter checkpoint (nothing to merge)")
    if out is not None:
        check_out(out)  # before the load: a folder of the user's is never replaced
    model, tok = load_policy(folder, var_dir, progress=False)
    target = out or folder.with_name(folder.name + "-merged")
    version = policy_version(model)
    # the version marker lets a rerun reuse the folder; a user's --out holding anything else
    # is refused (the default folder beside the adapter is CASI's: written again)
    target, _ = save_once(model, tok, target, version, keep_other=out is not None)
    with session_scope(factory) as session:
        parent = repo.get_policy_version_by_version(session, adapter_base(folder)["base_version"])
        pv = repo.get_or_add_policy_version(
            session, version=version, name=f"{name}-merged", base_model="merged LoRA",
            path=str(target), kind="trained", parent_id=parent.id if parent else None,
            meta={"merged_from": str(folder)},
        )  # fmt: skip
        # the adapter's version IS the hash of the merged weights it serves: the same row,
        # now pointing at the full weights (faster to load), the adapter kept in its meta
        pv.meta = {**(pv.meta or {}), "adapter": str(folder)}
        pv.path = str(target)
    return version, target
