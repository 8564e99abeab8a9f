"""Packed windows of local text files, checked against a brute-force walk."""

import numpy as np
import pytest

from lhc.data.text_files import TextFiles, positions_in_documents, text_file_paths


class Characters:
    """Each character its code point; bos 1, eos 2 (input to the code under test)."""

    bos_id, eos_id, add_bos_token = 1, 2, True

    def encode(self, text):
        return [ord(c) for c in text]


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("first document, long enough for a few windows " * 3)
    (tmp_path / "sub" / "b.txt").write_text("second\n\nthird part of b")
    (tmp_path / ".hidden").write_text("never read")
    return tmp_path


def test_a_folder_gives_its_files_in_order_and_skips_hidden_ones(folder):
    files = text_file_paths(str(folder))
    assert [f[len(str(folder)) + 1 :] for f in files] == ["a.txt", "sub/b.txt"]
    with pytest.raises(FileNotFoundError, match="data.paths: no file or folder at"):
        text_file_paths(f"{folder / 'a.txt'},{folder / 'missing'}")


def test_windows_keep_documents_apart(folder):
    length = 16
    data = TextFiles(str(folder), Characters(), length, eval_fraction=0.1, separator="\n\n")
    # Brute force: the documents as the tokenizer gives them, each cut in two.
    texts = [(folder / "a.txt").read_text(), "second", "third part of b"]
    train_stream, held_stream = [], []
    for doc, text in enumerate(texts):
        ids = [1, *map(ord, text), 2]
        cut = len(ids) - round(len(ids) * 0.1)
        train_stream += [(t, doc) for t in ids[:cut]]
        held_stream += [(t, doc) for t in ids[cut:]]
    for stream, part in ((train_stream, data.train), (held_stream, data.held_out)):
        assert part.num_windows == (len(stream) - 1) // length
        for w in range(part.num_windows):
            got = {k: v[0] for k, v in part.windows([w]).items()}
            window = stream[w * length : w * length + length + 1]
            for t in range(length):
                token, doc = window[t]
                first = min(i for i in range(t + 1) if window[i][1] == doc)
                assert got["tokens"][t] == token
                assert got["targets"][t] == window[t + 1][0]
                assert got["positions"][t] == t - first
                assert got["weights"][t] == float(window[t + 1][1] == doc)
                for s in range(length):
                    assert (got["segment_ids"][t] == got["segment_ids"][s]) == (doc == window[s][1])


def test_each_epoch_visits_every_window_once_in_a_seeded_order(folder):
    data = TextFiles(str(folder), Characters(), 8, eval_fraction=0.0)
    n = data.train.num_windows
    batch = 2
    seen = [
        data.train_batch(seed=3, index=i, rows=range(batch), batch_size=batch)["tokens"]
        for i in range(n)  # two epochs
    ]
    rows = np.concatenate(seen)
    first = {tuple(r) for r in rows[:n]}
    assert len(first) == n and {tuple(r) for r in rows[n : 2 * n]} == first
    again = TextFiles(str(folder), Characters(), 8, eval_fraction=0.0)
    np.testing.assert_array_equal(
        again.train_batch(3, 5, range(1, 2), batch)["tokens"][0], rows[5 * batch + 1]
    )
    other = [data.train_batch(4, i, range(batch), batch)["tokens"] for i in range(n // batch)]
    assert not np.array_equal(np.concatenate(other), rows[: len(other) * batch])
    with pytest.raises(ValueError, match="data.eval_fraction: the held-out part"):
        data.eval_batch(0, range(1), 1)


def test_too_little_text_is_refused(folder):
    with pytest.raises(ValueError, match="fewer than one window"):
        TextFiles(str(folder / "sub"), Characters(), 1000)


def test_positions_restart_at_each_document():
    ids = np.array([4, 4, 5, 5, 5, 6])
    np.testing.assert_array_equal(positions_in_documents(ids), [0, 1, 0, 1, 2, 0])
