"""The report for people: rich tables over the JSON document of `report.py`."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from lorafleet.bench.report import CONTENDED_CORES, SUBJECTS

# the width tables get away from a terminal: no table comes near it, so none is ever cut
UNBOUNDED_WIDTH = 100_000


def console(file=None) -> Console:
    """The console the tables print on (stdout, or `file`): a terminal's width on a terminal;
    elsewhere (a file, a pipe) wide enough for every table, whose cells are never cut, where
    rich would cut them to 80 columns. Markup on: the tables style cells with it and escape
    what they quote."""
    out = Console(file=file)
    return out if out.is_terminal else Console(file=file, width=UNBOUNDED_WIDTH)


def render(report: dict) -> list[Table]:
    """Throughput (with ratios), latency, memory, the switch regression and the sweep: each
    table when the report has something for it."""
    tables = [throughput_table(report)]
    if report["ratios"]:
        tables.append(ratio_table(report))
    tables.append(latency_table(report))
    cold = [(r, c) for r in report["results"] if r["latency"] and (c := r["latency"].get("ttft_cold_warm"))]
    if cold:
        tables.append(cold_start_table(cold))
    if any(m["num_adapters"] for m in report.get("memory", [])):
        tables.append(memory_table(report))
    tables += [switch_table(s) for s in report.get("switch", []) if s["regressions"]]
    if report.get("sweep"):
        tables.append(sweep_table(report))
    return tables


def new_table(title: str, columns: list[str], caption: str | None = None, left: int = 2) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption=caption or None, caption_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < left else "right", no_wrap=True)
    return table


def contended(other_cores: float | None) -> bool:
    """Whether other work kept enough cores busy (`machine.other_cores`; None: unknown) to name a figure."""
    return other_cores is not None and other_cores >= CONTENDED_CORES


def function_name(label: str) -> str:
    """A profile row's function without its place, unless it has no name of its own (`<dictcomp>`)."""
    return label if label.startswith("<") else label.split(" (")[0]


def verdict(met: bool | None) -> str | Text:
    """A target's verdict, styled as rich Text (markup would print literally on a console without it)."""
    return "-" if met is None else ("met" if met else Text("missed", style="bold"))


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / (1 << 20):.0f} MiB"


_X_LABELS = {"adapters_loaded": "loaded", "distinct_adapters": "distinct"}


def throughput_table(report: dict) -> Table:
    """One row per run; runs that did not complete, or served fewer requests, are explained
    under the table."""
    load = report["workload"]
    notes = [f"{r['model']} {r['system']}: {r['status']}, {escape(r['reason'])}"
             for r in report["results"] if r["status"] != "ok"]
    notes += [f"{r['model']} {r['system']}: {escape(r['details']['capped'])}"
              for r in report["results"] if r["details"].get("capped")]
    arrival = load["arrival"] + (f" {load['rate']:g}/s" if load["arrival"] == "poisson" else "")
    if load["concurrency"] is not None:
        arrival = f"a closed loop of {load['concurrency']} in flight"
    adapters = f"{load['num_adapters']} adapters"
    if load.get("mix_size"):  # reports written before mixes have no such field
        adapters = (f"each mix of {load['mix_size']} of {load['num_adapters']} adapters served by one adapter of "
                    "their summed rank" if load["mix_single"] else
                    f"each a mix of {load['mix_size']} of {load['num_adapters']} adapters")
    title = f"workload {load['name']}: {load['num_requests']} requests, {adapters}, {arrival}"
    table = new_table(title, ["model", "system", "tokens", "seconds", "tokens/s", "req/s", "peak RSS"], "\n".join(notes))
    for row in report["results"]:
        if row["status"] != "ok":
            table.add_row(row["model"], row["system"], Text(row["status"], style="yellow"))
        elif row["tokens_per_s"] is None:
            table.add_row(row["model"], row["system"], "memory only", "", "", "", _mib(row["peak_rss_bytes"]))
        else:
            table.add_row(row["model"], row["system"], str(row["generated_tokens"]), f"{row['seconds']:.2f}",
                          f"{row['tokens_per_s']:.1f}", f"{row['requests_per_s']:.2f}", _mib(row["peak_rss_bytes"]))
    return table


def ratio_table(report: dict) -> Table:
    table = new_table("lorafleet against each baseline, same model and requests",
                   ["model", "system", "baseline", "tokens/s\nratio", "TTFT p50\nspeedup", "TTFT p99\nspeedup"],
                   left=3)
    for r in report["ratios"]:
        ttft = [f"{r[k]:.2f}x" if r.get(k) else "" for k in ("ttft_p50_speedup", "ttft_p99_speedup")]
        table.add_row(r["model"], r["system"], r["baseline"], f"{r['tokens_per_s_ratio']:.2f}x", *ttft)
    return table


def latency_table(report: dict) -> Table:
    table = new_table("latency (ms, from each request's arrival) and the pool",
                   ["model", "system", "TTFT\np50", "TTFT\np99", "TPOT\np50", "TPOT\np99", "adapter\nwait p99",
                    "adapter\nwait total", "pool\npeak"],
                   "adapter wait: exposed adapter-load time; pool peak: the share of the pool's pages in use "
                   "(KV + adapters) at most")
    for row in report["results"]:
        lat = row["latency"]
        if row["status"] != "ok" or row["tokens_per_s"] is None or lat is None:
            continue
        pool = row["details"].get("pool")
        table.add_row(row["model"], row["system"], _ms(lat["ttft_s"]["p50"]), _ms(lat["ttft_s"]["p99"]),
                      _ms(lat["tpot_s"]["p50"]), _ms(lat["tpot_s"]["p99"]), _ms(lat["adapter_wait_s"]["p99"]),
                      _ms(lat["adapter_wait_s"]["total"]),
                      f"{pool['peak_occupancy']:.0%}" if pool else "")
    return table


def memory_table(report: dict) -> Table:
    table = new_table("memory: lorafleet (base + pool) against one merged copy per adapter",
                   ["model", "adapters", "merged", "lorafleet\npool", "lorafleet\nused at peak", "merged ÷\nused"],
                   left=1)
    for m in report["memory"]:
        if not m["num_adapters"]:
            continue
        table.add_row(m["model"], str(m["num_adapters"]), _mib(m["merged_bytes"]), _mib(m["lorafleet_bytes"]),
                      _mib(m["lorafleet_peak_used_bytes"]), f"{m['merged_over_lorafleet']:.1f}x")
    return table


def switch_table(entry: dict) -> Table:
    """Per-token latency of steps by adapters per step, with the slope adjusted for the steps'
    shape (the headline, with its 95% interval), the within-shape one where steps of one shape
    differ, and the pooled one (confounded by batch shape) under it."""
    notes = []
    for reg in entry["regressions"]:
        label = reg["x"].replace("_", " ")
        pooled = (f"; all steps pooled: {reg['slope_pooled_s'] * 1e3:+.4f}, confounded by batch shape"
                  if reg["slope_pooled_s"] is not None else "")
        within = (f"; within shape: {reg['slope_within_s'] * 1e3:+.4f} among {reg['comparable_steps']} steps of "
                  f"{reg['comparable_shapes']} shape(s)" if reg.get("slope_within_s") is not None else "")
        if reg["slope_s"] is None:
            notes.append(f"{label}: {escape(reg.get('note', 'no slope'))}{within}{pooled}")
        else:
            lo, hi = reg["slope_ci_s"]
            notes.append(f"{label}: {reg['slope_s'] * 1e3:+.4f} ms/token per adapter ({reg['slope_fraction']:+.1%} "
                         f"of the mean; 95% interval {lo * 1e3:+.4f} to {hi * 1e3:+.4f}), the step's shape "
                         f"accounted for over {reg['steps']} steps{within}{pooled}")
    table = new_table(f"switch regression, {entry['model']} · {entry['system']}",
                   ["x", "adapters\nper step", "steps", "decode\nsteps", "per-token\nms p50", "per-token\nms mean",
                    "mean\nseqs", "mean\ntokens"], "\n".join(notes), left=1)
    for reg in entry["regressions"]:
        for row in reg["table"]:
            table.add_row(_X_LABELS.get(reg["x"], reg["x"]), str(row[reg["x"]]), str(row["steps"]),
                          str(row["decode_steps"]), f"{row['per_token_ms_p50']:.3f}", f"{row['per_token_ms_mean']:.3f}",
                          f"{row['mean_seqs']:.1f}", f"{row['mean_tokens']:.0f}")
    return table


def sweep_table(report: dict) -> Table:
    table = new_table("throughput against the number of adapters", ["model", "system", "adapters", "tokens/s",
                                                                 "replays", "vs fewest", "peak RSS"],
                   "tokens/s: the median replay; replays: the slowest and fastest")
    first: dict[tuple[str, str], float] = {}
    for p in report["sweep"]:
        tps = p["tokens_per_s"]
        ref = first.setdefault((p["model"], p["system"]), tps) if tps else None
        each = [r["tokens_per_s"] for r in p.get("repeats", [])]
        spread = f"{min(each):.0f}-{max(each):.0f}" if len(each) > 1 else ""
        table.add_row(p["model"], p["system"], str(p["num_adapters"]),
                      f"{tps:.1f}" if tps else Text(p["status"], style="yellow"), spread,
                      f"{tps / ref:.2f}x" if ref else "", _mib(p["peak_rss_bytes"]))
    return table


def cold_start_table(rows: list[tuple[dict, dict]]) -> Table:
    table = new_table("cold start: TTFT (ms) of each adapter's first request against later ones",
                   ["model", "system", "cold p50", "cold p99", "warm p50", "warm p99", "cold ÷ warm\np50",
                    "cold ÷ warm\np99"], "cold: the adapter was on disk when it arrived; target: <= 1.2x")
    for row, c in rows:
        ratio = [f"{v:.2f}x" if (v := c[f"cold_over_warm_{q}"]) else "" for q in ("p50", "p99")]
        table.add_row(row["model"], row["system"], _ms(c["cold"]["p50"]), _ms(c["cold"]["p99"]),
                      _ms(c["warm"]["p50"]), _ms(c["warm"]["p99"]), *ratio)
    return table


def suite_summary(suite: dict) -> Table:
    """A suite on one page: every lorafleet ratio, per workload, and across workloads."""
    table = new_table(f"{suite['suite']} suite: {suite['duration_s'] / 60:.1f} min", ["workload", "model", "baseline",
                                                                         "tokens/s\nratio", "TTFT p50\nspeedup"], left=3)
    for report in suite["reports"]:
        for r in report["ratios"]:
            if r["system"] in SUBJECTS:
                ttft = f"{r['ttft_p50_speedup']:.2f}x" if r["ttft_p50_speedup"] else ""
                table.add_row(r["workload"], r["model"], r["baseline"], f"{r['tokens_per_s_ratio']:.2f}x", ttft)
    for r in suite.get("across", []):
        table.add_row(r["workload"], r["model"], f"lorafleet on {r['versus']}", f"{r['tokens_per_s_ratio']:.2f}x", "")
    return table


def mix_tables(figures: list[dict]) -> list[Table]:
    """`bench mix`, one table per model and lorafleet system (`report.mix_figures`): it on the
    mixes and on the same requests on single adapters, and each PEFT system on the mixes merged;
    the ratios against the mix targets; the runs that did not complete explained under it."""
    return [_mix_table(f) for f in figures]


def _mix_table(f: dict) -> Table:
    notes = [escape(n) for n in f["notes"]]
    notes += [f"mix {b['system']}: {escape(b['capped'])}" for b in f["baselines"] if b["capped"]]
    title = (f"{f['model']}: {f['system']} on mixes, against single adapters of the same bytes and PEFT's "
             "merged mixes")
    table = new_table(title,
                   ["system", "workload", "tok/s", "TTFT p99\nms", "merges", "ratio", "target", ""],
                   f"ratio: {f['system']}'s tokens/s on mix over this row's; mix-single: the same requests, each mix "
                   "served by one adapter of the summed rank (the same LoRA bytes a step); merges: the merged "
                   "adapters PEFT built in the replay (add_weighted_adapter, cat) and their time, in its tokens/s"
                   + "".join(f"\n{n}" for n in notes), left=2)

    def tps(v: float | None) -> str:
        return f"{v:.1f}" if v else "-"

    def judged(ratio: float | None, target: float, met: bool | None) -> list[str | Text]:
        return [f"{ratio:.2f}x" if ratio else "", f">= {target:g}x", verdict(met)]
    table.add_row(f["system"], "mix", tps(f["tokens_per_s"]), _ms(f["ttft_p99_s"]), "", "", "", "")
    table.add_row(f["system"], "mix-single", tps(f["single_tokens_per_s"]), _ms(f["single_ttft_p99_s"]), "",
                  *judged(f["over_single"], f["over_single_target"], f["over_single_met"]))
    for b in f["baselines"]:
        merges = f"{b['merges']} in {b['merge_s']:.2f} s" if b["merges"] else ""
        table.add_row(b["system"], "mix", tps(b["tokens_per_s"]), _ms(b["ttft_p99_s"]), merges,
                      *judged(b["ratio"], b["target"], b["met"]))
    return table


# lorafleet's daemon over llama-server, by workload and requests in flight (none where absent)
PEER_TARGETS = {("peer-base", 1): 1.0, ("peer-base", 8): 1.0, ("peer-one-adapter", 1): 1.0,
                ("peer-one-adapter", 8): 1.0, ("peer-round-robin", 8): 3.0}


def peer_tables(suite: dict) -> list[Table]:
    """`bench llama-cpp`, one table per model: per workload and requests in flight, the tokens/s
    and TTFT p99 of lorafleet's daemon and of llama.cpp, their ratio and the target; runs
    that did not complete are explained under the table."""
    models = dict.fromkeys(r["model"] for rep in suite["reports"] for r in rep["results"])
    return [_peer_table(suite, model) for model in models]


PEER_PRECISION = {None: "f32", "int8": "int8 against Q8_0", "int4": "int4 against Q4_0 (--pure)"}


def _peer_table(suite: dict, model: str) -> Table:
    options: dict = next((rep.get("options", {}) for rep in suite["reports"]), {})
    quantize = options.get("quantize")
    precision = PEER_PRECISION.get(quantize, f"the same {quantize} file (llama-quantize) on both sides")
    held = options.get("lora_dtype")
    precision += f", lorafleet's adapters held in {held}" if held not in (None, "auto") else ""
    precision += ", lorafleet's prefill in bf16" if options.get("quantized_prefill") == "bfloat16" else ""
    table = new_table(f"{model}, {precision}: lorafleet (through its daemon) against llama.cpp's "
                   "llama-server",
                   ["workload", "in\nflight", "system", "tok/s", "TTFT p99\nms", "ratio", "target", ""],
                   "ratio: lorafleet's tokens/s over llama.cpp's; TTFT from when each request was sent", left=3)
    notes = []
    for rep in suite["reports"]:
        load = rep["workload"]
        n = load["concurrency"]
        base = load["name"].removesuffix(f"-{n}-in-flight")
        runs = [r for r in rep["results"] if r["model"] == model]
        notes += [f"{load['name']} {r['system']}: {r['status']}, {escape(r['reason'])}"
                  for r in runs if r["status"] != "ok"]
        notes += [f"{load['name']} {r['system']}: {escape(r['details']['fallback'])}"
                  for r in runs if r["status"] == "ok" and r.get("details", {}).get("fallback")]
        ok = {r["system"]: r for r in runs if r["status"] == "ok"}
        ours = ok["lorafleet-daemon"] if "lorafleet-daemon" in ok else None
        theirs = ok["llama.cpp"] if "llama.cpp" in ok else None
        ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if ours and theirs else None
        target = PEER_TARGETS[(base, n)] if (base, n) in PEER_TARGETS else None
        for i, (label, row) in enumerate((("lorafleet", ours), ("llama.cpp", theirs))):
            figures = ([f"{row['tokens_per_s']:.1f}", f"{row['latency']['ttft_s']['p99'] * 1e3:.0f}"] if row
                       else ["-", ""])
            judged = ([f"{ratio:.2f}x" if ratio else "", f">= {target:g}x" if target else "",
                        verdict(ratio >= target) if target and ratio else ""] if i == 0 else ["", "", ""])
            table.add_row(base if i == 0 else "", str(n) if i == 0 else "", label, *figures, *judged,
                          end_section=i == 1)
    assert table.caption is not None  # new_table was given one
    table.caption += "".join(f"\n{note}" for note in notes)
    return table
