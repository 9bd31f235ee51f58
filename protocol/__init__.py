"""The OpenAI wire contract that the gateway and the bundled backend share (torch-free).

    contract.py   request models, the field policy (served, or a 400 naming the field),
                  the capability names
    errors.py     ApiError and its tree: OpenAI's error shape, retry headers
    http.py       request ids, body limits, JSON bodies, Starlette error handlers
    sse.py        SSE framing: encoding, and splitting a byte stream into events
    versions.py   ResolvedVersions: the x-sluice-resolved header and system_fingerprint

It imports no other part of Sluice: only pydantic and Starlette.
"""
