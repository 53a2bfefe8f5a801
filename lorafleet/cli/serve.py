"""`lorafleet serve`: run the daemon in the foreground (or detached, with --detach).

Its defaults come from `$LORAFLEET_HOME/config.toml` and `--lora-modules` reads as vLLM's
(`serve_config.ServeCommand`, the command's class). The engine, the server and torch are
imported only when the daemon starts.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Annotated, overload

import typer

from lorafleet import paths
from lorafleet.cli.common import SocketOption, err_console, fail, user_errors
from lorafleet.cli.detach import rebuild_argv, start_detached

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


@overload
def parse_size(text: str, option: str = ...) -> int: ...
@overload
def parse_size(text: str | None, option: str = ...) -> int | None: ...


def parse_size(text: str | None, option: str = "--pool-bytes") -> int | None:
    """'2GiB', '512M', '1073741824' -> bytes (K, M, G, T are powers of 1024)."""
    if text is None:
        return None
    m = _SIZE.match(text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a size (say 2GiB, 512M or a number of bytes)",
                                 param_hint=option)
    number, unit = float(m.group(1)), m.group(2).lower()
    return int(number * 1024 ** ("kmgt".index(unit) + 1)) if unit else int(number)


ADAPTER_HINT = "--adapter / --lora-modules"


def parse_adapters(specs: list[str] | None) -> dict[str, Path]:
    """NAME=PATH, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}` (the
    base's name is accepted and not checked: one daemon serves one base), -> name -> folder."""
    out = {}
    for spec in specs or []:
        name, path = _adapter_spec(spec)
        if name in out:
            raise typer.BadParameter(f"adapter {name!r} given twice", param_hint=ADAPTER_HINT)
        out[name] = Path(path).expanduser().resolve()
    return out


def _adapter_spec(spec: str) -> tuple[str, str]:
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as e:
            raise typer.BadParameter(f"{spec!r} is not JSON: {e}", param_hint=ADAPTER_HINT) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str) \
                or not obj["name"] or not obj["path"] or set(obj) - {"name", "path", "base_model_name"}:
            raise typer.BadParameter(f"{spec!r}: use {{\"name\": NAME, \"path\": PATH}} (and optionally "
                                     "\"base_model_name\"), with string values", param_hint=ADAPTER_HINT)
        return obj["name"], obj["path"]
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise typer.BadParameter(f"{spec!r}: use NAME=PATH", param_hint=ADAPTER_HINT)
    return name, path


def serve(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Argument(
        help="A Hugging Face model folder (config.json, safetensors, tokenizer.json), a GGUF file, ollama:NAME[:TAG] "
             "(the local Ollama store's), or the name of a base in the store (`lorafleet pull SOURCE --base`). Default: the bundled "
             "demo fleet (a tiny echo model and its skill adapters: upper, reverse, ...).",
        show_default=False)] = None,
    socket: SocketOption = None,
    host: Annotated[str | None, typer.Option("--host", help="Also listen on TCP at this address (needs --port and --api-key).")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Also listen on TCP at this port (on --host, else 127.0.0.1).")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="LORAFLEET_API_KEY",
        help="The key TCP clients send as `Authorization: Bearer KEY` on /v1 routes.")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        "--served-model-name", help="The base's name in `model` fields. Default: the model folder's name.")] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", "-a", "--lora-modules", metavar="NAME=PATH",
        help="Load a PEFT adapter folder at start; repeat for more. --lora-modules is vLLM's spelling: it "
             "also takes several after one flag, and vLLM's JSON form {\"name\": ..., \"path\": ...}.")] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda[:N].")] = "auto",
    pool_bytes: Annotated[str | None, typer.Option(
        "--pool-bytes", metavar="SIZE", help="The unified page pool (KV + adapters), e.g. 2GiB. "
                                              "Default: 1 GiB on CPU, most free memory on a GPU.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32, bfloat16 or float16. Default: fp32 on CPU, the checkpoint's on GPU.")] = None,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4", help="Quantize a full-precision base's projections and LM head as it "
                                                "loads (weight-only; activations, KV and adapters keep --dtype). A base "
                                                "pulled with --quantize, or a GGUF file, is served in its own scheme.")] = None,
    lora_dtype: Annotated[str | None, typer.Option(
        "--lora-dtype", metavar="auto|bfloat16|float16", help="The adapters' weights in the pool: auto (--dtype), or "
        "bfloat16 / float16 under a float32 model (a quantized base's too): half the bytes a step reads per adapter "
        "and twice the adapters in the same pool; each logit within 2^-5 (bf16) of the adapter's own effect.")] = None,
    quantized_prefill: Annotated[str | None, typer.Option(
        "--quantized-prefill", metavar="float32|bfloat16", help="A quantized base's prefill matmuls under a float32 "
        "model: bfloat16 runs them as bf16 GEMMs (faster where the CPU has bf16 dot products: AVX512_BF16, AMX), "
        "each logit within 2^-4 of the largest; decode steps keep float32. Default: float32.")] = None,
    temperature: Annotated[float | None, typer.Option(
        "--temperature", min=0, help="The sampling defaults where a request names none (also --top-p, --top-k, "
        "--min-p). Default: the model's generation_config.json; a GGUF file's: llama.cpp's (0.8, 0.95, 40, 0.05); "
        "an Ollama model's: its params.")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", min=0, max=1)] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=-1)] = None,
    min_p: Annotated[float | None, typer.Option("--min-p", min=0, max=1)] = None,
    max_num_seqs: Annotated[int, typer.Option("--max-num-seqs", min=1, help="Sequences in one step.")] = 256,
    max_model_len: Annotated[int | None, typer.Option("--max-model-len", min=2, help="Context length. Default: the model's.")] = None,
    max_pending: Annotated[int, typer.Option(
        "--max-pending", min=1, help="Requests admitted at once (running + waiting); more are answered 429.")] = 1024,
    max_body_bytes: Annotated[str, typer.Option(
        "--max-body-bytes", metavar="SIZE",
        help="The largest request body accepted, e.g. 4MiB; a larger one is answered 413 before it is read.")] = "4MiB",
    drain_timeout: Annotated[float, typer.Option(
        "--drain-timeout", min=0, help="Seconds SIGTERM/SIGINT waits for in-flight requests before exiting.")] = 30.0,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every HTTP request.")] = False,
    header_timeout: Annotated[float, typer.Option(
        "--header-timeout", min=0.001, help="Seconds a connection has to send a request's headers, from when it "
                                            "opens or its next request begins; then it is closed.")] = 10.0,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", min=0.001, help="Seconds a keep-alive connection may wait for its next request.")] = 30.0,
    max_tcp_connections: Annotated[int, typer.Option(
        "--max-tcp-connections", min=1, help="TCP connections open at once (with --host); more are closed as "
                                             "they open. The Unix socket has no cap.")] = 256,
    resolve: Annotated[bool, typer.Option(
        "--resolve/--no-resolve", help="Serve an adapter of the store on its first request by name, "
                                      "without a load call (and its new weights after a re-pull).")] = True,
    prefix_cache: Annotated[bool, typer.Option(
        "--prefix-cache/--no-prefix-cache", help="Reuse the KV of prompt prefixes computed before under the "
                                                 "same adapter weights.")] = True,
    async_decode: Annotated[str, typer.Option(
        "--async-decode", metavar="auto|on|off", help="Read each step's tokens after launching the next, "
        "so the host's work hides behind the GPU's (auto: on with CUDA).")] = "off",
    self_check: Annotated[bool, typer.Option(
        "--self-check/--no-self-check", help="Before serving, compare the kernels' logits on one short prompt with "
                                             "the torch reference's on the same weights, and refuse to start when they "
                                             "disagree (a second copy of the weights while it runs; `lorafleet verify` "
                                             "checks more).")] = True,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Start the daemon in the background and return once it answers.")] = False,
    log_file: Annotated[Path | None, typer.Option(
        "--log-file", metavar="PATH", help="With --detach: where the daemon logs. Default: $LORAFLEET_HOME/logs/"
                                           "daemon.log (for another socket than the default, a file of its own).")] = None,
    enable_lora: Annotated[bool, typer.Option("--enable-lora", hidden=True)] = False,  # vLLM's launch flags: VLLM_FLAGS
    max_loras: Annotated[int | None, typer.Option("--max-loras", hidden=True)] = None,
    max_lora_rank: Annotated[int | None, typer.Option("--max-lora-rank", hidden=True)] = None,
    max_cpu_loras: Annotated[int | None, typer.Option("--max-cpu-loras", hidden=True)] = None,
    gpu_memory_utilization: Annotated[float | None, typer.Option("--gpu-memory-utilization", hidden=True)] = None,
    print_config: Annotated[bool, typer.Option(
        "--print-config", help="Print the settings this command line would use (as TOML: each with where it came "
                               "from) and exit without starting.")] = False,
) -> None:
    """Run the daemon: one base model, many LoRA adapters, an OpenAI-compatible API on a Unix socket.

    Defaults come from the [serve] table of $LORAFLEET_HOME/config.toml; flags win.
    SIGTERM or Ctrl-C drains in-flight requests (up to --drain-timeout seconds), then exits 0.
    """
    with user_errors():
        sock = paths.socket_path(socket)
        if print_config:  # checked as serve checks them: a value serve would refuse is refused here
            from lorafleet.cli.serve_config import print_config as show

            checked_settings(ctx.params, sock)
            return show(ctx, sock, log_file or paths.log_file(sock))
        model, stored_name, extra, sampling = model_folder(model)
        served_model_name = served_model_name or stored_name
        if extra:  # an Ollama model's adapters, served beside its base
            ctx.params["adapter"] = [*extra, *(ctx.params.get("adapter") or [])]
        for field, value in sampling.items():  # an Ollama model's params, where the command line names none
            if ctx.params.get(field) is None:
                ctx.params[field] = value
        config, engine_options, adapters = checked_settings({**ctx.params, "served_model_name": served_model_name},
                                                            sock)
        if (ignored := vllm_flags_warning(ctx.params)) is not None:
            err_console.print(f"warning: {ignored}", highlight=False)
        if detach:
            argv = rebuild_argv(ctx.command, ctx.params, model=str(model) if model else None, socket=str(sock),
                                 served_model_name=served_model_name)
            return start_detached(argv, sock, log_file, api_key)
        _setup_logging()
        from lorafleet import openmp

        openmp.set_defaults()  # before the engine imports torch
        try:
            _run(model, config, engine_options, adapters, resolve)
        except KeyboardInterrupt:  # before the daemon took over the signals: nothing to drain
            raise fail("interrupted before the daemon started") from None


# vLLM's launch flags, taken so that its scripts start lorafleet unchanged, and ignored with one line
# saying why (the pool has no slots or rank cap to set)
VLLM_FLAGS = {"enable_lora": "--enable-lora", "max_loras": "--max-loras", "max_lora_rank": "--max-lora-rank",
              "max_cpu_loras": "--max-cpu-loras", "gpu_memory_utilization": "--gpu-memory-utilization"}


def vllm_flags_warning(params: dict) -> str | None:
    given = [flag for name, flag in VLLM_FLAGS.items() if params.get(name) not in (None, False)]
    if not given:
        return None
    return (f"ignored vLLM's {', '.join(given)}: lorafleet has no adapter slots nor rank cap (every adapter takes pool "
            "pages by its rank, KV and adapters share the pool); size the pool with --pool-bytes")


def checked_settings(params: dict, sock: Path) -> tuple:
    """(ServerConfig, the engine's options, the start-up adapters) from `serve`'s parsed parameters
    (`params`, by name), checked as the daemon checks them (sizes, ranges, choices; nothing here
    imports torch), so that a bad value fails the command at once. `service install` checks its
    arguments with this too. A usage error (typer.BadParameter) or a ConfigError names the problem."""
    from lorafleet.config import EngineConfig, ServerConfig

    host = params["host"] if params["host"] or params["port"] is None else "127.0.0.1"  # --port alone: loopback
    config = ServerConfig(socket=str(paths.check_socket_path(sock)), host=host, port=params["port"],
                          api_key=params["api_key"], served_model_name=params["served_model_name"],
                          max_pending=params["max_pending"],
                          max_body_bytes=parse_size(params["max_body_bytes"], "--max-body-bytes"),
                          drain_timeout=params["drain_timeout"], access_log=params["access_log"],
                          header_timeout=params["header_timeout"], idle_timeout=params["idle_timeout"],
                          max_tcp_connections=params["max_tcp_connections"],
                          sampling={k: params[k] for k in SAMPLING if params.get(k) is not None})
    if params.get("top_p") == 0:
        raise typer.BadParameter("0 keeps no token; top-p is in (0, 1]", param_hint="--top-p")
    engine_options = {name: params[name] for name in ("device", "dtype", "quantize", "lora_dtype", "quantized_prefill",
                                                      "max_num_seqs", "max_model_len", "prefix_cache", "async_decode",
                                                      "self_check")}
    engine_options["pool_bytes"] = parse_size(params["pool_bytes"])
    EngineConfig(**{k: v for k, v in engine_options.items() if v is not None})  # raises what the engine would
    return config, engine_options, parse_adapters(params["adapter"])


SAMPLING = ("temperature", "top_p", "top_k", "min_p")  # serve's sampling defaults, by request field


def model_folder(model: Path | None) -> tuple[Path | None, str | None, list[str], dict]:
    """MODEL as a folder: a path that exists (a folder, or a GGUF file: then its name less .gguf
    is the default served name), else `ollama:NAME[:TAG]` (the local Ollama store's model: its GGUF
    base, named NAME, or NAME-base with its adapters as NAME, NAME-2...: those are the third
    item, as NAME=PATH, its params' sampling fields the fourth), else a base of the store by that
    name (then its name too, the default served name); a path that is none of these is a clear error."""
    if model is None:
        return None, None, [], {}
    from lorafleet.store import ollama

    if ollama.is_ref(str(model)):
        om = ollama.resolve(str(model))
        adapters = [f"{om.name if i == 0 else f'{om.name}-{i + 1}'}={a}" for i, a in enumerate(om.adapters)]
        from lorafleet.model.config import sampling_fields

        return om.model, f"{om.name}-base" if adapters else om.name, adapters, sampling_fields(om.params)
    folder = model.expanduser()
    if folder.is_file():
        if folder.suffix.lower() != ".gguf":
            raise fail(f"{model}: a file, but not a GGUF model (*.gguf); MODEL is a model folder, a .gguf file or "
                       "the name of a stored base")
        return folder.resolve(), folder.stem, [], {}
    if folder.exists():
        return folder.resolve(), None, [], {}
    from lorafleet.errors import StoreError
    from lorafleet.store.store import Store

    store = Store()
    try:
        manifest = store.get("models", str(model))
    except StoreError:
        raise fail(f"{model}: neither a model folder nor a base in the store ({store.root}); "
                   "pull one with `lorafleet pull SOURCE --base --name NAME`") from None
    return store.folder(manifest).resolve(), manifest["name"], [], {}


def _run(model: Path | None, config, engine_options: dict, adapters: dict[str, Path], resolve: bool = True) -> None:
    log = logging.getLogger("lorafleet.server")
    if model is None:
        from lorafleet.demo import default_fleet

        fleet = default_fleet()
        model, name = fleet.model, fleet.name
        adapters = {**fleet.adapters, **adapters}
        log.info("no MODEL given: serving the bundled demo fleet (%s and the adapters %s); try `%s`", name,
                 ", ".join(fleet.adapters), paths.command_for(Path(config.socket), "chat", "--adapter", "reverse", "hello world"))
    else:
        name = model.name
    name = config.served_model_name or name

    def build_engine():
        from lorafleet.engine.engine import Engine

        options = {k: v for k, v in engine_options.items() if v is not None}
        log.info("loading %s (%s)", model, ", ".join(f"{k}={v}" for k, v in options.items()))
        return Engine(model, **options)

    from lorafleet.server.daemon import serve as run_daemon

    resolver = None
    if resolve:
        from lorafleet.store.resolver import StoreResolver
        from lorafleet.store.store import Store

        resolver = StoreResolver(Store())
    run_daemon(build_engine, config, name, str(model), adapters, resolver)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # a file's: one line an event, dated


def _setup_logging() -> None:
    """On a terminal, rich's columns (time, level, message); anywhere else (the log file of
    `--detach` and of the service, a pipe) one plain line per event with its date and time, for
    grep and `lorafleet logs`."""
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=False,
                                               markup=False, log_time_format="[%X]")
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
