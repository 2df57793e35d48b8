"""The reuse learner: how likely a checkpoint of each class is to serve a hit, and when.

``ReuseLearner`` estimates, per *class* — the capture kind (branch, tail, output, interval,
...) until a checkpoint serves a hit, then ``hit1`` / ``hit2`` — the *hit density* of an
entry that has gone ``age`` admissions without a hit: P(a hit is still to come) over the
expected wait for it (LHD's idea, Beckmann et al., NSDI '18). Time is counted in admitted
prompts. It learns from two shadows of boundaries (``_Shadow``): every *proposed* capture,
stored or not, and every *kept* one; a capture kind is also learned per *path history* (how
many boundaries were proposed on the path before). The value eviction strategy
(``cache/value_eviction.py``) prices checkpoints with it; details in ``docs/cache.md``.
Torch-free; O(1) per event (a class's table is rebuilt only when its counts changed).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

from deltaserve.cache.types import CaptureKind

SUB = 4  # age buckets per octave
NUM_BUCKETS = 4 + 24 * SUB  # ages 0..3 exactly, then 4 per octave up to 2^26
HIT_CLASSES = ("hit1", "hit2")
NUM_HISTORY = 11  # history buckets: 0..7 exactly, 8-11, 12-15, 16+


def history_bucket(history: int) -> int:
    """Bucket of a path's history (how many boundaries were proposed on it before)."""
    if history < 8:
        return history
    return min(8 + (history - 8) // 4, NUM_HISTORY - 1)


def _bucket(age: int) -> int:
    """Age bucket: exact below 4, then ``SUB`` log-spaced buckets per octave."""
    if age < 4:
        return max(age, 0)
    e = age.bit_length() - 1  # 2^e <= age < 2^(e+1), e >= 2
    return min(4 + (e - 2) * SUB + ((age >> (e - 2)) & 3), NUM_BUCKETS - 1)


def _bounds(b: int) -> tuple[float, float]:
    """[lower, upper) ages of bucket ``b``."""
    if b < 4:
        return float(b), float(b + 1)
    e, m = divmod(b - 4, SUB)
    step = 1 << e
    lo = (4 + m) * step
    return float(lo), float(lo + step)


_LOWER = [_bounds(b)[0] for b in range(NUM_BUCKETS)]
_MIDDLE = [(_bounds(b)[0] + _bounds(b)[1] - 1) / 2 for b in range(NUM_BUCKETS)]
_UPPER = [_bounds(b)[1] for b in range(NUM_BUCKETS)]


class _Shadow:
    """Boundaries by the hash of their last block -> [credits, pending (class, since), last
    event], least recently active first. A boundary is *credited* when it is the deepest of
    this shadow on an admitted prompt's path; each pending proposal then scores a hit."""

    def __init__(self, learner: ReuseLearner, follow_hits: bool, n: int) -> None:
        self.learner = learner
        self.follow_hits = follow_hits  # after a credit, wait on as hit1 / hit2
        self.entries: OrderedDict[int, list] = OrderedDict()
        self.hits = [[0.0] * NUM_BUCKETS for _ in range(n)]  # per class, per age bucket
        self.misses = [0.0] * n

    def add(self, key: int, c: int | None) -> None:
        learner = self.learner
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = [0, [], learner.now]
            while len(self.entries) > learner.capacity:
                self.entries.popitem(last=False)
        elif c is not None and (c, learner.now) in entry[1]:
            return  # the same proposal again (a retried step)
        else:
            entry[2] = learner.now
            self.entries.move_to_end(key)
        if c is not None:
            entry[1].append((c, learner.now))
            learner._pending[c].append((self, key, learner.now))

    def deepest(self, hashes: Sequence[int], top: int, stride: int) -> int:
        """Block count of the deepest boundary of this shadow on the path (0: none)."""
        entries = self.entries
        for n in range(top - top % stride, 0, -stride):
            if hashes[n - 1] in entries:
                return n
        return 0

    def credit(self, key: int) -> None:
        learner = self.learner
        entry = self.entries.get(key)
        if entry is None:
            return
        for c, since in entry[1]:
            self.hits[c][_bucket(learner.now - since)] += 1
            learner._changed(c)
        entry[0] += 1
        entry[1] = []
        entry[2] = learner.now
        self.entries.move_to_end(key)
        if self.follow_hits:
            self.add(key, learner._index[HIT_CLASSES[min(entry[0], 2) - 1]])

    def resolve(self, key: int, c: int, since: int) -> bool:
        """A pending proposal's window passed: True if it was still unhit (a miss)."""
        entry = self.entries.get(key)
        if entry is None:
            return True  # expired unhit
        if (c, since) in entry[1]:
            entry[1].remove((c, since))
            return True
        return False

    def expire(self, oldest: int) -> None:
        entries = self.entries
        while entries and next(iter(entries.values()))[2] < oldest:
            entries.popitem(last=False)


class ReuseLearner:
    """Per-class reuse statistics, learned from two shadows (see the module docstring).

    * ``proposed``: every capture the policy proposes, stored or not. Credits teach the
      capture kinds (tail, branch, output, ...): would this kind serve, were it kept?
    * ``kept``: every capture actually published. Credits teach the hit classes (``hit1``,
      ``hit2``): once a kept checkpoint has served, will it serve again, given what else
      was kept (a conversation's older tail serves again only when the newer was not kept;
      a tree's shared node serves its grandchildren when the expanded child's output was
      not kept)?

    ``hits[c][b]``: proposals of class ``c`` credited at an age in bucket ``b``;
    ``misses[c]``: proposals still unhit past the class's *window* (twice the age by which
    95 % of its hits came, at least 16). Younger ones are pending and count neither way, so
    a kind whose hits take a while is not judged before they can come. Counts halve every
    ``half_life`` admissions (the model follows a workload that changes); a shadow boundary
    is forgotten ``horizon`` admissions after its last event, or when ``capacity`` are newer.
    Time is counted in admitted prompts.

    A capture kind's entries are counted per history bucket (class ``"tail@3"``: a tail on a
    path with 3 earlier proposals); a kind's own table pools all its buckets, and a history
    class uses the kind's hit ages with its own reuse probability (``_stats``).
    """

    def __init__(
        self,
        *,
        horizon: int = 4096,
        capacity: int = 1 << 16,
        half_life: int = 2048,
        prior_hits: float = 1.0,
        prior_misses: float = 1.0,
        prior_age: int = 16,
        explore: float = 0.25,
        backoff: float = 4.0,
    ) -> None:
        self.horizon = horizon
        self.capacity = capacity
        self.half_life = half_life
        self.now = 0
        kinds = [k.label for k in CaptureKind]
        self.classes = kinds + list(HIT_CLASSES) + [f"{k}@{h}" for k in kinds for h in range(NUM_HISTORY)]
        self._index = {c: i for i, c in enumerate(self.classes)}
        # a capture kind's history classes: counted apart, estimated through the kind
        self._kind_of = {self._index[f"{k}@{h}"]: self._index[k] for k in kinds for h in range(NUM_HISTORY)}
        self._members = {self._index[k]: [self._index[k]] for k in kinds}
        for c, k in self._kind_of.items():
            self._members[k].append(c)
        n = len(self.classes)
        self.explore = explore
        self.backoff = backoff
        self.prior_hits, self.prior_misses, self.prior_bucket = prior_hits, prior_misses, _bucket(prior_age)
        self._tables: list[tuple[list[tuple[float, float, float]], int] | None] = [None] * n
        self._pending: list[deque[tuple[_Shadow, int, int]]] = [deque() for _ in range(n)]
        self.proposed = _Shadow(self, follow_hits=False, n=n)
        self.kept = _Shadow(self, follow_hits=True, n=n)
        self.track_time = 1.0  # admissions a tracking slot is held before its output is published

    # -- events --------------------------------------------------------------------------
    def label(self, kind: CaptureKind, history: int | None) -> str:
        """The class of a capture of ``kind`` on a path of ``history`` (None: the kind alone)."""
        return kind.label if history is None else f"{kind.label}@{history_bucket(history)}"

    def register(self, key: int, kind: CaptureKind, history: int | None = None) -> None:
        """A capture of ``kind`` was proposed at the boundary whose last block hashes to ``key``
        (one trial of the kind, even where an earlier proposal waits)."""
        self.proposed.add(key, self._index[self.label(kind, history)])

    def kept_at(self, key: int, kind: CaptureKind, history: int | None = None) -> None:
        """A capture of ``kind`` was published at the boundary ``key``."""
        self.kept.add(key, self._index[self.label(kind, history)])

    def observe(self, hashes: Sequence[int], limit_blocks: int, stride: int) -> int:
        """One admitted prompt: time moves on, and in each shadow the deepest boundary on its
        path (block ``i`` ends a boundary when ``(i + 1) % stride == 0``, up to
        ``limit_blocks``) is credited. Returns the path's *history*: how many boundaries on
        it were proposed before (about the turns a conversation has had, the levels a tree
        branch has gone down)."""
        self.tick()
        top = min(limit_blocks, len(hashes))
        entries = self.proposed.entries
        proposed = [n for n in range(stride, top + 1, stride) if hashes[n - 1] in entries]
        if proposed:  # one pass over the path gives both the history and the deepest proposal
            self.proposed.credit(hashes[proposed[-1] - 1])
        n = self.kept.deepest(hashes, top, stride)
        if n:
            self.kept.credit(hashes[n - 1])
        return len(proposed)

    def tick(self) -> None:
        self.now += 1
        if self.now % self.half_life == 0:
            self._decay()
        for c, pending in enumerate(self._pending):
            if not pending:
                continue
            window = self._window(c)
            while pending and self.now - pending[0][2] > window:
                shadow, key, since = pending.popleft()
                if shadow.resolve(key, c, since):
                    shadow.misses[c] += 1
                    self._changed(c)
        oldest = self.now - self.horizon
        self.proposed.expire(oldest)
        self.kept.expire(oldest)

    def _counts(self, c: int) -> tuple[list[float], float]:
        """Hits per age bucket and misses of class ``c`` (a capture kind: with all its history
        classes), plus the prior."""
        hits, misses = self._raw(*self._members.get(c, (c,)))
        hits[self.prior_bucket] += self.prior_hits
        return hits, misses + self.prior_misses

    def _history_reuse(self, c: int) -> float:
        """P(an entry of history class ``c`` is ever hit): its own share of hits, shrunk
        toward its kind's by ``backoff`` pseudo-entries (the kind's for a history not seen
        yet; lower for one whose paths end there)."""
        p_kind = self._stats(self._kind_of[c])[0][0][0]  # P(hit still to come | age 0)
        hits, misses = self._raw(c)
        h = sum(hits)
        return (h + self.backoff * p_kind) / (h + misses + self.backoff)

    def _raw(self, *classes: int) -> tuple[list[float], float]:
        """Hits per age bucket and misses of ``classes`` together: what the kept captures
        taught (would it serve, given what else is kept?), plus ``explore`` x what all
        proposals taught (would it serve, were it kept? — the only evidence for kinds
        rarely kept)."""
        k, p, w = self.kept, self.proposed, self.explore
        hits = [0.0] * NUM_BUCKETS
        misses = 0.0
        for c in classes:
            hits = [h + a + w * b for h, a, b in zip(hits, k.hits[c], p.hits[c], strict=True)]
            misses += k.misses[c] + w * p.misses[c]
        return hits, misses

    def _changed(self, c: int) -> None:
        """Class ``c``'s counts changed: its table is stale, and for a history class its
        kind's and its siblings' (they pool into the kind, and shrink toward its reuse)."""
        tables = self._tables
        for f in self._members.get(self._kind_of.get(c, c), (c,)):
            tables[f] = None

    def _window(self, c: int) -> int:
        return self._stats(c)[1]

    def _decay(self) -> None:
        for shadow in (self.proposed, self.kept):
            shadow.misses = [m * 0.5 for m in shadow.misses]
            shadow.hits = [[h * 0.5 for h in row] for row in shadow.hits]
        self._tables = [None] * len(self.classes)

    # -- estimates -----------------------------------------------------------------------
    def density(self, label: str, age: int, delay: float = 0.0) -> float:
        """Expected hits per admission of cache time, for an entry of class ``label`` that has
        gone ``age`` admissions without a hit: P(a hit is still to come | none by ``age``)
        over the expected wait for it — plus ``delay`` admissions the slot is held before
        the entry can serve at all (a decoding request's output, tracked until it finishes)."""
        still, wait, _ = self._stats(self._index[label])[0][_bucket(age)]
        return still / (wait + delay) if still else 0.0

    def _stats(self, c: int) -> tuple[list[tuple[float, float, float]], int]:
        """Class ``c``'s table and window, recomputed when its counts changed. Table, per age
        bucket ``a``: (P(hit still to come | none by a), E[x - a | x >= a] >= 1, P(x >= a |
        hit)) over the hit ages ``x`` seen. Window: twice the age by which 95 % of the hits
        came (at least 16).

        A history class has its kind's hit ages (so residents and newcomers of one kind
        rank on one age curve) and its own reuse ``p``: P(still to come | none by a) =
        p S(a) / (p S(a) + 1 - p), S(a) = P(x >= a | hit) — the kind's own formula with
        ``p`` in place of the kind's, so a history whose paths often end decays sooner."""
        cached = self._tables[c]
        if cached is not None:
            return cached
        kind = self._kind_of.get(c)
        if kind is not None:
            kind_table, window = self._stats(kind)
            p = self._history_reuse(c)
            table = [(p * s / (p * s + 1 - p) if p * s > 0 else 0.0, w, s) for _, w, s in kind_table]
            self._tables[c] = (table, window)
            return table, window
        hits, never = self._counts(c)
        table = [(0.0, 1.0, 0.0)] * NUM_BUCKETS
        total = sum(hits)
        s0 = s1 = 0.0  # suffix sums of hits and hits x age
        for b in range(NUM_BUCKETS - 1, -1, -1):
            s0 += hits[b]
            s1 += hits[b] * _MIDDLE[b]
            if s0 > 0:
                a = _LOWER[b]
                table[b] = (s0 / (s0 + never), max((s1 - a * s0) / s0, 1.0), s0 / total)
        acc, last = 0.0, 0
        while last < NUM_BUCKETS - 1 and acc + hits[last] < 0.95 * total:
            acc += hits[last]
            last += 1
        window = int(min(max(2 * _UPPER[last], 16), self.horizon))
        self._tables[c] = (table, window)
        return table, window

    def tracked(self, duration: int) -> None:
        """A decoding request held a tracking slot ``duration`` admissions (moving average)."""
        self.track_time += 0.1 * (duration - self.track_time)

    def reuse_probability(self, label: str) -> float:
        """Share of the class's entries credited with a hit (decayed counts, with the prior;
        a capture kind's covers all its history classes; a history class's is its own,
        shrunk toward its kind's). For reports and tests."""
        c = self._index[label]
        if c in self._kind_of:
            return self._history_reuse(c)
        hits, misses = self._counts(c)
        return sum(hits) / (sum(hits) + misses)
