"""`lorafleet deploy ray`: lorafleet replicas behind Ray Serve's model multiplexing, on a local Ray
cluster (or the one RAY_ADDRESS names), in one command. The deployment is `deploy/ray.py`'s."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import err_console, fail, user_errors

app = typer.Typer(help="Run lorafleet on an existing distributed engine.", no_args_is_help=True)


@app.command("ray")
def ray_(
    model: Annotated[Path | None, typer.Argument(
        help="A Hugging Face model folder, or a base of the store by name. Default: the bundled demo fleet.",
        show_default=False)] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", "-a", metavar="NAME=PATH", help="A PEFT adapter folder every replica may serve; repeat for more.")] = None,
    replicas: Annotated[int, typer.Option("--replicas", "-r", min=1, help="Engines (Serve replicas).")] = 2,
    max_adapters_per_replica: Annotated[int, typer.Option(
        "--max-adapters-per-replica", min=1,
        help="Serve's max_num_models_per_replica: adapters one replica is routed at most.")] = 64,
    pool_bytes: Annotated[str | None, typer.Option(
        "--pool-bytes", metavar="SIZE", help="Each replica's unified page pool, e.g. 2GiB. Default: the engine's.")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda[:N] (each replica's).")] = "cpu",
    replica_cpus: Annotated[float, typer.Option("--replica-cpus", min=0.1, help="CPUs Ray reserves per replica.")] = 1.0,
    replica_gpus: Annotated[float, typer.Option("--replica-gpus", min=0, help="GPUs Ray reserves per replica.")] = 0.0,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The base's name in `model` fields. Default: the model folder's name.")] = None,
    store: Annotated[bool, typer.Option(
        "--store/--no-store", help="Also serve the adapters of the local store by name ($LORAFLEET_HOME).")] = True,
    host: Annotated[str, typer.Option("--host", help="Where Serve's HTTP proxy listens.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Serve's HTTP port.")] = 8000,
) -> None:
    """Serve MODEL and its adapters from REPLICAS lorafleet engines behind Ray Serve: the adapter
    (`model` in the request body) is Serve's multiplexed model id, so a request goes to a replica
    that already holds its adapter. OpenAI-compatible HTTP on Serve's proxy
    (`/v1/completions`, `/v1/chat/completions`, streaming, `/v1/models`). Ctrl-C or SIGTERM stops it.
    Serve's proxy has no API key: keep --host on a private network."""
    from lorafleet.cli.serve import model_folder, parse_adapters, parse_size

    try:
        import ray
        from ray import serve
    except ImportError:
        raise fail("Ray Serve is not installed: pip install 'lorafleet[ray]' (from a clone: pip install -e '.[ray]')") from None
    from lorafleet.deploy.ray import build_app

    with user_errors():
        folders = parse_adapters(adapter)
        folder, stored_name, _, _ = model_folder(model)
        if folder is None:
            from lorafleet.demo import default_fleet

            fleet = default_fleet()
            folder, stored_name, folders = fleet.model, fleet.name, {**fleet.adapters, **folders}
        home = None
        if store:
            from lorafleet.store.store import Store

            home = str(Store().root)
        application = build_app(folder, folders, replicas=replicas, max_adapters_per_replica=max_adapters_per_replica,
                                pool_bytes=parse_size(pool_bytes), device=device,
                                served_model_name=served_model_name or stored_name, store_home=home,
                                replica_cpus=replica_cpus, replica_gpus=replica_gpus)
    ray.init()
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(application, name="lorafleet", route_prefix="/")
        # our own handlers, set once Serve is up: a Ctrl-C that lands while serve.run waits for
        # the replicas is taken by Ray's wait (measured: the command then never stopped)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        err_console.print(f"lorafleet on Ray Serve: {replicas} replicas of {folder.name} with "
                          f"{len(folders)} adapters{' and the store' if home else ''} at http://{host}:{port}/v1 "
                          "(Ctrl-C stops it)", highlight=False)
        stop.wait()
        err_console.print("stopping", highlight=False)
    except KeyboardInterrupt:
        err_console.print("stopping", highlight=False)
    finally:
        serve.shutdown()
        ray.shutdown()
