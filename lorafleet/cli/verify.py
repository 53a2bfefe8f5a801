"""`lorafleet verify`: the served fast path against the torch reference kernels, and transformers/PEFT
where installed, for a model and its adapters, or for what a running daemon serves.

The work (torch, two engines) is `lorafleet.engine.verify`, imported when the command runs; with
`--socket` the daemon is only asked what it serves (its model, adapters, device, dtype and
kernels) and the check runs here, in this process, on the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lorafleet.cli.common import JsonOption, SocketOption, client, err_console, fail, out_console, print_json, user_errors
from lorafleet.config import KERNELS


def parse_adapters(specs: list[str] | None) -> dict[str, Path]:
    """NAME=PATH or PATH (named after its folder) -> name -> folder."""
    out: dict[str, Path] = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or "/" in name or Path(spec).expanduser().exists():
            name, path = Path(spec).expanduser().resolve().name, spec
        if not path:
            raise typer.BadParameter(f"{spec!r}: use NAME=PATH or PATH", param_hint="--adapter")
        if name in out:
            raise typer.BadParameter(f"adapter {name!r} given twice (name one with NAME=PATH)", param_hint="--adapter")
        out[name] = Path(path).expanduser().resolve()
    return out


def verify(
    ctx: typer.Context,
    model: Annotated[Path | None, typer.Argument(
        help="A model folder, a GGUF file or a stored base's name, as `serve` takes it. Default: the daemon on "
             "--socket where one is given (or LORAFLEET_SOCKET set), else the bundled demo fleet.",
        show_default=False)] = None,
    adapter: Annotated[list[str] | None, typer.Option(
        "--adapter", "-a", metavar="NAME=PATH|PATH", help="A PEFT adapter folder to check too; repeat for more.")] = None,
    prompts: Annotated[int, typer.Option("--prompts", min=1, max=64, help="Probe prompts per model and adapter.")] = 4,
    tokens: Annotated[int, typer.Option("--tokens", min=1, max=4096, help="Greedy tokens compared per prompt.")] = 16,
    socket: SocketOption = None,
    device: Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda[:N]. Default: auto (with --socket: "
                                                               "the daemon's).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32, bfloat16 or float16, as `serve --dtype` "
                                                             "(with --socket: the daemon's).")] = None,
    quantize: Annotated[str | None, typer.Option("--quantize", metavar="int8|int4",
                                                 help="As `serve --quantize` (with --socket: the daemon's).")] = None,
    kernels: Annotated[str | None, typer.Option(
        "--kernels", metavar="NAME", help=f"The fast path to check: {', '.join(KERNELS)}. Default: what `serve` "
                                          "picks (LORAFLEET_KERNELS, else auto; with --socket: the daemon's).")] = None,
    transformers: Annotated[bool | None, typer.Option(
        "--transformers/--no-transformers", help="Compare with transformers (and PEFT) too. Default: where installed "
                                                 "and the model is a Hugging Face folder.", show_default=False)] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail (exit 1) on warnings too: an adapter that changes "
                                                          "nothing, tensors its file holds and nothing uses.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Check that the served kernels compute what the reference kernels (and transformers/PEFT) compute.

    Per model and adapter, on fixed probe prompts: the largest prefill logit difference, whether greedy
    tokens agree, how far an adapter moves the logits from the base's, and whether every tensor of its
    file is used. Exit 0 when all agree, 1 on a disagreement (naming the kernels and the difference),
    3 when the daemon of --socket does not answer. Holds a second copy of the weights (a third with
    transformers) while it runs.
    """
    if kernels is not None and kernels not in KERNELS:
        raise typer.BadParameter(f"{kernels!r}: use one of {', '.join(KERNELS)}", param_hint="--kernels")
    named = parse_adapters(adapter)
    source = getattr(ctx.get_parameter_source("socket"), "name", "DEFAULT")  # typer's own click: by name
    if model is not None and source == "COMMANDLINE":
        raise fail("give MODEL or --socket, not both", 2)
    options = {k: v for k, v in (("device", device), ("dtype", dtype), ("quantize", quantize), ("kernels", kernels))
               if v is not None}
    with user_errors():
        if model is None and source in ("COMMANDLINE", "ENVIRONMENT"):
            model, served, options = _daemon(socket, options)
            named = {**served, **named}
        elif model is None:
            from lorafleet.demo import default_fleet

            fleet = default_fleet()
            model, named = fleet.model, {**fleet.adapters, **named}
        else:
            from lorafleet.cli.serve import model_folder

            model = model_folder(model)[0]
            assert model is not None  # a MODEL given resolves to a folder, or raises
        options.setdefault("device", "auto")
        from lorafleet import openmp

        openmp.set_defaults()  # before torch is imported, as `serve` does
        from lorafleet.engine.verify import verify as run

        say = (lambda line: None) if as_json else (lambda line: err_console.print(line, soft_wrap=True))
        report = run(model, named, prompts=prompts, tokens=tokens, transformers=transformers, progress=say,
                     **options)
    failed = not report["ok"] or (strict and report["warnings"])
    if as_json:
        print_json(report)
    else:
        _print(report, failed)
    if failed:
        raise typer.Exit(1)


def _daemon(socket: Path | None, options: dict) -> tuple[Path, dict[str, Path], dict]:
    """What the daemon on `socket` serves: its model's path, its adapters' folders (those it holds;
    not the store's it could resolve) and its engine's settings, under `options` given here."""
    with client(socket) as c:
        engine = c.stats()["engine"]
        cards = c.models()
    label = engine.get("kernels_label") or engine.get("kernels")
    want = label.split("/", 1)[1] if label and "/" in label else label
    settings = {"device": engine.get("device"), "dtype": engine.get("dtype"), "quantize": engine.get("quantization"),
                "kernels": want}
    adapters = {card["id"]: Path(card["root"]) for card in cards
                if card.get("parent") and card.get("root") and (card.get("lorafleet") or {}).get("tier") != "store"}
    return Path(engine["model"]), adapters, {**{k: v for k, v in settings.items() if v}, **options}


def _cell(found: dict | None, notes: list[str]) -> str:
    """A reference's verdict in a cell: max |logit diff| <= tolerance, prompts whose greedy tokens agree."""
    if not found:
        return "-"
    if "skipped" in found:
        if found["skipped"] not in notes:
            notes.append(found["skipped"])
        return f"skipped [{notes.index(found['skipped']) + 1}]"
    g = found["greedy"]
    near = f" ({g['near_ties']} near ties)" if g["near_ties"] else ""
    sign = "<=" if found["max_logit_diff"] <= found["tolerance"] else ">"
    return f"{found['max_logit_diff']:.1e} {sign} {found['tolerance']:.1e}, {g['agree']}/{g['prompts']}{near}"


def _print(report: dict, failed: bool) -> None:
    from rich.table import Table

    quant = f", {report['quantization']}" if report["quantization"] else ""
    console = out_console()
    console.print(f"{report['model']} on {report['device']} ({report['dtype']}{quant}), the {report['kernels']} "
                  f"kernels; {report['prompts']} prompts, {report['tokens']} greedy tokens each. Per reference: the "
                  "largest prefill logit difference against its tolerance, and the prompts whose tokens agree.",
                  soft_wrap=True)
    table = Table(box=None, pad_edge=False)
    for column in ("target", "vs torch", "vs transformers", "adapter"):
        table.add_column(column, overflow="fold")
    notes: list[str] = []
    for t in report["targets"]:
        if "error" in t:
            table.add_row(t["name"], "refused", "", "")
            continue
        adapter = []
        if "effect" in t:
            adapter.append("changes nothing" if t["changes_nothing"] else f"moves logits {t['effect']:.2g}")
            adapter.append(f"{t['tensors']['used']}/{t['tensors']['in_file']} tensors used")
        table.add_row(t["name"], _cell(t.get("torch"), notes), _cell(t.get("transformers"), notes), ", ".join(adapter))
    console.print(table)
    for i, note in enumerate(notes, 1):
        console.print(f"[{i}] {note}", soft_wrap=True)
    for line in report["warnings"]:
        err_console.print(f"warning: {line}", soft_wrap=True)
    for line in report["problems"]:
        err_console.print(f"error: {line}", soft_wrap=True)
    if not failed:
        console.print(f"ok: the {report['kernels']} kernels agree with the references on all "
                      f"{len(report['targets'])} targets", soft_wrap=True)
    elif report["ok"]:
        err_console.print("error: warnings, and --strict", soft_wrap=True)
