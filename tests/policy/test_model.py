"""Model loading (local folder round trip, errors, default conversion), versions, warm start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from numpy.testing import assert_allclose

from policy.model import (
    build_tiny_policy,
    load_policy,
    policy_version,
    resolve_default_gguf,
    save_checkpoint,
)
from policy.parse import parse_actions
from policy.warmstart import (
    IGNORE_INDEX,
    encode_example,
    keywords,
    make_warmstart_examples,
    warmstart,
)


def test_tiny_policy_is_small_seeded_and_in_eval(smol_tokenizer: Any) -> None:
    a = build_tiny_policy(smol_tokenizer, seed=3)
    b = build_tiny_policy(smol_tokenizer, seed=3)
    c = build_tiny_policy(smol_tokenizer, seed=4)
    assert not a.training
    assert 1e6 < sum(p.numel() for p in a.parameters()) < 1e7
    assert a.config.vocab_size == len(smol_tokenizer)
    assert policy_version(a) == policy_version(b) != policy_version(c)
    assert len(policy_version(a)) == 12


def test_version_changes_with_any_weight(smol_tokenizer: Any) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    before = policy_version(model)
    with torch.no_grad():
        model.model.norm.weight[0] += 1e-3
    assert policy_version(model) != before


def test_save_and_load_round_trip(tmp_path: Path, smol_tokenizer: Any) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=1)
    folder = save_checkpoint(model, smol_tokenizer, tmp_path / "ckpt")
    assert not list(tmp_path.glob(".ckpt.tmp-*"))  # atomic: no leftovers
    loaded, tok = load_policy(str(folder), var_dir=tmp_path / "var", progress=False)
    assert not loaded.training and policy_version(loaded) == policy_version(model)
    ids = torch.tensor([smol_tokenizer("1. vitamin d")["input_ids"]])
    with torch.no_grad():
        assert_allclose(loaded(ids).logits, model(ids).logits, atol=1e-6, rtol=0)
    assert tok("über 中文")["input_ids"] == smol_tokenizer("über 中文")["input_ids"]
    save_checkpoint(model, smol_tokenizer, folder)  # overwriting an existing checkpoint works


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_policy(str(tmp_path / "nope"), var_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(str(tmp_path / "empty"), var_dir=tmp_path)


def test_default_gguf_is_found() -> None:
    path = resolve_default_gguf()
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6


@pytest.mark.slow
@pytest.mark.integration
def test_default_conversion_round_trip(tmp_path: Path) -> None:
    """First load converts the GGUF (~20-40 s); the second reloads the same weights fast."""
    model, tok = load_policy(None, var_dir=tmp_path, progress=False)
    assert (tmp_path / "models" / "smollm2-135m-instruct" / "model.safetensors").exists()
    again, _ = load_policy(None, var_dir=tmp_path, progress=False)
    assert policy_version(model) == policy_version(again)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.eos_token == "<|im_end|>"


def test_keywords_drop_stopwords() -> None:
    assert (
        keywords("The risk of cancer is reduced by Vitamin D.") == "risk cancer reduced vitamin d"
    )


def test_warmstart_examples_parse_ok(smol_tokenizer: Any) -> None:
    items = [
        ("Vitamin D reduces the risk of cancer.", ["Vitamin D and cancer: a meta-analysis"]),
        ("p53 is mutated in most tumours.", []),
        ("ß-cells über", ["Title one", "Title two", "Title three"]),
    ]
    examples = make_warmstart_examples(items, n_actions=4, seed=0)
    assert make_warmstart_examples(items, n_actions=4, seed=0) == examples
    for ex in examples:
        ids = list(smol_tokenizer(ex.answer, add_special_tokens=False)["input_ids"]) + [
            smol_tokenizer.eos_token_id
        ]
        parsed = parse_actions(ids, smol_tokenizer, 4)
        assert parsed.status == "ok" and not parsed.has_duplicates, ex.answer
    assert examples[0].answer.startswith("1. Vitamin D reduces the risk of cancer\n")


def test_warmstart_masks_prompt_and_lowers_loss(smol_tokenizer: Any) -> None:
    model = build_tiny_policy(smol_tokenizer, seed=0)
    examples = make_warmstart_examples(
        [("Vitamin D reduces cancer risk.", ["Vitamin D and cancer"])] * 4, 3
    )
    ids, labels = encode_example(smol_tokenizer, examples[0], max_length=512)
    answer_len = sum(label != IGNORE_INDEX for label in labels)
    assert labels[: len(ids) - answer_len] == [IGNORE_INDEX] * (len(ids) - answer_len)
    assert ids[-1] == labels[-1] == smol_tokenizer.eos_token_id
    seen: list[int] = []
    metrics = warmstart(
        model,
        smol_tokenizer,
        examples,
        epochs=6,
        max_steps=12,
        lr=1e-2,
        batch_size=2,
        progress=lambda step, total, loss: seen.append(step),
    )
    assert metrics.steps == 12 and seen == list(range(1, 13)) and len(metrics.losses) == 12
    assert metrics.truncated == 0
    cut = warmstart(model, smol_tokenizer, examples, max_steps=1, max_length=len(ids) - 1)
    assert cut.truncated == len(examples)  # each lost its end of turn, and says so
    assert metrics.tokens == 12 * 2 * answer_len
    assert metrics.losses[-1] < 0.5 * metrics.losses[0]
    assert not model.training


def test_warmstart_top_layers_trains_only_those(smol_tokenizer: Any) -> None:
    """--top-layers N: only the top N decoder layers and the final norm move; the loss falls;
    every weight is trainable again afterwards (the caller's model keeps its flags)."""
    model = build_tiny_policy(smol_tokenizer, seed=0, layers=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    examples = make_warmstart_examples(
        [("Vitamin D reduces cancer risk.", ["Vitamin D and cancer"])] * 4, 3
    )
    metrics = warmstart(
        model, smol_tokenizer, examples, epochs=6, max_steps=8, lr=1e-2, batch_size=2,
        top_layers=1,
    )  # fmt: skip
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(n.startswith(("model.layers.2.", "model.norm.")) for n in moved)
    assert any(n.startswith("model.layers.2.") for n in moved) and "model.norm.weight" in moved
    assert metrics.losses[-1] < metrics.losses[0]
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="top_layers must be in 1..3"):
        warmstart(model, smol_tokenizer, examples, max_steps=1, top_layers=4)
