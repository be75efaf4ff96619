"""A hash computed once per object, for the frozen dataclasses the planner's memo tables are keyed
by (Workload, Hardware, Runtime, PipelineRank). The generated __hash__ rehashes every field on each
call, and a search looks its per-rank tables up ~10^5 times with the same few objects: hashing a
Runtime (~45 fields) cost more than the lookup it served.

Assign both in the class body (a dataclass keeps an explicit __hash__):
    __hash__ = cached_hash
    __getstate__ = state_without_hash
The value is the generated hash's (the fields eq compares); it is left out of pickles, since a
string's hash differs between processes.
"""

from __future__ import annotations

import dataclasses

HASH_ATTRIBUTE = "_cached_hash"


def cached_hash(self) -> int:
    try:
        return self.__dict__[HASH_ATTRIBUTE]
    except KeyError:
        value = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                           if (f.hash if f.hash is not None else f.compare)))
        self.__dict__[HASH_ATTRIBUTE] = value  # beside the fields, so the frozen __setattr__ is not involved
        return value


def state_without_hash(self) -> dict:
    return {k: v for k, v in self.__dict__.items() if k != HASH_ATTRIBUTE}


class HashedTuple(tuple):
    """A tuple that hashes once: memo tables keyed by a pipeline's ranks (a tuple of up to ~100
    PipelineRanks) are looked up once per layout the search meets, and hashing the tuple asked
    each rank for its hash every time. Pickled as a plain tuple's items, without the hash."""

    def __hash__(self):
        try:
            return self.__dict__[HASH_ATTRIBUTE]
        except KeyError:
            value = self.__dict__[HASH_ATTRIBUTE] = tuple.__hash__(self)
            return value

    def __reduce__(self):
        return type(self), (tuple(self),)
