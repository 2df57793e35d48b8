"""The front end: what runs beside the application or the HTTP server. Validates and
tokenizes a request (``input_processor``), hands it to an engine core, and turns the core's
token ids back into ``RequestOutput`` deltas (``detokenizer``, the streams). No torch."""
