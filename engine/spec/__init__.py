"""Speculative decoding's drafters and bookkeeping (torch-free): the ``Drafter`` interface and
its registry (``drafter.py``), prompt lookup (``ngram.py``), replay (``replay.py``) and the
acceptance counters (``stats.py``). The verify itself is the runner's
(``engine/runner/verify.py``); the step that drives it is ``engine/core/spec_step.py``."""
