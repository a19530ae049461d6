"""The engine core: everything a generation needs, and nothing about terminals, files
or HTTP.

    config.py     frozen dataclasses: ModelConfig, SamplingConfig, SpecConfig, GenerationConfig
    errors.py     LocalspecError tree (UsageError and subclasses exit 2, the rest exit 1)
    backend/      the one llama_cpp importer: models (load, tokenize, decode, rewind, KV
                  sequences), grammars (GBNF, JSON schema), log, ggml devices, RPC (ctypes)
    rpc.py        RPC workers: endpoints, bounded probe, attach, serve, lost worker -> exit 1
    sampling.py   numpy: logits -> probs, greedy and lossless stochastic accept rules
    drafters/     the Drafter protocol and none / ngram / model / hybrid / auto
    engine.py     the speculative round (Generation: plan -> decode -> accept), and
                  generate(), the loop every command consumes; the server drives the same
                  round for every request in one batched decode
    events.py     what a generation yields: Token, Round, Done(GenerationStats)
    compat.py     can this draft model speculate for that target?
    chat_template.py  the GGUF's own chat template (render_chat, chat_prompt)
(Loading models for a command is localspec/runtime.py's: it reads models/ and the
profile, and says what it chose on stderr.)
"""
