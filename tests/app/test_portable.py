"""`casi policy export` / `casi policy import`: a policy version carried between two machines (two
var folders, two real databases) keeps its weights bit for bit, its registration and the
warm-start recipe that made it, so a protocol seed begun from it can be finished on a CPU whose
own recipe makes another start. An import never replaces a start the machine has, and a damaged
or hostile archive is refused before anything is registered. The tiny policy; nothing mocked."""

from __future__ import annotations

import io
import json
import lzma
import shutil
import tarfile
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from app.cli import app
from app.db import session_scope
from app.db.session import make_engine, make_session_factory, upgrade_to_head
from app.experiments.start import pick_start
from app.settings import get_settings
from app.training import warmstart as recipe
from app.training.policy_loader import find_version, load_policy_ref
from app.training.portable import ARCHIVE_MANIFEST, export_policy, import_policy
from evaluator.artifacts import ArtifactError
from policy.model import build_tiny_policy, policy_version, save_checkpoint

KEY = "0123456789abcdef"  # a warm-start recipe
BASE = "b" * 12  # the version the warm start began from
ZEN4 = "AuthenticAMD family 25 model 17 stepping 1"


def _factory(url: str) -> sessionmaker[Session]:
    upgrade_to_head(url)
    return make_session_factory(make_engine(url))


def _start(
    var: Path, factory: sessionmaker[Session], tok: Any, seed: int, made_on: str, key: str = KEY
) -> str:
    """A warm start made "here" as `casi policy warmstart` leaves it: folder with its version
    marker, registration (recipe, maker) and the recipe index entry."""
    model = build_tiny_policy(tok, seed=seed)
    version = policy_version(model)
    folder, _ = recipe.save_once(model, tok, var / "models" / f"warmstart-{version}", version)
    recipe.register_warmstart(
        factory, parent=BASE, version=version, folder=folder, policy=None, steps=60,
        meta={"recipe": key, "made_on": made_on, "lr": 5e-5},
    )  # fmt: skip
    recipe.remember_warmstart(var, key, folder)
    return version


@pytest.fixture
def machines(tmp_path: Path, db_url: str, smol_tokenizer: Any) -> dict[str, Any]:
    """Machine A (its own SQLite) made a start and exported it; machine B (each backend) is
    empty."""
    var_a, var_b = tmp_path / "a", tmp_path / "b"
    factory_a = _factory(f"sqlite:///{(tmp_path / 'a.db').as_posix()}")
    version = _start(var_a, factory_a, smol_tokenizer, 0, ZEN4)
    archive = tmp_path / "start.tar"
    done = export_policy(factory_a, var_a, version[:8], archive)
    assert (done.version, done.kind, done.recipes, done.made_on) == (
        version, "warmstart", (KEY,), ZEN4,
    )  # fmt: skip
    return {"version": version, "archive": archive, "var_a": var_a, "factory_a": factory_a,
            "var_b": var_b, "factory_b": _factory(db_url), "tmp": tmp_path,
            "tok": smol_tokenizer}  # fmt: skip


def test_a_start_travels_with_its_registration_and_its_recipe(machines: dict[str, Any]) -> None:
    version, var_b, factory_b = machines["version"], machines["var_b"], machines["factory_b"]
    done = import_policy(factory_b, var_b, machines["archive"])
    assert (done.version, done.kind, done.registered, done.reused_folder) == (
        version, "warmstart", True, False,
    )  # fmt: skip
    assert done.claimed == (KEY,) and done.kept == {} and done.made_on == ZEN4
    assert load_policy_ref(str(done.folder), var_b).version == version  # bit for bit
    with session_scope(factory_b) as session:
        row = find_version(session, version)
        assert row is not None and row.kind == "warmstart" and row.step == 60
        assert row.path == str(done.folder) and row.parent is None  # B never saw the base
        assert row.meta["made_on"] == ZEN4 and row.meta["imported_from"] == "start.tar"
        assert row.meta["recipe"] == KEY and row.meta["lr"] == 5e-5
    # B's recipe index now answers the recipe with it, and knows it was imported:
    assert recipe.cached_warmstart(var_b, KEY) == done.folder
    assert recipe.local_start_versions(var_b) == {version}
    [here] = recipe.recipe_starts(var_b, KEY)
    assert (here.version, here.imported, here.made_on) == (version, True, ZEN4)
    # again: nothing unpacked or registered twice; re-exported from B, it still names its maker
    again = import_policy(factory_b, var_b, machines["archive"])
    assert again.reused_folder and not again.registered and again.claimed == (KEY,)
    back = export_policy(factory_b, var_b, version, machines["tmp"] / "again.tar.gz")
    assert (back.version, back.recipes, back.made_on) == (version, (KEY,), ZEN4)
    var_c = machines["tmp"] / "c"  # a third machine, from the compressed archive
    third = import_policy(_factory(f"sqlite:///{var_c}.db"), var_c, back.path)
    assert third.version == version and third.made_on == ZEN4 and third.claimed == (KEY,)


def test_importing_a_version_the_machine_already_has_unpacks_nothing(
    machines: dict[str, Any],
) -> None:
    """Machine A imports its own export: its folder and registration are kept as they are."""
    var_a, version = machines["var_a"], machines["version"]
    own = recipe.cached_warmstart(var_a, KEY)
    done = import_policy(machines["factory_a"], var_a, machines["archive"])
    assert (done.folder, done.reused_folder, done.registered) == (own, True, False)
    assert done.claimed == (KEY,) and done.kept == {}
    [here] = recipe.recipe_starts(var_a, KEY)
    assert (here.version, here.folder, here.imported) == (version, own, False)  # made here
    assert [p.name for p in (var_a / "models").iterdir() if p.name.startswith("warmstart-")] == [
        f"warmstart-{version}"
    ]


def test_an_import_never_replaces_the_start_this_machine_made(machines: dict[str, Any]) -> None:
    """B's own recipe made another start (another CPU): it keeps answering the recipe; the
    imported one serves the seeds that began from it."""
    var_b, factory_b, imported = machines["var_b"], machines["factory_b"], machines["version"]
    own = _start(var_b, factory_b, machines["tok"], 1, "GenuineIntel family 6 model 167")
    done = import_policy(factory_b, var_b, machines["archive"])
    assert done.claimed == () and done.kept == {KEY: own}
    assert recipe.folder_version(recipe.cached_warmstart(var_b, KEY) or Path()) == own
    here = recipe.recipe_starts(var_b, KEY)
    assert {(h.version, h.imported) for h in here} == {(own, False), (imported, True)}
    assert recipe.local_start_versions(var_b) == {own, imported}
    folder = recipe.cached_warmstart(var_b, KEY)
    assert pick_start(here, folder, {imported}).version == imported  # a seed begun from it
    assert pick_start(here, folder, set()).version == own  # new seeds: this machine's start
    assert pick_start(here, folder, {"f" * 12}).version == own  # begun elsewhere: refused later
    with pytest.raises(ValueError, match="one command per start"):
        pick_start(here, folder, {own, imported})
    assert pick_start([], None, {imported}) is None


def _rewrite(archive: Path, out: Path, change: Any) -> Path:
    """A copy of ``archive`` whose members pass through ``change(info, data) -> (info, data)``
    (None drops the member)."""
    with tarfile.open(archive) as src, tarfile.open(out, "w") as dst:
        for info in src:
            fh = src.extractfile(info)
            changed = change(info, fh.read() if fh is not None else b"")
            if changed is not None:
                info, data = changed
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
    return out


def _flip_weights(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    if info.name.endswith(".safetensors"):
        data = data[:-1] + bytes([data[-1] ^ 1])
    return info, data


def _claim(version: str) -> Any:
    def change(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        if info.name == ARCHIVE_MANIFEST:
            data = json.dumps({**json.loads(data), "version": version}).encode()
        return info, data

    return change


def _escape(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    if info.name.endswith("config.json") and "generation" not in info.name:
        info.name = "policy/../../escaped.json"
    return info, data


def _link(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    if info.name.endswith("config.json") and "generation" not in info.name:
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        return info, b""
    return info, data


def _pickle(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    if info.name == "policy/config.json":  # renamed: a pickle would run code when loaded
        info.name = "policy/pytorch_model.bin"
    return info, data


def _forge(name: str, new: bytes | None, listed: str | None = None) -> Any:
    """Replace ``policy/<name>`` by ``new`` and rewrite the checkpoint's manifest to match (what
    an attacker can do: the manifest travels in the archive); ``listed``: also list that path."""

    def change(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        if info.name == f"policy/{name}" and new is not None:
            data = new
        elif info.name == "policy/manifest.json":
            manifest = json.loads(data)
            if new is not None:
                manifest["files"][name] = {"size": len(new), "sha256": sha256(new).hexdigest()}
            if listed is not None:
                manifest["files"][listed] = {"size": 0, "sha256": sha256(b"").hexdigest()}
            data = json.dumps(manifest).encode()
        return info, data

    return change


def _rename(old: str, new: str) -> Any:
    def change(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
        if info.name == f"policy/{old}":
            info.name = f"policy/{new}"
        return info, data

    return change


def _deep_record(info: tarfile.TarInfo, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    return (info, b"[" * 100_000) if info.name == ARCHIVE_MANIFEST else (info, data)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (_flip_weights, "model.safetensors does not match its sha256"),
        (_claim("f" * 12), "its weights hash to"),
        (_claim("not-a-hash"), r"invalid \['version'\]"),
        (_escape, "is not a plain file of the checkpoint"),
        (_link, "is not a plain file of the checkpoint"),
        (_pickle, "no code or pickle"),
        (lambda info, data: None if info.name == ARCHIVE_MANIFEST else (info, data),
         "no casi-policy.json first"),
        (_rename("config.json", ".."), "is not a plain file of the checkpoint"),
        (_rename("generation_config.json", "notes.txt"), r"\['notes.txt'\] not in its manifest"),
        (_forge(recipe.VERSION_FILE, b"f" * 12 + b"\n"), "casi-version.txt says 'ffffffffffff'"),
        (_forge("config.json", b'{"model_type": "llama", "hidden_size": 7}'), "does not load"),
        (_forge("config.json", None, listed="/etc/hostname"), "lists paths outside its folder"),
        (_deep_record, "casi-policy.json is not valid JSON"),
    ],
    ids=["damaged-weights", "wrong-version", "bad-record", "path-escape", "symlink", "pickle",
         "no-record", "dot-name", "unlisted-file", "lying-marker", "bad-config",
         "manifest-outside", "deep-record"],
)  # fmt: skip
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # refused before registering
def test_a_damaged_or_hostile_archive_is_refused_and_nothing_is_kept(
    machines: dict[str, Any], change: Any, error: str
) -> None:
    var_b, factory_b, tmp = machines["var_b"], machines["factory_b"], machines["tmp"]
    bad = _rewrite(machines["archive"], tmp / "bad.tar", change)
    with pytest.raises(ValueError, match=error):
        import_policy(factory_b, var_b, bad)
    assert not (tmp / "escaped.json").exists()
    _nothing_kept(machines)
    not_tar = tmp / "notes.tar"
    not_tar.write_text("not an archive")
    xz = tmp / "start.tar.xz"  # tarfile reads xz and bz2; an export never writes them
    xz.write_bytes(lzma.compress(machines["archive"].read_bytes()))
    for path in (not_tar, xz):
        with pytest.raises(ValueError, match="not a readable policy archive .*not a tar file"):
            import_policy(factory_b, var_b, path)
    _nothing_kept(machines)


def test_an_import_never_overwrites_a_folder_that_holds_something_else(
    machines: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The version registered at an --out folder that now holds another policy: a plain import
    refuses instead of replacing that folder; once it is moved away, the import restores it. A
    relative --out is registered as an absolute path."""
    var_b, factory_b, version = machines["var_b"], machines["factory_b"], machines["version"]
    monkeypatch.chdir(machines["tmp"])
    done = import_policy(factory_b, var_b, machines["archive"], Path("mine"))
    mine = machines["tmp"] / "mine"
    assert done.folder == mine and not done.reused_folder
    with session_scope(factory_b) as session:
        assert Path(find_version(session, version).path) == mine  # type: ignore[union-attr]
    other = build_tiny_policy(machines["tok"], seed=1)
    save_checkpoint(other, machines["tok"], mine)  # another policy's weights in that folder
    with pytest.raises(ValueError, match=r"does not hold version .* nothing was changed — move"):
        import_policy(factory_b, var_b, machines["archive"])
    assert load_policy_ref(str(mine), var_b, None).version == policy_version(other)
    mine.rename(machines["tmp"] / "moved")
    done = import_policy(factory_b, var_b, machines["archive"])
    assert (done.folder, done.reused_folder, done.registered) == (mine, False, False)
    assert load_policy_ref(str(mine), var_b, None).version == version
    with pytest.raises(ValueError, match="exists and does not hold .* choose another --out"):
        import_policy(factory_b, var_b, machines["archive"], machines["tmp"] / "moved")


def _nothing_kept(machines: dict[str, Any]) -> None:
    """Machine B holds no policy folder, no recipe entry and no registration of the version."""
    models = machines["var_b"] / "models"
    assert not models.exists() or not [p for p in models.iterdir() if p.name != "recipes"]
    assert recipe.local_start_versions(machines["var_b"]) == set()
    with session_scope(machines["factory_b"]) as session:
        assert find_version(session, machines["version"]) is None


def test_a_disk_without_room_is_told_before_anything_is_written(
    machines: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with 10 MiB free (the OS's answer replaced: no test fills a real disk) refuses
    the import and the export in one line each, and leaves nothing half written."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10 << 20))
    with pytest.raises(ValueError, match=r"start\.tar: unpacking \S+ needs [\d,]+ MiB and .* has "
                       r"10 MiB free \(keeping 64 MiB spare\) — free some space, or import "
                       r"with --out on another disk"):  # fmt: skip
        import_policy(machines["factory_b"], machines["var_b"], machines["archive"])
    _nothing_kept(machines)
    again = machines["tmp"] / "again.tar"
    with pytest.raises(ValueError, match=r"the archive of \w{12} needs .* choose --out on another"):
        export_policy(machines["factory_a"], machines["var_a"], machines["version"], again)
    assert not again.exists() and not list(machines["tmp"].glob(".again.tar*"))
    monkeypatch.undo()
    done = import_policy(machines["factory_b"], machines["var_b"], machines["archive"])
    assert done.registered and done.version == machines["version"]


def test_what_cannot_be_exported_says_why(tmp_path: Path, smol_tokenizer: Any) -> None:
    factory = _factory(f"sqlite:///{(tmp_path / 'c.db').as_posix()}")
    with pytest.raises(ValueError, match="default policy is not exported"):
        export_policy(factory, tmp_path, "default:SmolLM2-135M-Instruct", tmp_path / "d.tar")
    folder = save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer,
                             tmp_path / "tiny")  # fmt: skip
    with pytest.raises(ValueError, match="must end in .tar"):
        export_policy(factory, tmp_path, str(folder), tmp_path / "tiny.zip")
    (folder / "extra.py").write_text("print('hi')")
    with pytest.raises(ValueError, match=r"cannot carry safely: \['extra.py'\]"):
        export_policy(factory, tmp_path, str(folder), tmp_path / "tiny.tar")
    (folder / "extra.py").unlink()
    outside = tmp_path / "tokenizer-elsewhere.json"  # a linked file travels as its content
    (folder / "tokenizer.json").rename(outside)
    (folder / "tokenizer.json").symlink_to(outside)
    linked = export_policy(factory, tmp_path, str(folder), tmp_path / "linked.tar")
    with tarfile.open(linked.path) as tar:
        assert all(m.isfile() for m in tar.getmembers())
    factory_b = _factory(f"sqlite:///{(tmp_path / 'd.db').as_posix()}")
    carried = import_policy(factory_b, tmp_path / "b", linked.path)
    assert carried.version == linked.version
    shutil.rmtree(carried.folder)  # registered, its folder gone
    with pytest.raises(ValueError, match="is not there .* export it on the machine that holds"):
        export_policy(factory_b, tmp_path / "b", carried.version, tmp_path / "gone.tar")
    (folder / "manifest.json").unlink()
    with pytest.raises(ValueError, match="has no manifest.json"):
        export_policy(factory, tmp_path, str(folder), tmp_path / "tiny.tar")
    save_checkpoint(build_tiny_policy(smol_tokenizer, seed=0), smol_tokenizer, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\x00")  # same size, other bytes
    with pytest.raises(ArtifactError, match="does not match its sha256"):
        export_policy(factory, tmp_path, str(folder), tmp_path / "tiny.tar")
    assert not (tmp_path / "tiny.tar").exists()


def test_the_commands(machines: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`casi policy import` on the embedded defaults (machine B's var folder), the version in
    `casi report policies` with its maker, then `casi policy export` and an error."""
    var_b = machines["var_b"]
    for name in ("DATABASE_URL", "REDIS_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CASI_VAR_DIR", str(var_b))
    monkeypatch.setenv("COLUMNS", "250")
    get_settings.cache_clear()
    try:
        done = CliRunner().invoke(app, ["policy", "import", str(machines["archive"])])
        assert done.exit_code == 0, done.output
        version = machines["version"]
        assert f"imported warmstart version {version} into" in done.output
        assert f"warm-start recipe {KEY}: answered by {version}" in done.output
        done = CliRunner().invoke(app, ["report", "policies"])
        assert done.exit_code == 0, done.output
        assert "AMD family 25 model 17 (imported)" in done.output
        out = machines["tmp"] / "b.tar"
        done = CliRunner().invoke(app, ["policy", "export", version[:7], "--out", str(out)])
        assert done.exit_code == 0, done.output
        assert f"exported warmstart version {version} to {out}" in done.output
        assert f"made on {ZEN4}" in done.output
        done = CliRunner().invoke(app, ["policy", "import", str(machines["tmp"] / "none.tar")])
        assert done.exit_code != 0 and "no archive" in done.output
        assert "Traceback" not in done.output
    finally:
        get_settings.cache_clear()


def test_two_processes_importing_one_archive_take_turns(machines: dict[str, Any]) -> None:
    """Two `casi policy import` processes at once on one var folder (embedded SQLite): both
    succeed, the version is unpacked once and registered once."""
    import os
    import subprocess
    import sys

    var_b = machines["tmp"] / "both"
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env.update(CASI_VAR_DIR=str(var_b), COLUMNS="250")
    command = [sys.executable, "-m", "app.cli", "policy", "import", str(machines["archive"])]
    runs = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(2)]  # fmt: skip
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    said = " ".join(" ".join(o.split()) for o in outputs)
    assert said.count("checked and unpacked; registered;") == 1, outputs
    assert said.count("already there; already registered;") == 1, outputs
    version = machines["version"]
    assert [p.name for p in (var_b / "models").iterdir() if p.name.startswith("warmstart-")] == [
        f"warmstart-{version}"
    ]
    assert recipe.local_start_versions(var_b) == {version}


def test_a_protocol_run_takes_the_start_its_seeds_began_from(
    tmp_path: Path, smol_tokenizer: Any, slice_path: Path
) -> None:
    """`resolve_start`, as `casi experiment credit --protocol` calls it, on a machine holding its
    own start of the protocol's recipe and an imported one: the seeds that began from the
    imported start get it (and their cells will record its maker); new seeds get this
    machine's own."""
    from app.experiments.protocol import load_protocol
    from app.experiments.start import resolve_start
    from app.settings import Settings
    from evaluator.corpus import load_dataset
    from policy.warmstart import DEFAULT_WORDS
    from tests.experiments.test_cell import PROTOCOL

    base = save_checkpoint(build_tiny_policy(smol_tokenizer, seed=5), smol_tokenizer,
                           tmp_path / "base")  # fmt: skip
    text = PROTOCOL.replace("[start]\n", f'[start]\npolicy = "{base}"\nqueries = 2\n', 1)
    (tmp_path / "protocol.toml").write_text(text)
    protocol = load_protocol(tmp_path / "protocol.toml")
    examples = recipe.warmstart_examples(
        load_dataset(slice_path, splits=("train",)), 2, 2, 0, "titles", DEFAULT_WORDS
    )
    key = recipe.recipe_key(
        load_policy_ref(str(base), tmp_path).version, examples, 1, 2, 1e-4, 0, "short",
        "float32", *recipe.recipe_extra("titles", DEFAULT_WORDS, None),
    )  # fmt: skip
    var, var_a = tmp_path / "var", tmp_path / "a"
    factory = _factory(f"sqlite:///{tmp_path / 'var.db'}")
    factory_a = _factory(f"sqlite:///{tmp_path / 'a.db'}")
    own = _start(var, factory, smol_tokenizer, 1, "GenuineIntel family 6 model 167", key)
    made = _start(var_a, factory_a, smol_tokenizer, 2, ZEN4, key)
    export_policy(factory_a, var_a, made, tmp_path / "start.tar")
    assert import_policy(factory, var, tmp_path / "start.tar").kept == {key: own}
    settings = Settings(var_dir=var, dataset=slice_path)
    policy, start = resolve_start(protocol, settings, factory, {made})
    assert (policy.version, start.version, start.recipe) == (made, made, key)
    assert start.pin() == {"version": made, "recipe": key, "made_on": ZEN4}
    policy, start = resolve_start(protocol, settings, factory, set())
    assert (policy.version, start.imported) == (own, False)
    assert start.pin() == {"version": own, "recipe": key}
