"""The trust-region loss stack (docs/methods.md §3).

Build once, call per micro-batch:

    from policy.losses import LossBatch, LossStack, load_preset
    stack = LossStack(load_preset("casi"))
    loss, metrics = stack(LossBatch(logp=..., old_logp=..., sampler_logp=..., advantages=...,
                                    response_mask=..., global_tokens=..., global_seqs=...))

Read `stack.py` first; terms live one family per module and register themselves by name, with
their config section, coefficient and needs (`registry.py`).
"""

from policy.losses import (  # noqa: F401  (import registers the terms)
    critic,
    dppo,
    drpo,
    entropy,
    importance,
    kl,
    masks,
    ppo,
    staleness,
)
from policy.losses.aggregate import AGGREGATION_MODES, aggregate
from policy.losses.batch import LossBatch, LossContext
from policy.losses.config import (
    ClipConfig,
    CriticConfig,
    DPPOConfig,
    DRPOConfig,
    DualKLConfig,
    GSPOConfig,
    ISConfig,
    KLConfig,
    SeqMaskConfig,
    StackConfig,
    StalenessConfig,
)
from policy.losses.critic import anchor_mask, gae
from policy.losses.kl import DualKLController, kl_penalty
from policy.losses.ops import LOG_RATIO_CLAMP, clamp_log_ratio
from policy.losses.presets import available_presets, load_preset
from policy.losses.registry import (
    Needs,
    TermOutput,
    get_term,
    register_term,
    registered_terms,
)
from policy.losses.stack import LossStack

__all__ = [
    "AGGREGATION_MODES",
    "LOG_RATIO_CLAMP",
    "ClipConfig",
    "CriticConfig",
    "DPPOConfig",
    "DRPOConfig",
    "DualKLConfig",
    "DualKLController",
    "GSPOConfig",
    "ISConfig",
    "KLConfig",
    "LossBatch",
    "LossContext",
    "LossStack",
    "Needs",
    "SeqMaskConfig",
    "StackConfig",
    "StalenessConfig",
    "TermOutput",
    "aggregate",
    "anchor_mask",
    "available_presets",
    "clamp_log_ratio",
    "gae",
    "get_term",
    "kl_penalty",
    "load_preset",
    "register_term",
    "registered_terms",
]
