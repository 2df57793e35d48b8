"""deltaserve.server: ``deltaserve serve``, an OpenAI-compatible HTTP server over one AsyncEngine."""
