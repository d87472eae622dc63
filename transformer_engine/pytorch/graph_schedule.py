"""The order in which ``make_graphed_callables`` captures forward and backward graphs.

All graphs share one memory pool, so they are captured in the order they will replay. By default
that is one training step: the forward of callables 0 .. n-1, then the backward of n-1 .. 0.

Interleaved pipeline parallelism (Megatron-Core; NVIDIA TE's ``_order`` argument): the callables are
layers grouped into C model chunks of ``num_layers_per_chunk`` layers each (default: an equal split),
run for M micro-batches. ``order`` lists the chunk passes as the pipeline schedule runs them: +c is
the forward of chunk c (1-based) for its next micro-batch, -c the backward of its oldest pending one;
each chunk appears M times with each sign, so len(order) = 2 C M. Each (layer, micro-batch) pair is
an *entry* with its own sample arguments and graphs, numbered

    entry(c, m, l) = P_c M + m L_c + l      (P_c: layers of the chunks before c, L_c: layers of chunk c)

which is also the order of ``sample_args`` and of the callables returned. A chunk's forward runs its
layers first to last, its backward last to first.

Example (two chunks of one layer, two micro-batches):

    >>> s = interleaved_schedule([1, 2, 1, 2, -2, -1, -2, -1], None, num_callables=2)
    >>> s.callable_of, [("F" if f else "B") + str(e) for f, e in s.steps]
    ((0, 0, 1, 1), ['F0', 'F2', 'F1', 'F3', 'B2', 'B0', 'B3', 'B1'])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

__all__ = ["Schedule", "default_schedule", "interleaved_schedule"]


@dataclass(frozen=True)
class Schedule:
    """Attributes:
    callable_of: the callable (an index into the callables given) that each entry runs.
    steps: (forward?, entry) in capture order; every entry has one forward and one backward step.
    """

    callable_of: Tuple[int, ...]
    steps: Tuple[Tuple[bool, int], ...]


def default_schedule(num_callables: int) -> Schedule:
    """One entry per callable: forwards in order, then backwards in reverse."""
    entries = range(num_callables)
    return Schedule(tuple(entries), tuple((True, e) for e in entries) + tuple((False, e) for e in reversed(entries)))


def interleaved_schedule(order: Sequence[int], num_layers_per_chunk: Union[None, int, Sequence[int]],
                         num_callables: int) -> Schedule:
    """The entries and capture steps of an interleaved pipeline ``order`` (see the module docstring).

    Raises:
        ValueError: ``order`` is not a pipeline schedule (a zero or non-int entry, chunks that do not
            each run M forwards and M backwards, a backward before its forward), or the layers per
            chunk do not add up to ``num_callables``.
    """
    chunks, microbatches = _check_order(order)
    layers = _layers_per_chunk(num_layers_per_chunk, chunks, num_callables)
    prefix = [sum(layers[:c]) for c in range(chunks)]
    callable_of = [0] * (num_callables * microbatches)
    for c in range(chunks):
        for m in range(microbatches):
            for layer in range(layers[c]):
                callable_of[prefix[c] * microbatches + m * layers[c] + layer] = prefix[c] + layer
    steps: List[Tuple[bool, int]] = []
    passes = {True: [0] * chunks, False: [0] * chunks}  # micro-batches run so far per chunk, forward / backward
    for token in order:
        forward, c = token > 0, abs(token) - 1
        m = passes[forward][c]
        passes[forward][c] += 1
        first = prefix[c] * microbatches + m * layers[c]
        run = range(first, first + layers[c])
        steps += [(forward, e) for e in (run if forward else reversed(run))]
    return Schedule(tuple(callable_of), tuple(steps))


def _check_order(order: Sequence[int]) -> Tuple[int, int]:
    """(chunks C, micro-batches M) of a valid ``order``."""
    if not order or not all(isinstance(t, int) and not isinstance(t, bool) and t != 0 for t in order):
        raise ValueError(f"_order must be a non-empty list of nonzero ints (+c: forward of chunk c, -c: its backward), got {order!r}")
    chunks = max(abs(t) for t in order)
    counts = Counter(order)
    microbatches = counts[1]
    for c in range(1, chunks + 1):
        if counts[c] != microbatches or counts[-c] != microbatches or microbatches == 0:
            raise ValueError(
                f"_order must run every chunk 1..{chunks} forward and backward once per micro-batch (the same count "
                f"for each); chunk {c} runs {counts[c]} forwards and {counts[-c]} backwards, chunk 1 {microbatches} forwards"
            )
    done = Counter()
    for position, t in enumerate(order):
        done[t] += 1
        if t < 0 and done[t] > done[-t]:
            raise ValueError(f"_order[{position}] = {t}: the backward of chunk {-t} comes before its forward")
    return chunks, microbatches


def _layers_per_chunk(given: Union[None, int, Sequence[int]], chunks: int, num_callables: int) -> List[int]:
    if given is None:
        if num_callables % chunks:
            raise ValueError(f"{num_callables} callables do not split evenly into the {chunks} chunks of _order; "
                             "pass _num_layers_per_chunk")
        return [num_callables // chunks] * chunks
    layers = [given] * chunks if isinstance(given, int) else list(given)
    if len(layers) != chunks or any(n < 1 for n in layers) or sum(layers) != num_callables:
        raise ValueError(f"_num_layers_per_chunk={given!r} must give {chunks} positive layer counts (one per chunk of "
                         f"_order) adding up to the {num_callables} callables")
    return layers
