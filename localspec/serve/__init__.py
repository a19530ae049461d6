"""`localspec serve`: an OpenAI-compatible HTTP server over one llama.cpp context.

    app.py        Starlette routes and SSE (keep-alive comments while a stream waits);
                  talks to the scheduler via queues
    connections.py  uvicorn's h11 protocol with deadlines for a request's headers and
                  body and for a client that stops reading, and a connection cap
    guard.py      what a web page must not do: a foreign Host (403), a POST that is not
                  JSON (415); CORS only for --cors-origin
    admission.py  who gets in and what a request may ask: API key, body size, message
                  count, max_tokens vs the slot's context, 429/503 with Retry-After,
                  the SIGTERM drain (stop admitting, a grace period, then 503)
    scheduler.py  the one thread that owns the model: continuous batching, one
                  decode_multi per step for every request's round, speculation switched
                  off above a batch size
    jobs.py       a request as the scheduler takes it (Job) and what its sink receives
                  (Text, Finished, Failed); QueueFull, Unavailable
    sequence.py   one request on its own KV sequence: the engine's round (Generation)
                  plus a prompt prefilled in chunks
    schema.py     the OpenAI request bodies as strict pydantic models
    protocol.py   a body -> GenRequest or OpenAI's 400 error; OpenAI-shaped responses
    tools.py      a chat request's prompt (the model's own template, tools included) and
                  how to read tool calls from its reply (tool_choice forcing)
    reply.py      one request's answer, whole or streamed: tool calls, logprobs
    logprobs.py   per-token logprobs in OpenAI's chat and legacy completions shapes
    metrics.py    counters and gauges, exposed through prometheus_client
    defaults.py   serving defaults: per-slot context, when speculation turns off under load

The click command is localspec/commands/serve.py.
"""
