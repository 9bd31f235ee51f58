"""The OpenAI wire contract that the gateway and the bundled backend share (torch-free).

    contract.py   request models, the field policy (served, or a 400 naming the field),
                  the capability names
    errors.py     ApiError and its tree: OpenAI's error shape, retry headers
    http.py       request ids, body limits, JSON bodies, numeric headers, error handlers
    json_body.py  strict JSON: UTF-8, no lone surrogates, nesting bounded (a 400 naming
                  the field)
    sse.py        SSE framing: encoding, and splitting a byte stream into events
    versions.py   ResolvedVersions: the x-sluice-resolved header and system_fingerprint
    limits.py     ConnectionLimits: read deadlines and the connection cap; ConnectionCounts:
                  the cuts by reason, for /metrics (light: no uvicorn)
    server.py     the HTTP/1.1 protocol both servers run under uvicorn: slow senders cut
                  off (408), open connections capped (503), heads and trailers bounded
                  (431), parser errors in OpenAI's shape (400)
    prompt_bound.py  a prompt's tokens bounded from below without tokenizing (token_bound)
    offload.py    the bounded, tenant-fair pool both servers tokenize long prompts in
    memory.py     freed heap given back to the system after large requests (Trimmer)
    structured.py response_format / tools / tool_choice validated (a 400 naming the field)
                  into a grammar, the prompt they render to, and their SHA-256 stamps
    tool_grammar.py  the Lark grammars of tool-call turns (tool_choice auto, required, named)
    tool_calls.py the tool-call text format: parsed whole, or streamed as OpenAI deltas

It imports no other part of Sluice: only pydantic and Starlette (and uvicorn, in server.py).
"""
