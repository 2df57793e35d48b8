"""Speculative decoding's drafters and bookkeeping: the ``Drafter`` interface and
its registry (``drafter.py``), prompt lookup (``ngram.py``), replay (``replay.py``), the
acceptance counters (``stats.py``) and rejection sampling (``rejection.py``, the one module
here that needs torch). The verify itself is the runner's
(``engine/runner/verify.py``); the step that drives it is ``engine/core/spec_step.py``."""
