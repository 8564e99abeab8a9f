import numpy as np
import pytest

from lhc.data import IndexedIterator, associative_recall, copy_task, row_rngs, stack_rows


def test_associative_recall_answers_are_the_paired_values():
    rng = np.random.default_rng(0)
    batch = associative_recall(rng, 16, num_pairs=6, num_queries=3, num_keys=10, num_values=7)
    tokens, targets, weights = batch["tokens"], batch["targets"], batch["weights"]
    assert tokens.shape == targets.shape == weights.shape == (16, 2 * (6 + 3) - 1)
    assert tokens.dtype == np.int32 and weights.dtype == np.float32
    full = np.concatenate([tokens, targets[:, -1:]], axis=1)
    for seq, w, tgt in zip(full, weights, targets):
        pairs = {int(seq[2 * i]): int(seq[2 * i + 1]) for i in range(6)}
        assert len(pairs) == 6  # distinct keys
        assert all(0 <= k < 10 for k in pairs) and all(10 <= v < 17 for v in pairs.values())
        answered = np.flatnonzero(w)
        assert len(answered) == 3
        for t in answered:
            # the weighted target follows a repeated key: it must be that key's value
            assert int(seq[t]) in pairs and int(tgt[t]) == pairs[int(seq[t])]


def test_copy_task_targets_copy_the_first_half():
    batch = copy_task(np.random.default_rng(1), 4, length=5, vocab_size=9)
    full = np.concatenate([batch["tokens"], batch["targets"][:, -1:]], axis=1)
    np.testing.assert_array_equal(full[:, :5], full[:, 6:])
    assert (full[:, 5] == 8).all()
    assert batch["weights"].sum(axis=1).tolist() == [5.0] * 4
    np.testing.assert_array_equal(batch["targets"][batch["weights"] > 0].reshape(4, 5), full[:, :5])


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_pairs"):
        associative_recall(
            np.random.default_rng(0), 1, num_pairs=5, num_queries=1, num_keys=4, num_values=3
        )
    with pytest.raises(ValueError, match="vocab_size"):
        copy_task(np.random.default_rng(0), 1, length=3, vocab_size=2)


def test_indexed_iterator_resumes_and_splits_rows_across_processes():
    def make(seed, index, rows):
        return stack_rows(
            lambda rng: {"x": rng.integers(0, 10**6, (1, 3))}, row_rngs(seed, index, rows)
        )

    first = IndexedIterator(make, seed=5, batch_size=4)
    seen = [next(first)["x"] for _ in range(5)]
    assert seen[0].shape == (4, 3)
    resumed = IndexedIterator(make, seed=5, batch_size=4)
    resumed.set_state({"index": 3, "seed": 5})
    np.testing.assert_array_equal(next(resumed)["x"], seen[3])
    # Two processes each build half of every global batch; together they equal one process.
    halves = [
        IndexedIterator(make, seed=5, batch_size=4, process_index=p, process_count=2)
        for p in range(2)
    ]
    for index in range(2):
        np.testing.assert_array_equal(np.concatenate([next(h)["x"] for h in halves]), seen[index])
    assert not np.array_equal(seen[0], seen[1])
    with pytest.raises(ValueError, match="seed 6"):
        IndexedIterator(make, seed=6, batch_size=4).set_state(first.get_state())
    with pytest.raises(ValueError, match="divisible by the number of processes"):
        IndexedIterator(make, seed=5, batch_size=3, process_count=2)
