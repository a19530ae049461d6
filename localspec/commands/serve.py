"""`localspec serve`: load the target once, run the scheduler thread and uvicorn."""

from __future__ import annotations

import logging
import signal
import sys

import click

from localspec.commands.options import (
    load_options,
    model_options,
    sampling_config,
    sampling_options,
    spec_config,
    spec_options,
)
from localspec.core.backend import Model
from localspec.core.errors import UsageError

# Speculation stays on while at most this many sequences are active when no calibration
# profile exists. Measured with `python -m localspec.bench.serve_bench` (1.5B target,
# n-gram, 2-core CPU): with two or more requests in the batch, speculating decoded
# slower than not (on/off 0.84x at C=2 on code/json/edit, 0.95x on an edit alone);
# alone is the case where n-gram speculation is known to pay on CPUs (DESIGN.md).
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 1
PER_SLOT_CTX = 4096  # -c default for serve: this much context for every slot ...
MAX_DEFAULT_CTX = 32768  # ... up to this much in all (KV memory grows with it)

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
                   f"[default: from the calibration profile, else {DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE}]")
@click.option("--api-key", envvar="LOCALSPEC_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (env LOCALSPEC_API_KEY)")
@click.option("-n", "--n-predict", "--max-tokens", "max_tokens", type=int, default=512, show_default=True,
              help="max_tokens for requests that set none (<= 0: --max-tokens-limit)")
@click.option("--max-tokens-limit", type=click.IntRange(min=1), default=4096, show_default=True,
              help="requests asking for more max_tokens get a 400")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=4 * 1024 * 1024,
              show_default=True, help="larger request bodies get a 413")
@click.option("--prefill-chunk", type=click.IntRange(16, 512), default=256, show_default=True,
              help="most prompt tokens prefilled per step (bounds the stall others see)")
@click.option("--alias", default=None, help="model id reported by /v1/models [default: file name]")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="seconds in-flight requests get to finish on SIGTERM / Ctrl-C")
@click.option("--no-log", is_flag=True, help="do not write requests to the acceptance log")
@click.pass_context
def serve(ctx: click.Context, host: str, port: int, parallel: int, queue_size: int | None,
          spec_disable: int | None, api_key: str | None, max_tokens: int, max_tokens_limit: int,
          max_body_bytes: int, prefill_chunk: int, alias: str | None, shutdown_timeout: float,
          no_log: bool, **kw) -> None:
    """OpenAI-compatible server: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics. Requests are batched together; speculation (n-gram drafting)
    yields under load.

    \b
      localspec serve --parallel 4
      curl localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}'

    -c is the total context, split across the --parallel slots
    (default: 4096 per slot, 32768 in all). Slots draft with n-grams (--spec auto means ngram
    here; a request's `prediction` is a second n-gram source); --draft is ignored.
    """
    try:
        import uvicorn

        from localspec.serve.app import ServeSettings, create_app, model_id_for
    except ImportError as exc:
        raise UsageError(f"localspec serve needs starlette and uvicorn ({exc.name} is missing): "
                         "pip install starlette uvicorn") from None
    from localspec.core.runtime import open_runtime
    from localspec.serve.scheduler import Scheduler, SchedulerConfig

    verbose = bool(ctx.obj and ctx.obj.get("verbose"))
    _setup_logging(verbose)
    if ctx.get_parameter_source("n_ctx") == click.core.ParameterSource.DEFAULT:
        kw["n_ctx"] = min(PER_SLOT_CTX * parallel, MAX_DEFAULT_CTX)
    opts = load_options(kw, verbose)
    if kw.get("spec") in ("model", "hybrid"):
        raise UsageError("serve drafts with n-grams (--spec ngram or none); "
                         "per-slot draft models are not supported yet")
    if opts.draft and opts.draft.lower() != "none":
        click.echo("localspec serve: --draft is ignored; slots draft with n-grams", err=True)
    if kw.get("spec") in (None, "auto"):
        # auto's cost model times single-sequence verifies; in a shared batch the load
        # rule below decides when drafts are worth their compute, and AdaptiveK sizes them
        kw["spec"] = "ngram"
    spec = spec_config(kw, has_draft=False)
    sampling = sampling_config(kw)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        click.echo(f"localspec serve: WARNING: listening on {host} without --api-key: "
                   "anyone who can reach this port can use the model", err=True)

    with open_runtime(opts, want_draft=False, n_seq_max=parallel) as rt:
        target = rt.target
        limit, source = _spec_threshold(spec_disable, target)
        cfg = SchedulerConfig(n_slots=parallel, queue_size=4 * parallel if queue_size is None else queue_size,
                              spec=spec, spec_disable_by_batch_size=limit, prefill_chunk=prefill_chunk)
        scheduler = Scheduler(target, cfg)
        settings = ServeSettings(
            model_id=model_id_for(target.path, alias), api_key=api_key, max_body_bytes=max_body_bytes,
            max_tokens_limit=max_tokens_limit, default_max_tokens=max_tokens, sampling=sampling,
            log_generations=not no_log, target_path=str(target.path),
        )
        app = create_app(scheduler, target, settings)
        rule = "never off" if limit is None else f"off above {limit} active ({source})"
        click.echo(f"localspec serve: http://{_url_host(host)}:{port}/v1  model {settings.model_id}  "
                   f"{parallel} slots x {target.n_ctx_seq} tokens  spec {spec.mode}, {rule}", err=True)
        config = uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=verbose,
                                log_level="info" if verbose else "warning",
                                timeout_graceful_shutdown=shutdown_timeout)
        _server_class()(config).run()
    click.echo("localspec serve: stopped", err=True)


def _spec_threshold(given: int | None, target: Model) -> tuple[int | None, str]:
    """(--spec-disable-by-batch-size, where it came from); None means never disable."""
    if given is not None:
        return (None if given < 0 else given), "set"
    try:
        from localspec.models.profile import load_profile

        profile = load_profile(target)
    except Exception:  # noqa: BLE001 - no profile module, or an unreadable profile
        profile = None
    if profile is not None:
        return threshold_from_vcurve(profile.vcurve), "calibration profile"
    return DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE, "default"


def threshold_from_vcurve(vcurve: list[float], alpha: float = 0.6, k: int = 4) -> int:
    """Largest batch size B at which speculating still pays under a measured verify
    cost curve (vcurve[n - 1] = time to decode n tokens at once, relative to one).

    B sequences decoded plainly cost V(B) per step for B tokens; speculating k tokens
    each costs V(B(k+1)) for B * E tokens, E = (1 - alpha^(k+1)) / (1 - alpha) the
    expected tokens per round. Speculation pays while E * V(B) >= V(B(k+1)).
    alpha = 0.6, k = 4 are typical of n-gram drafting on code and edits. Only batch
    sizes whose speculative step lies inside the measured curve are judged.
    """
    e = (1 - alpha ** (k + 1)) / (1 - alpha)
    best = 0
    for b in range(1, len(vcurve) // (k + 1) + 1):
        if e * vcurve[b - 1] >= vcurve[b * (k + 1) - 1]:
            best = b
    return best


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises a captured SIGTERM after its graceful shutdown, which kills
        the process before the model is freed; a SIGTERM'd server exits 0 here instead."""

        def handle_exit(self, sig: int, frame: object) -> None:
            super().handle_exit(sig, frame)
            captured = getattr(self, "_captured_signals", None)
            if sig == signal.SIGTERM and captured and captured[-1] == sig:
                captured.pop()

    return Server


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("localspec serve: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False
