"""Data sources shared by several methods: generated tasks, tfds text windows and
checkpointable iterators (``consecutive_chunks`` serves long sequences chunk by chunk
for truncated backpropagation through time)."""

from lhc.data.iterators import (
    DataIterator,
    IndexedIterator,
    consecutive_chunks,
    row_rngs,
    stack_rows,
)
from lhc.data.synthetic import associative_recall, copy_task
from lhc.data.text import TfdsText

__all__ = [
    "DataIterator",
    "IndexedIterator",
    "consecutive_chunks",
    "row_rngs",
    "stack_rows",
    "associative_recall",
    "copy_task",
    "TfdsText",
]
