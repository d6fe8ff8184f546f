"""The trunk: the hidden state entering decoder layer L, recorded while the sampler decodes.

A run that trains only the layers from L up (``params = top``) has the sampler keep, for every
row, the input of layer L at each prompt position and at each response position but the last
(`policy.sampler.Generated.trunk`); the teacher-forced forward then runs only the layers above
on it (`policy.forward.response_log_softmax(trunk=...)`) instead of recomputing the frozen ones.

Read `capture_layer_input` (a forward hook held around the prefill and the decode loop), then
`row_trunks` (each row's trunk from what the hook saw).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from policy.params import decoder_layers


@contextlib.contextmanager
def capture_layer_input(model: nn.Module, layer: int | None) -> Iterator[list[Tensor]]:
    """Record the output of decoder layer ``layer - 1`` (= the input of layer ``layer``) at
    every forward inside the block: the prefill, then one (B, 1, H) per decoded token."""
    captured: list[Tensor] = []
    if layer is None:
        yield captured
        return
    layers = decoder_layers(model)
    if not 1 <= layer < len(layers):
        raise ValueError(f"capture_layer must be in 1..{len(layers) - 1}, got {layer}")

    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = layers[layer - 1].register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()


def row_trunks(
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int],
    repeat: int,
    captured: list[Tensor],
    fed: list[Tensor],
) -> list[Tensor]:
    """Each row's trunk (p + T - 1, H), on the CPU: its prompt positions from the prefill
    (left-padded, one row per distinct prompt, each repeated ``repeat`` times), then the hidden
    state of every response token that was fed back (``fed[s]``: the rows of decode forward s,
    ``captured[1 + s]`` their states). ``lengths``: each row's response length T."""
    prefill, steps = captured[0], captured[1:]
    decoded = prefill.new_zeros((len(lengths), len(steps), prefill.shape[-1]))  # (B, S, H)
    for s, (rows, state) in enumerate(zip(fed, steps, strict=True)):
        decoded[rows, s] = state[:, -1]
    width = prefill.shape[1]
    trunks = []
    for row, t in enumerate(lengths):
        prompt_part = prefill[row // repeat, width - len(prompts[row]) :]
        trunks.append(torch.cat([prompt_part, decoded[row, : t - 1]]).cpu())
    return trunks
