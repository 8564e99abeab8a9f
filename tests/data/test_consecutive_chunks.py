"""consecutive_chunks: long sequences served chunk by chunk, checkpointable by index."""

import numpy as np
import pytest

from lhc.data import IndexedIterator, consecutive_chunks


def make_sequence(rng, length):
    tokens = rng.integers(0, 1000, size=length + 1)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "weights": rng.random(length)}


def iterator(start=0, process_index=0, process_count=1):
    return IndexedIterator(
        consecutive_chunks(make_sequence, chunk_length=5, num_chunks=3),
        seed=7,
        batch_size=4,
        process_index=process_index,
        process_count=process_count,
        start=start,
    )


def test_chunks_of_a_group_reassemble_each_rows_sequence():
    it = iterator()
    batches = [next(it) for _ in range(6)]  # two groups of 3 chunks
    for group in range(2):
        chunks = batches[3 * group : 3 * group + 3]
        assert [bool(b["reset"].all()) for b in chunks] == [True, False, False]
        assert not any(b["reset"].any() for b in chunks[1:])
        got = {k: np.concatenate([b[k] for b in chunks], axis=1) for k in chunks[0] if k != "reset"}
        for row in range(4):
            # Row r of group g: the sequence drawn from (seed, g, r), written here directly.
            want = make_sequence(np.random.default_rng([7, group, row]), 15)
            for key in ("inputs", "targets", "weights"):
                np.testing.assert_array_equal(got[key][row], want[key])
            np.testing.assert_array_equal(got["positions"][row], np.arange(15))
    assert not np.array_equal(batches[0]["inputs"], batches[3]["inputs"])  # groups differ


def test_resuming_and_process_split_give_the_same_batches():
    straight = iterator()
    for _ in range(4):
        next(straight)
    state = straight.get_state()
    resumed = iterator()
    resumed.set_state(state)
    for _ in range(3):  # mid-group (chunk 1 of group 1) onwards
        a, b = next(straight), next(resumed)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    whole = next(iterator(start=5))
    halves = [next(iterator(start=5, process_index=p, process_count=2)) for p in range(2)]
    np.testing.assert_array_equal(np.concatenate([h["inputs"] for h in halves]), whole["inputs"])


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="chunk_length must be a positive int, got 0"):
        consecutive_chunks(make_sequence, chunk_length=0, num_chunks=2)
    short = consecutive_chunks(
        lambda rng, n: {"tokens": np.zeros(n), "weights": np.zeros(n - 1)},
        chunk_length=4,
        num_chunks=2,
    )
    with pytest.raises(ValueError, match=r"arrays of 8 entries .* 'weights' of shape \(7,\)"):
        short(0, 0, range(2))
    bare = consecutive_chunks(lambda rng, n: np.zeros(n), chunk_length=4, num_chunks=2)
    with pytest.raises(ValueError, match="must return a dict of per-position arrays, got ndarray"):
        bare(0, 0, range(2))
