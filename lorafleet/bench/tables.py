"""The report for people: rich tables over the JSON document of `report.py`."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

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


def _table(title: str, columns: list[str], caption: str | None = None, left: int = 2) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
                  caption=caption or None, caption_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < left else "right", no_wrap=True)
    return table


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
    table = _table(title, ["model", "system", "tokens", "seconds", "tokens/s", "req/s", "peak RSS"], "\n".join(notes))
    for row in report["results"]:
        if row["status"] != "ok":
            table.add_row(row["model"], row["system"], f"[yellow]{row['status']}[/]")
        elif row["tokens_per_s"] is None:
            table.add_row(row["model"], row["system"], "memory only", "", "", "", _mib(row["peak_rss_bytes"]))
        else:
            table.add_row(row["model"], row["system"], str(row["generated_tokens"]), f"{row['seconds']:.2f}",
                          f"{row['tokens_per_s']:.1f}", f"{row['requests_per_s']:.2f}", _mib(row["peak_rss_bytes"]))
    return table


def ratio_table(report: dict) -> Table:
    table = _table("lorafleet against each baseline, same model and requests",
                   ["model", "system", "baseline", "tokens/s\nratio", "TTFT p50\nspeedup", "TTFT p99\nspeedup"],
                   left=3)
    for r in report["ratios"]:
        ttft = [f"{r[k]:.2f}x" if r.get(k) else "" for k in ("ttft_p50_speedup", "ttft_p99_speedup")]
        table.add_row(r["model"], r["system"], r["baseline"], f"{r['tokens_per_s_ratio']:.2f}x", *ttft)
    return table


def latency_table(report: dict) -> Table:
    table = _table("latency (ms, from each request's arrival) and the pool",
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
    table = _table("memory: lorafleet (base + pool) against one merged copy per adapter",
                   ["model", "adapters", "merged", "lorafleet\npool", "lorafleet\nused at peak", "merged ÷\nused"],
                   left=1)
    for m in report["memory"]:
        if not m["num_adapters"]:
            continue
        table.add_row(m["model"], str(m["num_adapters"]), _mib(m["merged_bytes"]), _mib(m["lorafleet_bytes"]),
                      _mib(m["lorafleet_peak_used_bytes"]), f"{m['merged_over_lorafleet']:.1f}x")
    return table


def switch_table(entry: dict) -> Table:
    """Per-token latency of steps by adapters per step, with the within-shape slope (the
    headline) and the pooled one (confounded by batch shape) under it."""
    notes = []
    for reg in entry["regressions"]:
        label = reg["x"].replace("_", " ")
        pooled = (f" (all steps pooled: {reg['slope_pooled_s'] * 1e3:+.4f}, confounded by batch shape)"
                  if reg["slope_pooled_s"] is not None else "")
        if reg["slope_s"] is None:
            notes.append(f"{label}: {escape(reg.get('note', 'no slope'))}{pooled}")
        else:
            notes.append(f"{label}: {reg['slope_s'] * 1e3:+.4f} ms/token per adapter ({reg['slope_fraction']:+.1%} "
                         f"of the mean) among {reg['comparable_steps']} steps of {reg['comparable_shapes']} "
                         f"shape(s){pooled}")
    table = _table(f"switch regression, {entry['model']} · {entry['system']}",
                   ["x", "adapters\nper step", "steps", "decode\nsteps", "per-token\nms p50", "per-token\nms mean",
                    "mean\nseqs", "mean\ntokens"], "\n".join(notes), left=1)
    for reg in entry["regressions"]:
        for row in reg["table"]:
            table.add_row(_X_LABELS.get(reg["x"], reg["x"]), str(row[reg["x"]]), str(row["steps"]),
                          str(row["decode_steps"]), f"{row['per_token_ms_p50']:.3f}", f"{row['per_token_ms_mean']:.3f}",
                          f"{row['mean_seqs']:.1f}", f"{row['mean_tokens']:.0f}")
    return table


def sweep_table(report: dict) -> Table:
    table = _table("throughput against the number of adapters", ["model", "system", "adapters", "tokens/s",
                                                                 "replays", "vs fewest", "peak RSS"],
                   "tokens/s: the median replay; replays: the slowest and fastest")
    first: dict[tuple[str, str], float] = {}
    for p in report["sweep"]:
        tps = p["tokens_per_s"]
        ref = first.setdefault((p["model"], p["system"]), tps) if tps else None
        each = [r["tokens_per_s"] for r in p.get("repeats", [])]
        spread = f"{min(each):.0f}-{max(each):.0f}" if len(each) > 1 else ""
        table.add_row(p["model"], p["system"], str(p["num_adapters"]),
                      f"{tps:.1f}" if tps else f"[yellow]{p['status']}[/]", spread,
                      f"{tps / ref:.2f}x" if ref else "", _mib(p["peak_rss_bytes"]))
    return table


def cold_start_table(rows: list[tuple[dict, dict]]) -> Table:
    table = _table("cold start: TTFT (ms) of each adapter's first request against later ones",
                   ["model", "system", "cold p50", "cold p99", "warm p50", "warm p99", "cold ÷ warm\np50",
                    "cold ÷ warm\np99"], "cold: the adapter was on disk when it arrived; issue 5 asks <= 1.2x")
    for row, c in rows:
        ratio = [f"{v:.2f}x" if (v := c[f"cold_over_warm_{q}"]) else "" for q in ("p50", "p99")]
        table.add_row(row["model"], row["system"], _ms(c["cold"]["p50"]), _ms(c["cold"]["p99"]),
                      _ms(c["warm"]["p50"]), _ms(c["warm"]["p99"]), *ratio)
    return table


def suite_summary(suite: dict) -> Table:
    """A suite on one page: every lorafleet ratio, per workload, and across workloads."""
    table = _table(f"{suite['suite']} suite: {suite['duration_s'] / 60:.1f} min", ["workload", "model", "baseline",
                                                                         "tokens/s\nratio", "TTFT p50\nspeedup"], left=3)
    for report in suite["reports"]:
        for r in report["ratios"]:
            if r["system"] in SUBJECTS:
                ttft = f"{r['ttft_p50_speedup']:.2f}x" if r["ttft_p50_speedup"] else ""
                table.add_row(r["workload"], r["model"], r["baseline"], f"{r['tokens_per_s_ratio']:.2f}x", ttft)
    for r in suite.get("across", []):
        table.add_row(r["workload"], r["model"], f"lorafleet on {r['versus']}", f"{r['tokens_per_s_ratio']:.2f}x", "")
    return table


def lora_decode_table(results: list[dict]) -> Table:
    table = _table("lora-decode: one decode step, fp32",
                   ["shape", "batch", "step none\nms", "step 1\nadapter ms", "step distinct\nms", "1 adapter\n÷ none",
                    "LoRA op\nms", "weights\nread ms", "efficiency", "vs PEFT\nmixed"], left=1)
    for r in results:
        ms, vs_peft = r["decode_step_ms"], r.get("lorafleet_vs_peft_mixed")
        table.add_row(r["shape"], str(r["batch"]), f"{ms['none']:.1f}", f"{ms['one']:.1f}", f"{ms['distinct']:.1f}",
                      f"{r['one_vs_none_throughput']:.2f}x", f"{r['lora_op_ms']:.1f}", f"{r['adapter_read_ms']:.1f}",
                      f"{r['lora_efficiency']:.2f}x", f"{vs_peft:.2f}x" if vs_peft else "-")
    return table


def _contended(other_cores: float | None) -> bool:
    """Whether other work kept enough cores busy (`machine.other_cores`; None: unknown) to name a figure."""
    return other_cores is not None and other_cores >= CONTENDED_CORES


def decode_bound_table(results: list[dict]) -> Table:
    noisy = [f"\nnoisy: {r['shape']}: other work (other processes, the hypervisor's other guests) kept "
             f"{r['other_cores']:.1f} cores busy in its busiest round: the host's figures, not the code's"
             for r in results if _contended(r["other_cores"])]
    quantized = [r for r in results if r.get("quantization")]
    memory = ("\nmemory: the base's weight bytes (every tensor, scales included) against the same model's in "
              "float32; target: " + ", ".join(f"{q} <= {t}x" for q, t in
                                              dict((r["quantization"], r["memory_target"]) for r in quantized).items())
              if quantized else "")
    table = _table("decode-bound: a base-model decode step against reading its weights once",
                   ["shape", "weights", "read GB/s", "batch", "step ms", "bound ms", "ratio", "tok/s", "matmuls ms",
                    "in cache ms", "host ms", *(["memory"] if quantized else [])],
                   f"ratio: the median over rounds of a round's step against its own bound; read GB/s and "
                   f"bound: their medians; matmuls: the step's matmuls alone (against the bound); in cache: the "
                   f"same matmuls at the kernels' speed on weights that stay in cache, their compute floor "
                   f"(against the bound); host: the engine's part of a step, around the model's forward pass; "
                   f"weights: the bytes a step reads (quantized: codes and scales)"
                   f"\ntarget: <= {results[0]['target_ratio']}x the bound at batch 1 and 8" + memory + "".join(noisy),
                   left=1)
    for r in results:
        q = r.get("quantization")
        for i, row in enumerate(r["batches"]):
            first = i == 0
            mem = []
            if quantized:
                mem = [f"{r['memory_ratio']:.3f}x fp32 {_verdict(r['memory_ratio'] <= r['memory_target'])}"
                       if q and first else ""]
            table.add_row(f"{r['shape']} {r['dtype']}{' ' + q if q else ''}" if first else "",
                          f"{r['weight_bytes'] / 2**20:.0f} MiB" if first else "",
                          f"{r['bandwidth_gb_s']:.1f}" if first else "", str(row["batch"]), f"{row['step_ms']:.2f}",
                          f"{row['bound_ms']:.2f}", f"{row['ratio']:.2f}x", f"{row['tokens_per_s']:.0f}",
                          f"{row['matmul_ms']:.2f} ({row['matmul_ratio']:.2f}x)",
                          f"{row['cached_ms']:.2f} ({row['cached_ratio']:.2f}x)", f"{row['host_ms']:.2f}", *mem)
    return table


def switch_cost_table(results: list[dict]) -> Table:
    table = _table("switch: per-token latency of fixed-shape decode steps against adapters landed in the step",
                   ["shape", "batch", "decode\nsteps", "adapters\nlanded", "per-token\nms mean", "slope ms\nper switch",
                    "share of\nper-token"], "target: < 2% per switch", left=1)
    for r in results:
        slope = r["slope_fraction"]
        table.add_row(f"{r['shape']}\nloads from {r['source']}", str(r["batch"]), str(r["decode_steps"]), str(r["adapters_landed"]),
                      f"{r['mean_per_token_ms']:.3f}",
                      f"{r['slope_ms_per_switch']:+.4f}" if slope is not None else escape(r.get("note", "-")),
                      f"{slope:+.2%}" if slope is not None else "")
    return table


def overhead_table(results: list[dict]) -> Table:
    """Each shape's two figures against their targets (judged only in the targets' setting)."""
    table = _table("overhead: the engine's time around the model (its step records)",
                   ["shape", "figure", "measured", "detail", "target", ""], left=2)
    for r in results:
        d, b = r["decode"], r["burst"]
        table.add_row(r["shape"], f"host share of a decode step\n{r['running']} requests, {r['num_adapters']} adapters",
                      f"{d['host_share']:.1%}", f"host {d['mean_host_ms']:.2f} of {d['mean_time_ms']:.2f} ms mean"
                      f"\np50 {d['p50_host_ms']:.2f} of {d['p50_time_ms']:.2f} ms", f"<= {d['target']:.0%}",
                      _verdict(d["target_met"]))
        table.add_row(r["shape"], f"adding {b['requests']} requests at once", f"{b['add_s'] * 1e3:.1f} ms",
                      f"{b['add_us_per_request']:.0f} us each; first step after\n{b['first_step_ms']:.1f} ms "
                      f"({b['first_step_host_ms']:.1f} host, {b['first_step_seqs']} seqs)",
                      f"< {b['target_s'] * 1e3:.0f} ms", _verdict(b["target_met"]))
    setting = results[0]["target_setting"] if results else {}
    table.caption = (f"targets judged for {setting.get('shape')}, {setting.get('running')} requests over "
                     f"{setting.get('num_adapters')} adapters, {setting.get('burst')} at once")
    busy = [f"{r['shape']} {part}: {o:.1f}" for r in results for part in ("decode", "burst")
            if _contended(o := r[part]["other_cores"])]
    if busy:
        table.caption += "\nother processes kept cores busy meanwhile (cores): " + ", ".join(busy)
    return table


def stats_cost_table(results: list[dict]) -> Table:
    """Each shape's figures, the cost against the issue's target (judged at one poll a second),
    the A/B; the setting and the profile's leading parts in the caption."""
    table = _table("stats-cost: what one GET /v1/stats costs the engine thread",
                   ["shape", "figure", "measured", "target", ""], left=2)
    captions = []
    for r in results:
        p, ab, e = r["poll"], r["ab"], r["engine"]
        rows = [("one poll: snapshot + JSON", f"{p['median_s'] * 1e3:.2f} ms", "", ""),
                ("  mean", f"{p['mean_s'] * 1e3:.2f} ms", "", ""),
                ("  p99", f"{p['p99_s'] * 1e3:.2f} ms", "", ""),
                ("  snapshot alone", f"{p['snapshot_median_s'] * 1e3:.2f} ms", "", ""),
                ("  JSON", f"{p['json_bytes'] / 1024:.0f} KiB", "", ""),
                (f"cost at one poll per {r['interval_s']:g} s", f"{r['cost_fraction']:.2%}",
                 f"< {r['target']:.0%}", _verdict(r["target_met"])),
                ("tokens/s, no polls", f"{ab['tokens_per_s_off']:.1f}", "", ""),
                ("tokens/s, polls", f"{ab['tokens_per_s_on']:.1f}", "", ""),
                ("  ratio", f"{ab['ratio']:.3f}x", "", "")]
        for i, (figure, measured, target, verdict) in enumerate(rows):
            table.add_row(r["shape"] if i == 0 else "", figure, measured, target, verdict)
        busy = [o for x in ab["runs"] if _contended(o := x["other_cores"])]
        top = ", ".join(f"{_function(x['function'])} {x['share']:.0%}" for x in r["profile"][:4])
        key, size = next(iter(p["json_bytes_by_key"].items()), ("", 0))
        captions.append(
            f"{r['shape']}: {e['registered']} adapters ({e['tiers']['device']} resident), {e['steps_in_log']} steps "
            f"in the log; median and p99 of {p['calls']} polls between steps; {key} is {size / 1024:.0f} KiB of "
            f"the JSON. A/B: medians of {ab['rounds']} runs "
            f"each, interleaved; {ab['polls']} polls took {ab['poll_share_of_on_runs']:.2%} of the polled runs' "
            f"time; ratio per pair {', '.join(f'{x:.3f}' for x in ab['pair_ratios'])}; the steps themselves "
            f"took {ab['steps_s_ratio']:.3f}x as long in the polled runs (the machine's drift, or polls' side effects)"
            + (f"; other processes kept up to {max(busy):.1f} cores busy" if busy else "")
            + f". Profile of a poll: {top}.")
    table.caption = "\n".join(captions) or None
    return table


def _function(label: str) -> str:
    """A profile row's function without its place, unless it has no name of its own (`<dictcomp>`)."""
    return label if label.startswith("<") else label.split(" (")[0]


def _verdict(met: bool | None) -> str:
    return "-" if met is None else ("met" if met else "[bold]missed[/]")


_X_LABELS = {"adapters_loaded": "loaded", "distinct_adapters": "distinct"}


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(n: int | None) -> str:
    return "" if n is None else f"{n / (1 << 20):.0f} MiB"


GPU_GOALS = {"1 adapter r16 / no adapter": (0.9, ">="), "registered / 8 adapters": (0.9, ">="),
             "mixed ranks / uniform rank": (0.95, ">="), "step / its bound": (1.3, "<="), "host share": (0.1, "<=")}


def gpu_table(results: list[dict]) -> Table:
    """`bench gpu`: each kernel against the copy bandwidth and the same-size read, then the
    engine's decode throughput and the ratios the GPU issues set goals for."""
    table = _table("gpu: kernels and decode throughput", ["shape", "figure", "measured", "detail", "goal", ""], left=2)
    for r in results:
        kernels, engine = r["kernels"], r["engine"]
        copy = kernels[0]["copy_GB/s"]
        for k in kernels[1:]:
            lora = k["kernel"].startswith("lora")
            table.add_row(engine["shape"], f"{k['kernel']} ({k['backend']})", f"{k['GB/s']:.0f} GB/s",
                          f"{k['us']:.1f} us, {k['of_read']:.0%} of a read of its bytes, {k['of_copy_bw']:.0%} of "
                          f"copy {copy:.0f} GB/s", ">= 70% of the read" if lora else "",
                          _verdict(k["of_read"] >= 0.7) if lora else "")
        for batch, run in engine["batches"].items():
            for label, case in run["cases"].items():
                g = case["decode_graphs"]
                graphs = (f"{g['captures']} captures, {g['replays']} replays, {g['recaptures']} re-captures"
                          if g.get("enabled") else "no decode graphs")
                host = f"host {case['host_share']:.0%} of a step; " if case["host_share"] is not None else ""
                table.add_row(engine["shape"], f"decode b{batch}, {label}", f"{case['tokens_per_s']:.0f} tok/s",
                              f"{case['step_ms']:.2f} ms a step; {host}{case['kernels']} kernels; {graphs}", "", "")
            for label, ratio in run["ratios"].items():
                goal, sense = next(v for k, v in GPU_GOALS.items() if label.endswith(k))
                met = ratio >= goal if sense == ">=" else ratio <= goal
                table.add_row(engine["shape"], f"b{batch}: {label}", f"{ratio:.2f}x", "", f"{sense} {goal}x",
                              _verdict(met))
    return table


def store_load_table(results: list[dict]) -> Table:
    """`bench store-load`: CPU per adapter load from the store against the same files as a folder."""
    table = _table("store-load: CPU of one adapter load, disk -> host -> pool pages",
                   ["shape", "adapter", "from the store", "as a folder", "ratio", "target", ""], left=2)
    for r in results:
        table.add_row(r["shape"], f"rank {r['rank']} on {','.join(t.replace('_proj', '') for t in r['targets'])}\n"
                      f"{r['bytes'] / 2**20:.1f} MiB", f"{r['store_cpu_ms']:.2f} ms", f"{r['folder_cpu_ms']:.2f} ms",
                      f"{r['speedup']:.1f}x less", f"<= {r['target_ms']:.0f} ms", _verdict(r["target_met"]))
    return table


def mix_tables(figures: list[dict]) -> list[Table]:
    """`bench mix`, one table per model and lorafleet system (`report.mix_figures`): it on the
    mixes and on the same requests on single adapters, and each PEFT system on the mixes merged;
    the ratios against issue 52's targets; the runs that did not complete explained under it."""
    return [_mix_table(f) for f in figures]


def _mix_table(f: dict) -> Table:
    notes = [escape(n) for n in f["notes"]]
    notes += [f"mix {b['system']}: {escape(b['capped'])}" for b in f["baselines"] if b["capped"]]
    title = (f"{f['model']}: {f['system']} on mixes, against single adapters of the same bytes and PEFT's "
             "merged mixes")
    table = _table(title,
                   ["system", "workload", "tok/s", "TTFT p99\nms", "merges", "ratio", "target", ""],
                   f"ratio: {f['system']}'s tokens/s on mix over this row's; mix-single: the same requests, each mix "
                   "served by one adapter of the summed rank (the same LoRA bytes a step); merges: the merged "
                   "adapters PEFT built in the replay (add_weighted_adapter, cat) and their time, in its tokens/s"
                   + "".join(f"\n{n}" for n in notes), left=2)

    def tps(v: float | None) -> str:
        return f"{v:.1f}" if v else "-"

    def verdict(ratio: float | None, target: float, met: bool | None) -> list[str]:
        return [f"{ratio:.2f}x" if ratio else "", f">= {target:g}x", _verdict(met)]
    table.add_row(f["system"], "mix", tps(f["tokens_per_s"]), _ms(f["ttft_p99_s"]), "", "", "", "")
    table.add_row(f["system"], "mix-single", tps(f["single_tokens_per_s"]), _ms(f["single_ttft_p99_s"]), "",
                  *verdict(f["over_single"], f["over_single_target"], f["over_single_met"]))
    for b in f["baselines"]:
        merges = f"{b['merges']} in {b['merge_s']:.2f} s" if b["merges"] else ""
        table.add_row(b["system"], "mix", tps(b["tokens_per_s"]), _ms(b["ttft_p99_s"]), merges,
                      *verdict(b["ratio"], b["target"], b["met"]))
    return table


# issue 18: lorafleet's daemon over llama-server, by workload and requests in flight (none where absent)
PEER_TARGETS = {("peer-base", 1): 1.0, ("peer-base", 8): 1.0, ("peer-one-adapter", 1): 1.0,
                ("peer-one-adapter", 8): 1.0, ("peer-round-robin", 8): 3.0}


def peer_tables(suite: dict) -> list[Table]:
    """`bench llama-cpp`, one table per model: per workload and requests in flight, the tokens/s
    and TTFT p99 of lorafleet's daemon and of llama.cpp, their ratio and issue 18's target; runs
    that did not complete are explained under the table."""
    models = dict.fromkeys(r["model"] for rep in suite["reports"] for r in rep["results"])
    return [_peer_table(suite, model) for model in models]


PEER_PRECISION = {None: "f32", "int8": "int8 against Q8_0", "int4": "int4 against Q4_0 (--pure)"}


def _peer_table(suite: dict, model: str) -> Table:
    quantize = next((rep.get("options", {}).get("quantize") for rep in suite["reports"]), None)
    table = _table(f"{model}, {PEER_PRECISION[quantize]}: lorafleet (through its daemon) against llama.cpp's "
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
            verdict = ([f"{ratio:.2f}x" if ratio else "", f">= {target:g}x" if target else "",
                        _verdict(ratio >= target) if target and ratio else ""] if i == 0 else ["", "", ""])
            table.add_row(base if i == 0 else "", str(n) if i == 0 else "", label, *figures, *verdict,
                          end_section=i == 1)
    table.caption += "".join(f"\n{note}" for note in notes)
    return table
