"""`appliance` command line: serve, generate, config show.

    appliance serve [--config FILE] [--set section.key=value ...]
    appliance generate "prompt" [--max-tokens N] [--temperature T] [--chat] [--config/--set]
    appliance config show [--config FILE] [--set ...] [--show-secrets]

Exit status: 0 on success (including a graceful SIGTERM), 2 for a bad config or bad
arguments (the message names the key), 1 when the engine or server fails to start, 3 when
the engine dies (or hangs past `server.step_timeout_s`) while serving, so that a supervisor
restarts the process rather than leave it answering 503.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from collections.abc import Sequence

from appliance.config import AppConfig, ConfigError, dump_config, load_config
from appliance.config.schema import yaml_key_error
from appliance.logs import configure_logging, log_event

logger = logging.getLogger("appliance.cli")

EXIT_ENGINE_DIED = 3


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", "-c", metavar="FILE", help="YAML config (default: $APPLIANCE_CONFIG)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set scheduler.max_num_seqs=64 (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="LLM inference appliance")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_config_args(serve)

    gen = sub.add_parser("generate", help="one-shot generation with the offline engine")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    _add_config_args(gen)

    cfg = sub.add_parser("config", help="configuration commands")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the effective configuration as YAML")
    show.add_argument("--show-secrets", action="store_true", help="do not redact api keys")
    _add_config_args(show)
    return parser


def _load(args: argparse.Namespace) -> AppConfig:
    return load_config(args.config, args.overrides, os.environ)


def cmd_config_show(args: argparse.Namespace) -> int:
    sys.stdout.write(dump_config(_load(args), redact=not args.show_secrets))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    configure_logging(cfg.telemetry.log_level, cfg.telemetry.log_format)
    from appliance.http.app import build_app
    from appliance.http.server import serve_forever
    from engine.async_engine import AsyncEngine

    log_event(logger, "starting", config=args.config or os.environ.get("APPLIANCE_CONFIG"))
    t0 = time.perf_counter()
    aeng = AsyncEngine.from_config(
        cfg.engine_config(),
        step_timeout_s=cfg.server.step_timeout_s,
        offload_prompt_chars=cfg.server.offload_prompt_chars,
    )
    stats = aeng.stats()
    log_event(
        logger,
        "engine ready",
        model=aeng.model_name,
        path=cfg.model.path or "default",
        device=str(aeng.engine.device),
        kv_blocks=stats.num_blocks,
        block_size=cfg.cache.block_size,
        max_model_len=aeng.max_model_len,
        load_s=round(time.perf_counter() - t0, 2),
    )
    log_event(
        logger,
        "frontends",
        host=cfg.server.host,
        http_port=cfg.server.http_port,
        grpc_port=cfg.server.grpc_port,
        api_keys=len(cfg.server.api_keys),
        tenants=len(cfg.server.tenants),
        cors=bool(cfg.server.cors_origins),
    )

    from appliance.adapters import AdapterRegistry
    from appliance.grpc.server import GrpcSettings, start_grpc_server
    from appliance.http.server import EngineDiedError
    from appliance.responses.store import open_store
    from appliance.telemetry import instrument_app, setup_tracing

    tracing = setup_tracing(cfg.telemetry)  # None when telemetry.otlp_endpoint is unset
    adapters = AdapterRegistry(aeng, cfg.lora, aeng.model_name)
    # One store for HTTP and gRPC (/v1/responses, Respond), opened (and created) now.
    store = open_store(
        cfg.responses.store_path, cfg.responses.max_stored, cfg.responses.ttl_s, os.environ
    )
    log_event(logger, "responses store", path=store.path, max_stored=store.max_stored)

    async def main() -> None:
        try:
            await adapters.load_modules()  # a bad one: ConfigError naming lora.modules.<name>
        except BaseException:
            await aeng.shutdown()
            raise
        if adapters.adapters():
            log_event(
                logger, "adapters ready", names=",".join(a.lora_name for a in adapters.adapters())
            )
        app = instrument_app(
            build_app(aeng, cfg.server, tracing=tracing, adapters=adapters, responses_store=store),
            tracing,
        )
        grpc_server = None
        if cfg.server.grpc_port is not None:
            grpc_server = await start_grpc_server(
                aeng, GrpcSettings.from_server_config(cfg.server), tracing, adapters, store
            )

        def grace() -> float:
            # A dead or hung engine finishes nothing: waiting for its calls only delays exit.
            return cfg.server.shutdown_grace_s if aeng.is_healthy else 0.0

        began: list[float] = []  # when the drain began (SIGTERM)

        def stop_grpc() -> None:
            began.append(time.monotonic())
            # Refuse new gRPC calls at once; running ones get the same grace as HTTP.
            if grpc_server is not None:
                asyncio.get_running_loop().create_task(grpc_server.stop(grace()))

        try:
            await serve_forever(app, cfg.server, on_shutdown=stop_grpc)
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace())
            # The KV disk tier gets what is left of the grace (warm restart).
            left = cfg.server.shutdown_grace_s - (time.monotonic() - began[0]) if began else 0.0
            await aeng.shutdown(grace_s=0, flush_s=max(0.0, left) if aeng.is_healthy else 0.0)
            store.close()
            if tracing is not None:
                tracing.shutdown()  # flush spans

    try:
        asyncio.run(main())
    except EngineDiedError as e:
        log_event(logger, "stopped: engine died", reason=str(e))
        print(f"appliance: the engine died while serving: {e}", file=sys.stderr)
        return EXIT_ENGINE_DIED
    log_event(logger, "stopped")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = _load(args)
    configure_logging(
        "warning" if cfg.telemetry.log_level == "info" else cfg.telemetry.log_level,
        cfg.telemetry.log_format,
    )
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(cfg.engine_config())
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("generate-0", prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():  # only what is new: write it as it comes
            if delta.outputs:
                sys.stdout.write(delta.outputs[0].text)
                sys.stdout.flush()
            if delta.error:
                raise RuntimeError(delta.error)
    sys.stdout.write("\n")
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "config": cmd_config_show}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"appliance: config error: {yaml_key_error(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from engine.errors import InvalidRequestError

        if isinstance(e, InvalidRequestError | ValueError) and args.command == "generate":
            print(f"appliance: {e}", file=sys.stderr)
            return 2
        logger.critical("failed", exc_info=True)
        print(f"appliance: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
