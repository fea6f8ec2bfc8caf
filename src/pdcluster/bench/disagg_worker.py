"""`python -m pdcluster.bench.disagg_worker <pdcluster serve flags>`: a worker process wired exactly
like `pdcluster serve` plus the disaggregation routes (Disaggregation.from_options). The disaggregation
benchmarks and tests start workers through this so they do not depend on serve_cli's wiring."""

from __future__ import annotations

import argparse
import asyncio


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig
    from pdcluster.worker.server import cli as serve_cli
    from pdcluster.worker.server.app import build_app
    from pdcluster.worker.server.internal_routes import Disaggregation

    parser = argparse.ArgumentParser(prog="disagg_worker")
    serve_cli.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    transfer = serve_cli.transfer_options(args)
    engine = AsyncEngine.from_config(serve_cli.make_config(EngineConfig, serve_cli.engine_config_kwargs(args)))
    disagg = Disaggregation.from_options(engine, args.role, transfer, listen_host=args.host)

    async def start() -> None:
        engine.start()

    async def stop() -> None:
        await asyncio.to_thread(engine.shutdown)

    app = build_app(engine, role=args.role, served_model_name=args.served_model_name or "pdcluster",
                    max_queue_depth=args.max_queue_depth, request_timeout=args.request_timeout,
                    routers=[disagg.router], on_startup=[start, disagg.start], on_shutdown=[disagg.stop, stop],
                    internal_secret=disagg.secret)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
