"""Several documents packed in one row of a training batch, kept apart.

A packed row holds the tail of one document, whole short documents and the head of
another. ``Transformer(...)(tokens, positions, segment_ids=ids)`` with ``ids`` int32
``[B, T]`` (equal within a document, different across a boundary) lets each token
attend only to the tokens of its own document; the caller restarts ``positions`` at each
document's first token, so RoPE sees every document as if it were alone in its row
(``lhc.data.text_files`` builds such rows).

The separation is a mask on the scores in plain XLA (``attention_segments``): the
attention kernels take masks built from positions only.
"""

from __future__ import annotations

import jax
from flax import struct

from lhc.nn.attention import KVView
from lhc.nn.attention_ops import attention_segments


class PackedView(KVView):
    """This call's keys only, each query seeing those of its own document."""

    def attend(self, query, query_positions, *, impl, window, dtype, alibi_slopes=None):
        if impl != "xla":
            raise ValueError(
                f"segment_ids: packed documents attend through attention_impl='xla' (a "
                f"mask beside the positions), got attention_impl={impl!r}"
            )
        segment = (
            self.new_keys.astype(dtype),
            self.new_values.astype(dtype),
            self.new_positions,
            self.new_mask,
        )
        return attention_segments(
            query,
            [segment],
            query_positions,
            scale=query.shape[-1] ** -0.5,
            window=window,
            alibi_slopes=alibi_slopes,
        )

    def segments(self):
        return [(self.new_keys, self.new_values, self.new_positions, self.new_mask)]


@struct.dataclass
class PackedWriter:
    """The layer writer of a call without a cache whose rows pack several documents:
    nothing is held, nothing stored.

    Attributes:
        positions: int32 ``[B, T]``.
        segment_ids: int32 ``[B, T]``.
    """

    positions: jax.Array
    segment_ids: jax.Array

    def read(self, layers, layer, keys, values) -> PackedView:
        del layers, layer
        ids = self.segment_ids
        return PackedView(
            keys=keys[:, :0],
            values=values[:, :0],
            positions=self.positions[:, :0],
            new_keys=keys,
            new_values=values,
            new_positions=self.positions,
            new_mask=ids[:, :, None] == ids[:, None, :],
        )

    def write(self, layers, layer, keys, values, *, after):
        del layer, keys, values, after
        return layers
