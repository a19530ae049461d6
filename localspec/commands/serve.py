"""`localspec serve`: load the target once, run the scheduler thread and uvicorn."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import click
import uvicorn

from localspec import servers
from localspec.commands.options import (
    load_options,
    model_options,
    sampling_config,
    sampling_options,
    spec_config,
    spec_options,
)
from localspec.core.chat_template import refuse_hostile
from localspec.core.config import SpecConfig, SpecMode
from localspec.core.errors import UsageError
from localspec.core.tuning import PROMPT_CACHE_MIB
from localspec.serve.connections import (
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT,
    ConnectionLimits,
    uvicorn_config,
)
from localspec.serve.defaults import (
    DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE,
    MAX_MESSAGES,
    default_n_ctx,
    spec_threshold,
)
from localspec.servers import ServerRecord

if TYPE_CHECKING:
    from localspec.serve.admission import Drain

log = logging.getLogger("localspec.serve")


@click.command()
@model_options()
@spec_options
@sampling_options
@click.option("--host", default="127.0.0.1", envvar="LOCALSPEC_HOST", show_default=True,
              help="address to bind (loopback only unless you set it; use --api-key when exposed)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, envvar="LOCALSPEC_PORT",
              show_default=True)
@click.option("-np", "--parallel", "parallel", type=click.IntRange(1, 256), default=4, show_default=True,
              help="slots: requests decoded together in one batch")
@click.option("--queue-size", type=click.IntRange(min=0), default=None,
              help="requests waiting for a slot before 429 [default: 4 x --parallel]")
@click.option("--spec-disable-by-batch-size", "spec_disable", type=click.IntRange(min=-1), default=None,
              help="speculation off while more than N sequences are active; -1 never "
                   f"[default: as `localspec tune` measured it by context length, else {DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE}; "
                   "above that default, auto's drafts a step pays for are still verified; a value set here is kept as given]")
@click.option("--api-key", envvar="LOCALSPEC_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (env LOCALSPEC_API_KEY); several keys "
                   "separated by commas, each with its own drafting memory")
@click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int, default=512, show_default=True,
              help="max_tokens for requests that set none (<= 0: --max-tokens-limit)")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=4096, show_default=True,
              help="requests asking for more max_tokens get a 400")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 1024 * 1024,
              show_default=True, help="larger request bodies get a 413")
@click.option("--max-messages", type=click.IntRange(min=1), default=MAX_MESSAGES, show_default=True,
              help="chat requests with more messages get a 400")
@click.option("--prefill-chunk", type=click.IntRange(16, 512), default=256, show_default=True,
              help="most prompt tokens prefilled per step (bounds the stall others see)")
@click.option("--alias", default=None, help="model id reported by /v1/models [default: file name]")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="on SIGTERM / Ctrl-C new requests get a 503 and admitted ones this many seconds "
                   "to finish; then the rest end with a 503")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=DEFAULT_HEADER_TIMEOUT,
              show_default=True, help="seconds a client has to send a request's headers, from connecting "
                                      "or from its previous reply; then the connection is closed")
@click.option("-to", "--timeout", "timeout", type=click.FloatRange(min=0.1), default=DEFAULT_TIMEOUT,
              show_default=True, help="seconds a client has to send a request body, and to resume reading "
                                      "a reply it stopped reading; then the connection is closed")
@click.option("--max-connections", type=click.IntRange(min=1), default=DEFAULT_MAX_CONNECTIONS,
              show_default=True, help="open connections at most; past it the oldest one still sending its "
                                      "headers (or idle) is closed, or, when all are serving, the new one gets a 503")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="HOST",
              help="also answer requests whose Host header names HOST (repeatable; '*.lan' a domain, '*' any). "
                   "By default only localhost, 127.0.0.1, ::1 and the --host value (with 0.0.0.0: also any "
                   "IP address and this machine's name): others get a 403, so a web page cannot reach the "
                   "server through DNS rebinding")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="let web pages of ORIGIN (e.g. http://localhost:3000; '*' any) read replies (CORS; "
                   "repeatable). Without it no page of another origin can read them")
@click.option("--cache-reuse", "cache_reuse", type=click.IntRange(min=0), default=0, metavar="N",
              help="past the longest start of a prompt that a free slot holds, also reuse the slot's "
                   "cached runs of at least N tokens the prompt repeats further on, moved by KV shifting "
                   "(llama-server's --cache-reuse; approximate: greedy output may then differ from a "
                   "fresh prefill) [default: 0, off]")
@click.option("-cram", "--cache-ram", "cache_ram", type=click.IntRange(min=-1), default=PROMPT_CACHE_MIB, metavar="MiB",
              show_default=True,
              help="keep the KV cells of slots given to other requests, up to this many MiB, so a prompt "
                   "seen before prefills only what is new (llama-server's prompt cache; -1: no limit, 0: off)")
@click.option("--no-log", is_flag=True, help="do not write requests to the acceptance log")
@click.option("--no-memory", is_flag=True,
              help="do not draft from earlier replies (by default one memory per API key, kept "
                   "for the server's lifetime; a request opts out with \"memory\": false)")
@click.option("--lookup", "lookup", multiple=True, metavar="PATH", type=click.Path(exists=True),
              help="also draft from these files or directories (a repo's text files; repeatable), "
                   "for every API key: llama.cpp's static lookup cache")
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, parallel: int, queue_size: int | None,
          spec_disable: int | None, api_key: str | None, max_tokens: int, max_tokens_limit: int,
          max_body_bytes: int, max_messages: int, prefill_chunk: int, alias: str | None,
          shutdown_timeout: float, header_timeout: float, timeout: float, max_connections: int,
          allowed_hosts: tuple[str, ...], cors_origins: tuple[str, ...], cache_reuse: int, cache_ram: int, no_log: bool,
          no_memory: bool, lookup: tuple[str, ...],
          **kw) -> None:
    """OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics. Requests are batched together; speculation (n-gram drafting)
    yields under load.

    \b
      localspec serve --parallel 4
      curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}'

    -c is the total context, split across the --parallel slots
    (default: 4096 per slot, 32768 in all). Slots draft with n-grams (a request's
    `prediction` is a second n-gram source); with --draft MODEL (or auto) also with the
    draft model, one sequence of its context per slot, all slots' drafts in one batched
    draft decode per token. --spec auto (the default) chooses per slot and round between
    n-gram, the memory of earlier replies, the model (when loaded) and plain decoding.
    """
    # the engine, llama.cpp among it, loads here: `serve --help` needs none of it
    from localspec.runtime import find_profile, open_runtime
    from localspec.serve.admission import Drain
    from localspec.serve.app import ServeSettings, create_app, model_id_for
    from localspec.serve.scheduler import Scheduler, SchedulerConfig

    verbose = bool(ctx.obj and ctx.obj.get("verbose"))
    _setup_logging(verbose)
    if ctx.get_parameter_source("n_ctx") == click.core.ParameterSource.DEFAULT:
        kw["n_ctx"] = default_n_ctx(parallel)
    opts = load_options(kw, verbose)
    has_draft = bool(opts.draft) and opts.draft.lower() != "none"
    spec_config(dict(kw), has_draft=has_draft)  # bad options fail before the models load
    want_draft = has_draft and SpecMode(kw.get("spec") or SpecMode.AUTO).uses_draft_model
    if has_draft and not want_draft:
        click.echo(f"localspec serve: --draft is unused with --spec {kw.get('spec')}", err=True)
    sampling = sampling_config(kw)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"localspec serve: WARNING: listening on {host} without --api-key: "
                   "anyone who can reach this port can use the model", err=True)

    with open_runtime(opts, want_draft=want_draft, n_seq_max=parallel) as rt:
        target, draft = rt.target, rt.draft
        # a template past the bounds is refused now, not on every request (see its error)
        refuse_hostile(target)
        spec = _spec(kw, draft)
        # the load limits tune or `bench --serve` measured (the latter without tune too)
        profile = find_profile(target, draft, online=True) if spec_disable is None else None
        c = profile.c if profile and spec.mode.needs_draft_model else None
        limits = spec_threshold(spec_disable, profile, c or 0.0)
        cfg = SchedulerConfig(n_slots=parallel, queue_size=4 * parallel if queue_size is None else queue_size,
                              spec=spec, spec_limits=limits, prefill_chunk=prefill_chunk,
                              cache_reuse=cache_reuse,
                              prompt_cache_bytes=None if cache_ram < 0 else cache_ram << 20)
        scheduler = Scheduler(target, cfg, draft=draft)
        corpus = _lookup_index(target, lookup) if lookup else None
        settings = ServeSettings(
            model_id=model_id_for(target.path, alias), api_key=api_key, max_body_bytes=max_body_bytes,
            max_messages=max_messages, max_tokens_limit=max_tokens_limit, default_max_tokens=max_tokens, sampling=sampling,
            log_generations=not no_log, target_path=str(target.path), memory=not no_memory,
            lookup=corpus, host=host, allowed_hosts=allowed_hosts, cors_origins=cors_origins,
        )
        app = create_app(scheduler, target, settings)
        rule = limits.describe() + ("; above it, only drafts a step pays for" if scheduler.sure_bets else "")
        click.echo(f"localspec serve: http://{_url_host(host)}:{port}/v1  model {settings.model_id}  "
                   f"{parallel} slots x {target.n_ctx_seq} tokens  spec {spec.mode}, {rule}"
                   + (f"  draft {draft.name}" if draft else ""), err=True)
        limits = ConnectionLimits(header_timeout, timeout, max_connections)
        config = uvicorn_config(app, host, port, limits, lifespan="on", access_log=verbose,
                                log_level="info" if verbose else "warning")
        record = ServerRecord(pid=os.getpid(), host=host, port=port, model=settings.model_id,
                              model_path=str(target.path), slots=parallel, n_ctx_seq=target.n_ctx_seq,
                              draft=draft.name if draft else None, started=time.time())
        _Server.run_draining(config, Drain(scheduler, shutdown_timeout), record)
    click.echo("localspec serve: stopped", err=True)


def _lookup_index(target, paths: tuple[str, ...]):
    """The --lookup corpora, tokenized and indexed once at start-up."""
    from localspec.core.drafters.memory import static_index
    from localspec.memory_store import read_corpus

    texts = read_corpus(paths, lambda s: target.tokenize(s, False, False))
    index = static_index(texts)
    click.echo(f"localspec serve: --lookup: {len(texts)} files, {len(index) - len(texts)} tokens", err=True)
    return index


def _spec(kw: dict, draft: object | None) -> SpecConfig:
    """The slots' drafting, once it is known whether a draft model loaded. Auto stays
    auto without a draft model: each round it chooses between the context's n-grams,
    the memory (and --lookup corpora) and plain decoding by the verify times the server
    measured, so a round drafts only where that pays. (A fixed n-gram drafter's 8-token
    drafts from one-token matches, most of them rejected, cost a 500 ms /infill more than
    half its tokens, and a short code reply at one client 0.78x of no speculation:
    docs/measurements.md.) Past the load rule's limit nothing drafts, whatever the mode."""
    mode = SpecMode(kw.get("spec") or SpecMode.AUTO)
    if mode.needs_draft_model and draft is None:
        raise UsageError(f"--spec {mode}: --draft auto found no compatible draft model")
    return spec_config(kw, has_draft=draft is not None)


class _Server(uvicorn.Server):
    """The first SIGTERM or Ctrl-C starts the drain (new requests 503, admitted ones get
    --shutdown-timeout to finish) while uvicorn stops listening and waits for them.
    uvicorn re-raises a captured SIGTERM after its graceful shutdown, which kills
    the process before the model is freed; a SIGTERM'd server exits 0 here instead."""

    def __init__(self, config: uvicorn.Config, drain: Drain, record: ServerRecord | None = None) -> None:
        super().__init__(config)
        self.drain = drain
        self.record = record
        self.record_path: Path | None = None

    @classmethod
    def run_draining(cls, config: uvicorn.Config, drain: Drain, record: ServerRecord | None = None) -> None:
        # uvicorn's own timeout is the backstop: the drain ends every request before it
        config.timeout_graceful_shutdown = drain.grace_s + 5
        server = cls(config, drain, record)
        try:
            server.run()
        finally:
            drain.cancel()
            if server.record_path is not None:
                servers.unregister(server.record_path)

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.record is not None:  # listening: `localspec ps` may list it
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.record.port
            try:
                self.record_path = servers.register(replace(self.record, port=port))
            except OSError as exc:
                log.warning(f"cannot record this server for `localspec ps`: {exc}")

    def handle_exit(self, sig: int, frame: object) -> None:
        self.drain.begin()
        super().handle_exit(sig, frame)
        captured = getattr(self, "_captured_signals", None)
        if sig == signal.SIGTERM and captured and captured[-1] == sig:
            captured.pop()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("localspec serve: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
