"""Damaged artefacts are never used: every kind CASI writes under var/ is flipped, truncated or
deleted, then loaded. Rebuildable ones (index, converted model) are rebuilt with a warning;
the others (checkpoint, surrogate) are refused with an error naming them. In-process (the
loaders themselves); the CLI's handling of the same errors is covered by test_cli_errors.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hardening_support import flip_byte, truncate

from evaluator.artifacts import (
    MANIFEST_NAME,
    ArtifactError,
    atomic_file,
    check_safetensors,
    verify_folder,
    write_manifest,
)
from evaluator.corpus import load_dataset
from evaluator.index import INDEX_DIRNAME, build_or_load
from evaluator.locks import build_lock

# ---------------------------------------------------------------- the artefact primitives


def test_manifest_verifies_sizes_always_and_hashes_on_first_load(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hello")
    manifest = write_manifest(tmp_path)
    assert set(manifest["files"]) == {"a.bin", "sub/b.txt"}
    verify_folder(tmp_path)
    flip_byte(tmp_path / "a.bin", keep_mtime=True)  # bit rot: size and mtime unchanged
    verify_folder(tmp_path)  # the stamp says "already hashed": only sizes are checked
    with pytest.raises(ArtifactError, match="sha256"):
        verify_folder(tmp_path, deep=True)  # what CASI_VERIFY=1 asks for
    flip_byte(tmp_path / "a.bin")  # back to the original bytes, but a new mtime
    verify_folder(tmp_path)
    (tmp_path / "sub" / "b.txt").write_text("hellO")  # a normal edit: new mtime → re-hashed
    with pytest.raises(ArtifactError, match="sub/b.txt does not match"):
        verify_folder(tmp_path)
    truncate(tmp_path / "a.bin")
    with pytest.raises(ArtifactError, match="a.bin has 500 bytes"):
        verify_folder(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable"):
        verify_folder(tmp_path)


def test_casi_verify_forces_hashing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.bin").write_bytes(b"y" * 64)
    write_manifest(tmp_path)
    flip_byte(tmp_path / "a.bin", keep_mtime=True)
    verify_folder(tmp_path)
    monkeypatch.setenv("CASI_VERIFY", "1")
    with pytest.raises(ArtifactError, match="sha256"):
        verify_folder(tmp_path)


def test_atomic_file_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash while writing")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_build_lock_is_reentrant_in_one_process(tmp_path: Path) -> None:
    with build_lock(tmp_path / "thing"), build_lock(tmp_path / "thing"):
        pass


# ---------------------------------------------------------------- the FAISS index


@pytest.fixture(scope="module")
def tiny_index(tiny_beir: Path, embedder, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """(dataset, var dir holding a sound index, its folder, its embeddings)."""
    ds = load_dataset(tiny_beir)
    var = tmp_path_factory.mktemp("var-index")
    index, built = build_or_load(ds.documents, embedder, var)
    assert built
    return ds, var, var / INDEX_DIRNAME / index.version, index.embeddings.copy()


def _garble_meta(folder: Path) -> None:
    (folder / "meta.json").write_text('{"version": ')


def _shorten_ids(folder: Path) -> None:
    ids = json.loads((folder / "doc_ids.json").read_text())
    (folder / "doc_ids.json").write_text(json.dumps(ids[:-1]))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "embeddings-flipped-byte": lambda f: flip_byte(f / "embeddings.npy", offset=-7),
    "embeddings-flipped-byte-same-mtime": lambda f: flip_byte(
        f / "embeddings.npy", offset=-7, keep_mtime=True
    ),
    "embeddings-header-garbled": lambda f: flip_byte(f / "embeddings.npy", offset=20),
    "faiss-flipped-byte": lambda f: flip_byte(f / "index.faiss", offset=-5),
    "faiss-truncated": lambda f: truncate(f / "index.faiss"),
    "faiss-zeroed": lambda f: (f / "index.faiss").write_bytes(
        bytes((f / "index.faiss").stat().st_size)
    ),
    "faiss-missing": lambda f: (f / "index.faiss").unlink(),
    "ids-shortened": _shorten_ids,
    "meta-garbled": _garble_meta,
    "meta-missing": lambda f: (f / "meta.json").unlink(),  # an interrupted older build
    "manifest-missing": lambda f: (f / MANIFEST_NAME).unlink(),  # adopted after cross-checks
    "folder-is-a-file": lambda f: (shutil.rmtree(f), f.write_text("junk")),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_index_is_rebuilt_never_used(  # type: ignore[no-untyped-def]
    damage: str, tiny_index, embedder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ds, var, folder, emb = tiny_index
    work = tmp_path / "var"
    shutil.copytree(var / INDEX_DIRNAME, work / INDEX_DIRNAME)
    target = work / INDEX_DIRNAME / folder.name
    DAMAGE[damage](target)
    with caplog.at_level(logging.WARNING):
        index, built = build_or_load(ds.documents, embedder, work)
    if damage == "manifest-missing":  # sound data from an older CASI: adopted, not rebuilt
        assert not built and (target / MANIFEST_NAME).is_file()
    else:
        assert built and f"index {target} is damaged" in caplog.text
    np.testing.assert_allclose(index.embeddings, emb, atol=1e-6)
    assert index.doc_ids == ds.doc_ids and index.index.ntotal == len(ds.doc_ids)
    verify_folder(target, deep=True)  # what is on disk now is whole
    leftovers = [p.name for p in target.parent.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []
    again, built_again = build_or_load(ds.documents, embedder, work)
    assert not built_again  # rebuilt once, then reused


# ---------------------------------------------------------------- checkpoints and the converted model


CKPT_DAMAGE: dict[str, Callable[[Path], None]] = {
    "weights-flipped-byte": lambda f: flip_byte(f / "model.safetensors"),
    "weights-truncated": lambda f: truncate(f / "model.safetensors"),
    "weights-missing": lambda f: (f / "model.safetensors").unlink(),
    "tokenizer-flipped-byte": lambda f: flip_byte(f / "tokenizer.json"),
    "manifest-garbled": lambda f: (f / MANIFEST_NAME).write_text("[1, 2"),
}


@pytest.mark.parametrize("damage", sorted(CKPT_DAMAGE))
def test_damaged_checkpoint_is_refused_by_name(
    damage: str, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    from policy.model import load_policy

    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
    CKPT_DAMAGE[damage](folder)
    with pytest.raises(ArtifactError) as info:
        load_policy(str(folder), tmp_path / "var", progress=False)
    assert info.value.artifact == folder and "cannot be rebuilt" in str(info.value)


def test_sound_checkpoint_loads_and_equals_the_saved_model(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    from policy.model import load_policy, policy_version

    model, _ = load_policy(str(tiny_checkpoint), tmp_path / "var", progress=False)
    again, _ = load_policy(str(tiny_checkpoint), tmp_path / "var", progress=False)
    assert policy_version(model) == policy_version(again)


def test_hf_folder_without_manifest_is_checked_structurally(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(tiny_checkpoint, tmp_path / "hf"))
    (folder / MANIFEST_NAME).unlink()
    check_safetensors(folder / "model.safetensors")  # whole
    with (folder / "model.safetensors").open("ab") as fh:
        fh.write(b"\x00" * 3)
    with pytest.raises(ArtifactError, match="header declares"):
        check_safetensors(folder / "model.safetensors")


@pytest.mark.parametrize("damage", ["weights-truncated", "tokenizer-flipped-byte", "no-config"])
def test_damaged_converted_model_is_converted_again(
    damage: str, tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The default policy's conversion under var/models is a cache: damage → re-convert."""
    from policy.model import _sound_conversion, default_model_dir

    target = default_model_dir(tmp_path / "var")
    shutil.copytree(tiny_checkpoint, target)
    assert _sound_conversion(target)
    if damage == "no-config":
        (target / "config.json").unlink()
    else:
        CKPT_DAMAGE[damage](target)
    with caplog.at_level(logging.WARNING):
        assert not _sound_conversion(target)  # load_policy then converts the GGUF again
    assert "converting it again" in caplog.text


def test_converted_model_of_an_older_casi_is_adopted(tiny_checkpoint: Path, tmp_path: Path) -> None:
    from policy.model import _sound_conversion, default_model_dir

    target = default_model_dir(tmp_path / "var")
    shutil.copytree(tiny_checkpoint, target)
    (target / MANIFEST_NAME).unlink()
    assert _sound_conversion(target) and (target / MANIFEST_NAME).is_file()


# ---------------------------------------------------------------- the surrogate evaluator


@pytest.fixture
def saved_surrogate(tmp_path: Path) -> Path:
    from evaluator.scorers.surrogate import SurrogateConfig, SurrogateNet, save_surrogate

    torch.manual_seed(0)
    path = tmp_path / "surrogate" / "s.safetensors"
    save_surrogate(SurrogateNet(SurrogateConfig(dim=8, hidden=8, k_max=4)), path)
    return path


SURROGATE_DAMAGE: dict[str, Callable[[Path], None]] = {
    "weights-truncated": lambda p: truncate(p),
    "weights-flipped-byte": lambda p: flip_byte(p, offset=-3),
    "weights-header-garbled": lambda p: flip_byte(p, offset=2),
    "meta-garbled": lambda p: p.with_suffix(".json").write_text("{"),
}


@pytest.mark.parametrize("damage", sorted(SURROGATE_DAMAGE))
def test_damaged_surrogate_is_refused(damage: str, saved_surrogate: Path) -> None:
    from evaluator.scorers.surrogate import load_surrogate_model

    load_surrogate_model(saved_surrogate)  # sound
    SURROGATE_DAMAGE[damage](saved_surrogate)
    with pytest.raises(ArtifactError) as info:
        load_surrogate_model(saved_surrogate)
    assert "casi evaluator fit" in str(info.value)
    assert info.value.artifact.name.startswith("s.")
