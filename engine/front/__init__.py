"""The front end: what runs beside the application or the HTTP server. ``AsyncEngine`` validates
and tokenizes a request (``input_processor``), hands it to an engine core through a core client
(``core_client``: in this process, another process, or Ray replicas), and turns the core's token
ids back into ``RequestOutput`` deltas (``output_processor``, ``detokenizer``). Only the
in-process core client imports torch, when it builds its core."""
