"""A deterministic text corpus for the demo: sentences from a small probabilistic grammar.

Nothing is downloaded: the text is generated from a seed, so every run (and every machine) trains
on the same characters. The grammar has enough structure (agreement, nesting, punctuation) that a
tiny character-level model learns it well below the entropy of the character distribution, and
the FP8 and high-precision loss curves can be compared meaningfully.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

__all__ = ["CharCorpus", "generate_text"]

_GRAMMAR: Dict[str, Sequence[Tuple[float, Sequence[str]]]] = {
    "S": [(0.55, ("NP_s", "VP_s", ".")), (0.30, ("NP_p", "VP_p", ".")), (0.15, ("S_inner", ",", "and", "S_inner", "."))],
    "S_inner": [(0.5, ("NP_s", "VP_s")), (0.5, ("NP_p", "VP_p"))],
    "NP_s": [(0.6, ("Det_s", "Adj?", "N_s")), (0.25, ("Det_s", "N_s", "PP")), (0.15, ("Name",))],
    "NP_p": [(0.7, ("Det_p", "Adj?", "N_p")), (0.3, ("Det_p", "N_p", "PP"))],
    "PP": [(1.0, ("P", "Det_s", "N_s"))],
    "VP_s": [(0.5, ("V_s", "NP_s")), (0.3, ("V_s", "NP_p")), (0.2, ("Vi_s",))],
    "VP_p": [(0.5, ("V_p", "NP_s")), (0.3, ("V_p", "NP_p")), (0.2, ("Vi_p",))],
    "Adj?": [(0.5, ()), (0.5, ("Adj",))],
    "Det_s": [(0.5, ("the",)), (0.3, ("a",)), (0.2, ("every",))],
    "Det_p": [(0.6, ("the",)), (0.2, ("some",)), (0.2, ("many",))],
    "N_s": [(1.0, (w,)) for w in ("cat", "dog", "bird", "engine", "model", "river", "teacher", "robot")],
    "N_p": [(1.0, (w,)) for w in ("cats", "dogs", "birds", "engines", "models", "rivers", "teachers", "robots")],
    "Name": [(1.0, (w,)) for w in ("alice", "bob", "carol", "dave")],
    "Adj": [(1.0, (w,)) for w in ("small", "quick", "green", "quiet", "clever", "old")],
    "P": [(1.0, (w,)) for w in ("near", "under", "behind", "with")],
    "V_s": [(1.0, (w,)) for w in ("sees", "trains", "follows", "likes", "builds")],
    "V_p": [(1.0, (w,)) for w in ("see", "train", "follow", "like", "build")],
    "Vi_s": [(1.0, (w,)) for w in ("sleeps", "runs", "waits")],
    "Vi_p": [(1.0, (w,)) for w in ("sleep", "run", "wait")],
}


def _expand(symbol: str, rng: random.Random, out: List[str]) -> None:
    rules = _GRAMMAR.get(symbol)
    if rules is None:
        out.append(symbol)
        return
    weights = [w for w, _ in rules]
    _, body = rng.choices(rules, weights=weights, k=1)[0]
    for part in body:
        _expand(part, rng, out)


def generate_text(num_chars: int, seed: int) -> str:
    """At least ``num_chars`` characters of grammar sentences, the same for the same seed."""
    rng = random.Random(seed)
    pieces: List[str] = []
    length = 0
    while length < num_chars:
        words: List[str] = []
        _expand("S", rng, words)
        sentence = " ".join(words).replace(" .", ".").replace(" ,", ",") + " "
        pieces.append(sentence)
        length += len(sentence)
    return "".join(pieces)


@dataclass(frozen=True)
class CharCorpus:
    """Character-level train / validation token streams over a fixed alphabet.

    Attributes:
        train: token ids of the training text.
        valid: token ids of the validation text (generated from another seed).
        alphabet: the characters; token id i is alphabet[i].
    """

    train: List[int]
    valid: List[int]
    alphabet: str

    @classmethod
    def build(cls, train_chars: int, valid_chars: int, seed: int) -> "CharCorpus":
        """Generate both splits; the alphabet is the sorted set of characters the grammar can emit."""
        train_text = generate_text(train_chars, seed)
        valid_text = generate_text(valid_chars, seed + 1_000_003)
        alphabet = "".join(sorted(set(" .,") | {c for rules in _GRAMMAR.values() for _,
                                                body in rules for w in body if w not in _GRAMMAR for c in w}))
        index = {c: i for i, c in enumerate(alphabet)}
        return cls([index[c] for c in train_text], [index[c] for c in valid_text], alphabet)

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens."""
        return len(self.alphabet)
