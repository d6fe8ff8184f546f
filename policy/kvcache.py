"""The decode loop's KV cache: preallocated, so a decoded token is written in place.

Hugging Face's `DynamicCache` grows by ``torch.cat`` at every token: each decoded token copies
the whole cache of every layer (measured in a profile of the constrained sampler, 32 rows of
SmolLM2-135M on one AVX-512 core: `aten::cat` was the largest op after the matmuls). A
`RoomyLayer` keeps its keys and values in a buffer with room for ``room`` more positions and
hands the attention a view of the filled part: the same tensors, the same kernels, the same
values (bitwise, in a test), without the copy. Rows that leave the batch (finished responses,
`policy.sampler.decode`) are dropped by `batch_select_indices`, which copies only the filled
part of the rows kept.

`decode_cache` builds one; where the model's cache has layers of another kind (sliding-window,
linear attention), it falls back to the plain cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer


def new_cache(model: nn.Module) -> Any:
    """The model's plain `DynamicCache` (grows by concatenation)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=getattr(model, "config", None))
    except TypeError:  # older transformers
        return DynamicCache()


def decode_cache(model: nn.Module, room: int) -> Any:
    """A cache whose layers have room for ``room`` positions past the prompt (`RoomyLayer`),
    or the plain cache where that cannot be built."""
    cache = new_cache(model)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(x) is not DynamicLayer for x in layers):
        return cache
    cache.layers = [RoomyLayer(room) for _ in layers]
    return cache


class RoomyLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """A `DynamicLayer` whose keys / values (B, H, n, D) are views of (B, H, n + room, D)
    buffers; it grows (by ``room`` again) only if a write would overflow them."""

    def __init__(self, room: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.room = max(1, int(room))
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._n = 0

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self._k is None or self._v is None or self._n + q > self._k.shape[-2]:
            self._rebuild(None, self._n + q + self.room, like=(key_states, value_states))
        assert self._k is not None and self._v is not None
        self._k[:, :, self._n : self._n + q].copy_(key_states)
        self._v[:, :, self._n : self._n + q].copy_(value_states)
        self._n += q
        return self._views()

    def _views(self) -> tuple[Tensor, Tensor]:
        assert self._k is not None and self._v is not None
        keys, values = self._k[:, :, : self._n], self._v[:, :, : self._n]
        self.keys, self.values = keys, values
        return keys, values

    def _rebuild(
        self, rows: Tensor | None, capacity: int, like: tuple[Tensor, Tensor] | None = None
    ) -> None:
        """New buffers of ``capacity`` positions holding the filled part of ``rows`` (all
        rows when None); shaped ``like`` the first states when there is nothing yet."""
        src = (self._k, self._v) if self._k is not None and self._v is not None else like
        assert src is not None
        new = []
        for old in src:
            b = old.shape[0] if rows is None else len(rows)
            buf = old.new_empty((b, old.shape[1], capacity, old.shape[3]))
            if self._k is not None and self._n:
                part = old[:, :, : self._n]
                buf[:, :, : self._n].copy_(part if rows is None else part[rows])
            new.append(buf)
        self._k, self._v = new

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            rows = torch.arange(self._k.shape[0], device=self._k.device)
            self._rebuild(rows.repeat_interleave(repeats), self._k.shape[-2])
            self._views()

    def batch_select_indices(self, indices: Tensor) -> None:
        if self._k is not None:
            self._rebuild(indices.to(self._k.device), self._k.shape[-2])
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0 or self._k is None:
            super().crop(tokens_to_remove)  # the legacy positive form raises there
            return
        self._n = max(0, self._n + tokens_to_remove)
        self._views()

    def reset(self) -> None:
        self._k = self._v = None
        self._n = 0
        super().reset()
