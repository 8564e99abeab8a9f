"""Haystacks: shuffled book snippets, filtered, tokenized by line; needles placed by depth.

* ``clean_lines``: whitespace collapsed, short lines dropped.
* ``shuffled_haystack``: random snippets of user text files (each at least
  ``snippet_chars`` characters of consecutive lines, chapter headings skipped) until
  ``num_lines`` lines, as the official haystacks were made.
* ``filter_lines``: drops lines that literally mention a keyword (a needle's or a
  question's), so the only match for a question is the needle; ``names_absent`` keeps
  the candidate names that the haystack never mentions.
* ``Haystack``: the lines tokenized one by one with the evaluated model's tokenizer, so
  that a context of exactly L tokens and a needle at a given token depth are exact.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import numpy as np

HEADING = re.compile(r"^(chapter|book|part|volume)\b|^[ivxlcdm]+\.?$|^\d+\.?$", re.IGNORECASE)


def clean_lines(text: str, *, min_chars: int = 10) -> list[str]:
    """The text's lines, whitespace collapsed, those under ``min_chars`` characters dropped."""
    lines = (" ".join(line.split()) for line in text.splitlines())
    return [line for line in lines if len(line) >= min_chars]


def _read(paths: Sequence[str | os.PathLike]) -> list[list[str]]:
    books = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"haystack paths: {os.fspath(path)!r} is not a file")
        with open(path, encoding="utf-8") as handle:
            lines = clean_lines(handle.read())
        if not lines:
            raise ValueError(f"haystack paths: {os.fspath(path)!r} has no line of text")
        books.append(lines)
    if not books:
        raise ValueError("haystack paths: expected at least one text file")
    return books


def shuffled_haystack(
    paths: Sequence[str | os.PathLike],
    *,
    num_lines: int = 2000,
    snippet_chars: int = 1000,
    seed: int = 42,
) -> list[str]:
    """``num_lines`` lines made of random snippets of the books at ``paths``.

    Each snippet starts at a random line of a random book and takes consecutive lines
    (wrapping around the book's end, headings skipped) until it holds ``snippet_chars``
    characters.
    """
    books = _read(paths)
    rng = np.random.default_rng(seed)
    out: list[str] = []
    while len(out) < num_lines:
        book = books[rng.integers(len(books))]
        line, chars = int(rng.integers(len(book))), 0
        for _ in range(len(book)):
            text = book[line % len(book)]
            line += 1
            if HEADING.match(text):
                continue
            out.append(text)
            chars += len(text)
            if chars >= snippet_chars or len(out) == num_lines:
                break
        else:
            if chars == 0:
                raise ValueError("haystack paths: the books hold only headings")
    return out


def _keyword_pattern(keywords: Sequence[str]) -> re.Pattern | None:
    keywords = sorted({k.strip() for k in keywords if k.strip()}, key=len, reverse=True)
    if not keywords:
        return None
    return re.compile(r"\b(" + "|".join(map(re.escape, keywords)) + r")\b", re.IGNORECASE)


def filter_lines(lines: Sequence[str], keywords: Sequence[str]) -> tuple[list[str], int]:
    """The lines that mention none of ``keywords`` (whole words, any case), and how many
    were dropped."""
    pattern = _keyword_pattern(keywords)
    if pattern is None:
        return list(lines), 0
    kept = [line for line in lines if not pattern.search(line)]
    return kept, len(lines) - len(kept)


def names_absent(names: Sequence[str], lines: Sequence[str]) -> tuple[str, ...]:
    """The names never mentioned in ``lines`` (whole words, exact case)."""
    text = "\n".join(lines)
    return tuple(n for n in names if not re.search(r"\b" + re.escape(n) + r"\b", text))


@dataclasses.dataclass(frozen=True)
class Placement:
    """A context of ``len(tokens)`` tokens: haystack lines with one needle line.

    ``needle_start`` is the index of the needle's first token; ``depth`` the requested
    depth; the needle begins at the first line start at or after ``round(depth * H)``
    haystack tokens (H = haystack tokens in the context); past the last line start, at
    the end if the context ends with a whole line, else before the cut last line.
    """

    tokens: list[int]
    needle_start: int
    needle_len: int
    depth: float


class Haystack:
    """Lines tokenized with one tokenizer (each line ends with a newline).

    Args:
        lines: the haystack's lines.
        tokenizer: anything with ``encode(str) -> list[int]`` (the evaluated model's).
        name: a label for results.
    """

    def __init__(self, lines: Sequence[str], tokenizer, name: str = "haystack"):
        if not lines:
            raise ValueError(f"haystack {name!r}: no lines")
        self.name = name
        self.lines = list(lines)
        self.tokenizer = tokenizer
        self.line_tokens = [tokenizer.encode(line + "\n") for line in self.lines]
        self.num_tokens = sum(len(t) for t in self.line_tokens)
        self._absent: dict[tuple[str, ...], tuple[str, ...]] = {}

    def absent(self, names: Sequence[str]) -> tuple[str, ...]:
        """``names_absent(names, self.lines)``, computed once per set of names."""
        names = tuple(names)
        if names not in self._absent:
            self._absent[names] = names_absent(names, self.lines)
        return self._absent[names]

    def window(self, num_tokens: int) -> tuple[list[int], list[int]]:
        """The first ``num_tokens`` tokens (the last line cut), and the token offsets at
        which its lines start."""
        if num_tokens > self.num_tokens:
            raise ValueError(
                f"haystack {self.name!r} holds {self.num_tokens} tokens, fewer than the "
                f"{num_tokens} a context needs; give it more lines"
            )
        tokens, starts = [], []
        for line in self.line_tokens:
            if len(tokens) >= num_tokens:
                break
            starts.append(len(tokens))
            tokens.extend(line)
        return tokens[:num_tokens], starts

    def insert(
        self, lines: Sequence[tuple[float, str]], *, length: int
    ) -> tuple[list[int], list[int]]:
        """A context of exactly ``length`` tokens with each ``(depth, text)`` of ``lines``
        as a line of its own at that depth; and where each inserted line starts.

        A line goes to the first line start at or after ``round(depth * H)`` haystack
        tokens (H = haystack tokens in the context); past the last line start, at the end
        if the context ends with a whole line, else before the cut last line. Lines at the
        same point keep their order.

        Raises:
            ValueError: a depth outside [0, 1]; lines that leave no room for haystack.
        """
        for depth, _ in lines:
            if not 0.0 <= depth <= 1.0:
                raise ValueError(f"depth must lie in [0, 1], got {depth}")
        inserts = [(depth, self.tokenizer.encode(text + "\n")) for depth, text in lines]
        budget = length - sum(len(ids) for _, ids in inserts)
        if budget < 1:
            raise ValueError(f"length {length} leaves no haystack tokens around the inserted lines")
        tokens, starts = self.window(budget)
        # Insertion points (haystack token offsets) are line starts, and the end when the
        # window ends with a whole line: an inserted line never joins a cut line.
        whole = sum(len(t) for t in self.line_tokens[: len(starts)]) == budget
        points = []
        for d, _ in inserts:
            target = round(d * budget)
            points.append(next((s for s in starts if s >= target), budget if whole else starts[-1]))
        order = sorted(range(len(inserts)), key=lambda i: (points[i], i))
        out, previous, where = [], 0, [0] * len(inserts)
        for i in order:
            out.extend(tokens[previous : points[i]])
            previous = points[i]
            where[i] = len(out)
            out.extend(inserts[i][1])
        out.extend(tokens[previous:])
        return out, where

    def place(
        self,
        needle: str,
        *,
        length: int,
        depth: float,
        distractor: str | None = None,
        distractor_depth: float | None = None,
    ) -> Placement:
        """A context of exactly ``length`` tokens with ``needle`` as a line of its own at
        ``depth`` (and ``distractor`` at ``distractor_depth``, if given; see ``insert``).

        Raises:
            ValueError: ``depth`` outside [0, 1]; a needle that leaves no room for haystack.
        """
        lines = [(depth, needle)]
        if distractor is not None:
            if distractor_depth is None:
                raise ValueError("a distractor needs distractor_depth")
            lines.append((distractor_depth, distractor))
        elif distractor_depth is not None and not 0.0 <= distractor_depth <= 1.0:
            raise ValueError(f"distractor_depth must lie in [0, 1], got {distractor_depth}")
        tokens, where = self.insert(lines, length=length)
        needle_len = len(self.tokenizer.encode(needle + "\n"))
        return Placement(tokens, where[0], needle_len, depth)
