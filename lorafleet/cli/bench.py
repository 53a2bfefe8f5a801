"""`lorafleet bench run|quick|full|mix|llama-cpp|lora-decode|decode-bound|switch|overhead|store-load|stats-cost|gpu`: one
subcommand per benchmark, each with only the options it uses. The bench code (and with it torch)
is imported only when a subcommand runs."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from lorafleet.cli import bench_suites as suites
from lorafleet.cli.common import err_console, json_errors, user_errors

ALL_SYSTEMS = "lorafleet,transformers,peft-groups,peft-mixed,merged"
PEER_WORKLOADS = ("peer-base", "peer-one-adapter", "peer-round-robin")  # bench llama-cpp's
MIX_SYSTEMS = "lorafleet,peft-groups,peft-mixed"  # bench mix's: lorafleet and PEFT's two ways to serve merged mixes

app = typer.Typer(
    help="Measure lorafleet, and the systems users would pick instead, on random models and "
         "adapters built locally (cached in $LORAFLEET_HOME/bench).",
    no_args_is_help=True, rich_markup_mode="markdown")


def _models(default: str) -> object:
    return typer.Option("--model", "-m", metavar="SHAPE",
                        help=f"Model shape: micro, tiny, smol (SmolLM2-135M's shapes), 1b (Llama-3.2-1B's) or 8b "
                             f"(Llama-3-8B's: weights made in memory; on the CPU with --quantize int4 only). Repeat "
                             f"for several. Default: {default}.")


Systems = Annotated[str, typer.Option(
    "--systems", help="Comma-separated systems to run: lorafleet, transformers (base model only), "
                      "lorafleet-daemon (the same through `lorafleet serve` over its socket), "
                      "llama.cpp (llama-server, built once from llama-cpp-python's sources), "
                      "peft-groups (set_adapter per adapter group), peft-mixed (adapter_names "
                      "batches), merged (memory accounting only), lorafleet-no-prefix-cache and "
                      "lorafleet-lru (lorafleet with its prefix cache off; with plain LRU eviction).")]
MaxBaseline = Annotated[int | None, typer.Option(
    "--max-baseline-requests", min=1, metavar="N",
    help="Baselines serve only the first N requests (PEFT over hundreds of adapters would take "
         "hours); the report says so.")]
Out = Annotated[str | None, typer.Option(  # str: a Path would drop the trailing / that says "a directory"
    "--out", "-o", metavar="PATH",
    help="Where to write the JSON report (and any PNG plots next to it): a file, or a directory "
         "(existing, or ending in /) to get TIMESTAMP.json. Default: ./bench-results/TIMESTAMP.json")]
AsJson = Annotated[bool, typer.Option("--json", callback=json_errors, help="Print the JSON report on stdout "
                                      "instead of the tables; errors too, as JSON on stderr.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu or cuda[:N].")]
Threads = Annotated[int | None, typer.Option("--threads", min=1, help="torch threads. Default: all cores.")]
Quick = Annotated[bool, typer.Option("--quick", help="A smoke run: the micro shape, fewer steps.")]
Quantize = Annotated[str | None, typer.Option(
    "--quantize", metavar="int8|int4",
    help="Serve the base quantized (weight-only, as `lorafleet serve --quantize`: int8 a scale per output "
         "channel, int4 Q4_0's groups of 32; fp16 scales). llama.cpp then gets the same model as Q8_0 or Q4_0; "
         "the systems that serve full precision only are skipped.")]


@app.command("run")
def run(
    model: Annotated[list[str] | None, _models("tiny")] = None,
    workload: Annotated[list[str] | None, typer.Option(
        "--workload", "-w",
        help="Workload: uniform-8, uniform-1000, uniform-1000-tiered, zipf-1000, mixed-lengths, "
             "cold-start, shared-prefix, shared-prefix-pressure, base-only, peer-base, peer-one-adapter, "
             "peer-round-robin, mix, mix-single, dora-mixed, dora-plain, saved-head-mixed or quick. Repeat for "
             "several, run in turn, with lorafleet's tokens/s compared across uniform-1000 and uniform-8, "
             "uniform-1000-tiered and uniform-1000, mix and mix-single, dora-mixed and dora-plain, "
             "saved-head-mixed and dora-plain. Default: base-only.")] = None,
    systems: Systems = ALL_SYSTEMS,
    sweep: Annotated[str | None, typer.Option(
        "--sweep", metavar="N,N,...",
        help="Also run lorafleet on the workload's requests over each number of adapters and "
             "plot throughput against it (e.g. 1,8,64,256).")] = None,
    max_baseline_requests: MaxBaseline = None, quantize: Quantize = None,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """Throughput: every system on the same workload's requests, side by side.

    Every system runs in a process of its own, warms up untimed, then replays the workload's
    arrivals in real time, at least 3 times and 1 s of serving (at most 5 times or 5 s); the
    median replay counts, and the CPU other processes took meanwhile is measured and flagged.
    Reports tokens/s, requests/s, TTFT/TPOT p50/p99, exposed adapter-load time, peak RSS, pool
    occupancy, ratios, memory against merged copies, the switch regression (table, slope among
    steps of the same shape, PNG) and, with --sweep, throughput against the number of adapters.
    """
    suites.throughput(model or ["tiny"], workload or ["base-only"], systems, suites.parse_sweep(sweep or ""),
                max_baseline_requests, device, threads, out, as_json, quantize)


@app.command("quick")
def quick(
    model: Annotated[list[str] | None, _models("micro and tiny")] = None,
    systems: Systems = ALL_SYSTEMS, quantize: Quantize = None,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """A smoke run in a few minutes: the quick workload (8 short requests, 4 adapters and the
    base) on every system, and lorafleet's throughput over 1 and 4 adapters."""
    suites.throughput(model or ["micro", "tiny"], ["quick"], systems, (1, 4), None, device, threads, out, as_json,
                      quantize)


@app.command("full")
def full(
    model: Annotated[list[str] | None, _models("tiny")] = None,
    systems: Systems = f"{ALL_SYSTEMS},lorafleet-daemon",
    max_baseline_requests: Annotated[int, typer.Option(
        "--max-baseline-requests", min=1, metavar="N",
        help="Baselines serve only the first N requests of each workload; the report says so.")] = 64,
    quantize: Quantize = None,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """Every workload except quick, every system, and the adapter sweep 1, 8, 64, 256, 1000 on
    uniform-1000's requests: one report per workload and a summary; states its duration."""
    suites.throughput(model or ["tiny"], None, systems, (), max_baseline_requests, device, threads, out, as_json,
                      quantize)


@app.command("mix")
def mix(
    model: Annotated[list[str] | None, _models("tiny")] = None,
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated systems to run on the mix workload, of those `bench run` takes (one "
                          "that cannot serve mixes is reported skipped); the lorafleet ones among them also run "
                          "mix-single.")] = MIX_SYSTEMS,
    max_baseline_requests: MaxBaseline = None,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """The mix figures, in one run on one machine: lorafleet on the mix workload (64 requests,
    each a mix of 2 of 8 adapters of ranks 16-64, at scales 1 or 0.5) against the same requests on
    single adapters of the summed ranks (mix-single: the same LoRA bytes a step; target >= 0.8x),
    and against PEFT serving the mixes as merged adapters built per mix, the merges timed
    (peft-groups: set_adapter per mix; peft-mixed: adapter_names batches; target >= 5x). One
    report per workload and all of them in --out; the table gives each figure and the ratios."""
    from lorafleet.bench.report import resolve_out_path
    from lorafleet.bench.systems import SYSTEM_NAMES, get_system

    names = list(dict.fromkeys(s.strip() for s in systems.split(",") if s.strip()))
    shapes = model or ["tiny"]
    suites.check_shapes(shapes)
    suites.check_choices("--systems", names or [""], SYSTEM_NAMES)
    suites.check_quantize(None, shapes, cpu=device == "cpu")
    suites.require(shapes, names, plots=True)
    if "llama.cpp" in names:
        suites.llama_server()
    subjects = tuple(n for n in names if get_system(n).subject)
    path = resolve_out_path(out)
    with user_errors():
        from lorafleet.bench.runner import run_suite

        report = run_suite(shapes, path, workloads=("mix", "mix-single") if subjects else ("mix",),
                           systems=tuple(names), only={"mix-single": subjects}, sweeps={}, name="mix", device=device,
                           threads=threads, max_baseline_requests=max_baseline_requests, console=err_console)
    from lorafleet.bench.tables import mix_tables

    suites.tables_out(report, path, as_json, lambda: mix_tables(report.get("mix", [])))


@app.command("llama-cpp")
def llama_cpp(
    model: Annotated[list[str] | None, _models("tiny")] = None,
    workload: Annotated[list[str] | None, typer.Option(
        "--workload", "-w",
        metavar="NAME",
        help="peer-base, peer-one-adapter or peer-round-robin; repeat for several. Default: all three.")] = None,
    in_flight: Annotated[list[int] | None, typer.Option(
        "--in-flight", min=1, metavar="N",
        help="Requests in flight (a closed loop); repeat for several. Default: 1 and 8.")] = None,
    systems: Annotated[str, typer.Option(
        "--systems", help="Comma-separated systems, of those `bench run` takes that replay a closed loop: "
                          "lorafleet-daemon and llama.cpp.")] = "lorafleet-daemon,llama.cpp",
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="Threads of each system: lorafleet's torch threads, llama-server's -t and -tb. "
                                 "Default: all cores.")] = None,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4|TYPE",
        help="Both on the same base quantized: lorafleet quantizes it as it loads (`serve --quantize`), "
             "llama-server gets it as Q8_0 (int8: the converter's --outtype q8_0) or Q4_0 (int4: llama-quantize "
             "--pure; the tool is built once beside the server); adapters stay f32. TYPE (Q4_K_M, Q6_K, Q4_1...): "
             "both serve the one file llama-quantize writes, and the same GGUF adapters.")] = None,
    lora_dtype: Annotated[str, suites.LORA_DTYPE] = "auto",
    quantized_prefill: Annotated[str, suites.QUANTIZED_PREFILL] = "float32",
    out: Out = None, as_json: AsJson = False,
) -> None:
    """lorafleet through its daemon against llama.cpp's llama-server, on the CPU in f32 (or both
    quantized: --quantize): the same random model and PEFT adapters (converted to GGUF), 64
    requests of 64 + 64 tokens replayed as streaming HTTP calls with N in flight, greedy. Each
    workload at each N, then one table: tokens/s, TTFT p99, the ratio and its target.
    llama-server is built once (minutes) from the llama.cpp that llama-cpp-python's sdist
    vendors, or taken from LORAFLEET_LLAMA_SERVER."""
    from lorafleet.bench.report import resolve_out_path

    loads = list(dict.fromkeys(workload or PEER_WORKLOADS))
    counts = list(dict.fromkeys(in_flight or [1, 8]))
    names = [s.strip() for s in systems.split(",") if s.strip()]
    shapes = model or ["tiny"]
    suites.check_shapes(shapes)
    suites.check_choices("--workload", loads, PEER_WORKLOADS)
    suites.check_choices("--systems", names or [""], ("lorafleet-daemon", "llama.cpp"))
    suites.check_quantize(quantize, shapes, cpu=True, files=True)
    suites.check_precision(lora_dtype, quantized_prefill)
    suites.require(shapes, names)
    if "llama.cpp" in names:
        suites.llama_server(quantize)
    path = resolve_out_path(out)
    with user_errors():
        from lorafleet.bench.runner import run_suite
        from lorafleet.bench.workloads import get_workload

        variants = tuple(get_workload(w).with_concurrency(n) for w in loads for n in counts)
        report = run_suite(shapes, path, workloads=variants, systems=tuple(names), sweeps={}, name="llama-cpp",
                           device="cpu", threads=threads, quantize=quantize, lora_dtype=lora_dtype,
                           quantized_prefill=quantized_prefill, console=err_console)
    from lorafleet.bench.tables import peer_tables

    suites.tables_out(report, path, as_json, lambda: peer_tables(report))


@app.command("lora-decode")
def lora_decode(
    model: Annotated[list[str] | None, _models("tiny (micro with --quick)")] = None,
    batch: Annotated[int, typer.Option(
        "--batch", min=1, help="Requests (and distinct adapters) per decode step.")] = 32,
    peft: Annotated[bool, typer.Option("--peft/--no-peft", help="Also run PEFT's mixed-adapter batch.")] = True,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4",
        help="The base quantized as it loads, the adapters fp32; no PEFT run (it would run the fp32 base).")] = None,
    quick: Quick = False, threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """The cost of one decode step over BATCH requests: without adapters, all on one adapter and
    on BATCH distinct adapters (ranks 8-64 on all 7 projections); the LoRA op against one read
    of those adapters' weights at the bandwidth measured in the same run; tokens/s against
    PEFT's mixed-adapter batch. With --quantize, the same on an int8 or int4 base."""
    with_peft = peft and not quick and not quantize

    def one(shape: str) -> dict:
        from lorafleet.bench.lora_decode import run_lora_decode

        return run_lora_decode(shape, batch=batch, steps=4 if quick else 16, rounds=1 if quick else 3,
                               peft=peft and not quick, threads=threads, progress=suites.say, quantize=quantize)
    shapes = model or (["micro"] if quick else ["tiny"])
    suites.check_shapes(shapes)
    suites.check_quantize(quantize, shapes, cpu=True)
    needs = {m: "PEFT's mixed-adapter batch, which --no-peft leaves out" for m in ("transformers", "peft")}
    suites.suite("lora-decode", shapes, one, "lora_decode_table", out, as_json, needs=needs if with_peft else None)


@app.command("decode-bound")
def decode_bound(
    model: Annotated[list[str] | None, _models("tiny and smol (micro with --quick)")] = None,
    batch: Annotated[list[int] | None, typer.Option(
        "--batch", min=1, help="Requests decoding together; repeat for more. Default: 1, 8 and 32.")] = None,
    dtype: Annotated[str, typer.Option(
        "--dtype", help="float32 or bfloat16 (the weights' bytes halve; sums stay fp32).")] = "float32",
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4",
        help="The base quantized as it loads (--dtype is then the activations'): the bound counts the codes and "
             "the fp16 scales a step reads; the report sets the base's bytes against fp32's.")] = None,
    gguf_type: Annotated[str | None, typer.Option(
        "--gguf-type", metavar="TYPE",
        help="The base as llama-quantize writes it in TYPE (Q4_K_M, Q6_K, Q4_1...), served from that GGUF file; "
             "the report gives the step against the file's bytes too.")] = None,
    quick: Quick = False, threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """A decode step of the base model (no adapters) at each batch size against its memory
    bound: the step's weight bytes over the read bandwidth measured in the same run; beside it,
    the step's matmuls alone against the same bound. With --quantize, the bytes are the
    quantized codes and their scales, and the base's memory is set against fp32's."""
    suites.check_choices("--dtype", [dtype], ("float32", "bfloat16"))

    def one(shape: str) -> dict:
        from lorafleet.bench.decode_bound import run_decode_bound

        return run_decode_bound(shape, batches=tuple(batch or (1, 8, 32)), steps=4 if quick else 16,
                                rounds=1 if quick else 3, threads=threads, dtype=dtype, quantize=quantize,
                                progress=suites.say, gguf_type=gguf_type)
    shapes = model or (["micro"] if quick else ["tiny", "smol"])
    suites.check_shapes(shapes)
    suites.check_quantize(quantize, shapes, cpu=True)
    suites.suite("decode-bound", shapes, one, "decode_bound_table", out, as_json)


@app.command("switch")
def switch(
    model: Annotated[list[str] | None, _models("smol (micro with --quick)")] = None,
    source: Annotated[str, typer.Option("--source", help="store: the adapters are pulled into a store and "
                                        "loaded from it (no hashing, no re-validation); folder: loaded as "
                                        "folders (read, validated, hashed).")] = "store",
    quick: Quick = False, out: Out = None, as_json: AsJson = False,
) -> None:
    """The switch cost, isolated: per-token latency of a fixed-shape decode batch against the
    adapters landing in each step, loaded in the background for waiting requests."""
    suites.check_choices("--source", [source], ("store", "folder"))

    def one(shape: str) -> dict:
        from lorafleet.bench.switch_cost import run_switch_cost

        return run_switch_cost(shape, batch=8 if quick else 32, cold=16 if quick else 96, steps=8 if quick else 48,
                               source=source)
    suites.suite("switch", model or (["micro"] if quick else ["smol"]), one, "switch_cost_table", out, as_json)


@app.command("overhead")
def overhead(
    model: Annotated[list[str] | None, _models("tiny")] = None,
    running: Annotated[int, typer.Option("--running", min=1, help="Requests decoding together.")] = 64,
    adapters: Annotated[int, typer.Option("--adapters", min=1, help="Adapters they use, in turn.")] = 8,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Decode steps timed.")] = 32,
    burst: Annotated[int, typer.Option("--burst", min=1, help="Requests added at once to a fresh engine.")] = 1000,
    quantize: Annotated[str | None, typer.Option(
        "--quantize", metavar="int8|int4", help="The base quantized as it loads (targets judged in fp32 only).")] = None,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Decode sampled, not greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="With --temperature.")] = 1.0,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """The engine's time around the model, from its own step records: the host-side share of a
    decode step (schedule, batch build, sampling, output processing; target <= 15% on tiny, 64
    requests over 8 adapters, greedy) and the time to add 1,000 requests at once (target < 50 ms)."""
    def one(shape: str) -> dict:
        from lorafleet.bench.overhead import run_overhead

        return run_overhead(shape, running=running, num_adapters=adapters, steps=steps, burst=burst, device=device,
                            threads=threads, progress=suites.say, quantize=quantize, temperature=temperature,
                            top_p=top_p)
    shapes = model or ["tiny"]
    suites.check_shapes(shapes)
    suites.check_quantize(quantize, shapes, cpu=device == "cpu")
    suites.suite("overhead", shapes, one, "overhead_table", out, as_json)


@app.command("store-load")
def store_load(
    model: Annotated[list[str] | None, _models("smol")] = None,
    rank: Annotated[int, typer.Option("--rank", min=1, help="The adapter's rank (on q/k/v/o_proj).")] = 16,
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed loads of each kind.")] = 20,
    out: Out = None, as_json: AsJson = False,
) -> None:
    """The CPU one adapter load costs (disk -> host -> pool pages) from the store, which trusts
    the validation and digest of the pull, against the same files loaded as a folder (read,
    validated, hashed); median CPU time of the loading thread, both in one run (target: <= 3 ms
    for rank 16 on q/k/v/o of smol)."""
    def one(shape: str) -> dict:
        from lorafleet.bench.store_load import run_store_load

        return run_store_load(shape, rank=rank, repeats=repeats)
    suites.suite("store-load", model or ["smol"], one, "store_load_table", out, as_json)


@app.command("stats-cost")
def stats_cost(
    model: Annotated[list[str] | None, _models("smol")] = None,
    adapters: Annotated[int, typer.Option("--adapters", min=1, help="Adapters registered in the engine.")] = 1000,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Requests decoding together.")] = 16,
    steps: Annotated[int, typer.Option(
        "--steps", min=1, help="Steps in the engine's log before the polls are timed (its live switch "
                               "regression covers the last 1,000).")] = 1000,
    polls: Annotated[int, typer.Option("--polls", min=1, help="Polls timed between steps.")] = 50,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Runs of the workload without polls, and as many with one a second.")] = 3,
    device: Device = "auto", threads: Threads = None, out: Out = None, as_json: AsJson = False,
) -> None:
    """What `GET /v1/stats` costs the engine: ADAPTERS adapters registered, a decode workload
    mixing them until the step log holds STEPS steps, then one poll (engine_snapshot on the engine
    thread, then its JSON as the route writes it) timed between steps: median and p99, and the
    mean as a share of the second between polls at one poll a second (target < 1%); the same
    workload without polls and with one a second, interleaved, tokens/s of each and their ratio;
    a profile of a poll."""
    def one(shape: str) -> dict:
        from lorafleet.bench.stats_cost import run_stats_cost

        return run_stats_cost(shape, num_adapters=adapters, batch=batch, min_steps=steps, polls=polls, rounds=rounds,
                              device=device, threads=threads, progress=suites.say)
    suites.suite("stats-cost", model or ["smol"], one, "stats_cost_table", out, as_json)


@app.command("gpu")
def gpu(
    model: Annotated[list[str] | None, _models("1b (micro with --quick)")] = None,
    batch: Annotated[list[int] | None, typer.Option(
        "--batch", min=1, help="Requests decoding together (repeat for several): 64.")] = None,
    many: Annotated[int, typer.Option("--many", min=9, help="Adapters registered in the many-adapters case.")] = 1000,
    device: Device = "auto", quick: Quick = False, out: Out = None, as_json: AsJson = False,
    quantize: Quantize = None,
) -> None:
    """The GPU path's figures (kernels/gpu_check.sh runs this, after lorafleet/bench/gpu_micro.py): the
    engine's LoRA op and decode attention against the device's copy bandwidth and a read of the
    same bytes; decode throughput with no adapter, one rank-16 adapter, 8 and 64 adapters, MANY
    registered, mixed ranks 8-256 against their uniform mean, the 64-adapter step against its
    bound, the host's share of a step, decode-graph captures and re-captures. The base's weights
    are made on the device (nothing downloaded). Runs on the CPU too (small shapes)."""
    suites.check_quantize(quantize, [], cpu=False)

    def one(shape: str) -> dict:
        from lorafleet.bench.gpu import run_gpu_bench
        from lorafleet.model.loader import resolve_device

        batches = [min(b, 8) for b in batch or [64]] if quick else batch or [64]
        small: dict[str, Any] = dict(max_tokens=4, many=min(many, 12), context=64) if quick else {"many": many}
        return run_gpu_bench(shape, str(resolve_device(device)), batches, progress=suites.say, quantize=quantize,
                             **small)
    suites.suite("gpu", model or (["micro"] if quick else ["1b"]), one, "gpu_table", out, as_json, on_device=True)
