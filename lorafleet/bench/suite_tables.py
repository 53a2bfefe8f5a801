"""The tables of `lorafleet bench`'s suites (`lora-decode`, `decode-bound`, `switch`, `overhead`,
`stats-cost`, `gpu`, `store-load`): one per suite, over its results. The run report's tables,
and the helpers they share, are `tables.py`'s."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from lorafleet.bench.tables import contended, function_name, new_table, verdict


def lora_decode_table(results: list[dict]) -> Table:
    quantized = {r["quantization"] for r in results if r.get("quantization")}
    table = new_table("lora-decode: one decode step, fp32" + "".join(f", base {q}" for q in sorted(quantized)),
                   ["shape", "batch", "step none\nms", "step 1\nadapter ms", "step distinct\nms", "1 adapter\n÷ none",
                    "LoRA op\nms", "weights\nread ms", "efficiency", "vs PEFT\nmixed"], left=1)
    for r in results:
        ms, vs_peft = r["decode_step_ms"], r.get("lorafleet_vs_peft_mixed")
        table.add_row(r["shape"], str(r["batch"]), f"{ms['none']:.1f}", f"{ms['one']:.1f}", f"{ms['distinct']:.1f}",
                      f"{r['one_vs_none_throughput']:.2f}x", f"{r['lora_op_ms']:.1f}", f"{r['adapter_read_ms']:.1f}",
                      f"{r['lora_efficiency']:.2f}x", f"{vs_peft:.2f}x" if vs_peft else "-")
    return table



def decode_bound_table(results: list[dict]) -> Table:
    noisy = [f"\nnoisy: {r['shape']}: other work (other processes, the hypervisor's other guests) kept "
             f"{r['other_cores']:.1f} cores busy in its busiest round: the host's figures, not the code's"
             for r in results if contended(r["other_cores"])]
    quantized = [r for r in results if r.get("quantization")]
    memory = ("\nmemory: the base's weight bytes (every tensor, scales included) against the same model's in "
              "float32; target: " + ", ".join(f"{q} <= {t}x" for q, t in
                                              dict((r["quantization"], r["memory_target"]) for r in quantized).items()
                                              if t is not None)
              if quantized else "")
    table = new_table("decode-bound: a base-model decode step against reading its weights once",
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
                target = r["memory_target"]
                mem = [f"{r['memory_ratio']:.3f}x fp32" + (f" {verdict(r['memory_ratio'] <= target)}" if target else "")
                       if q and first else ""]
            table.add_row(f"{r['shape']} {r['dtype']}{' ' + q if q else ''}" if first else "",
                          f"{r['weight_bytes'] / 2**20:.0f} MiB" if first else "",
                          f"{r['bandwidth_gb_s']:.1f}" if first else "", str(row["batch"]), f"{row['step_ms']:.2f}",
                          f"{row['bound_ms']:.2f}", f"{row['ratio']:.2f}x" + (
                              f" ({row['file_ratio']:.2f}x the {r['gguf_type']} file's)" if row.get("file_ratio") else ""),
                          f"{row['tokens_per_s']:.0f}",
                          f"{row['matmul_ms']:.2f} ({row['matmul_ratio']:.2f}x)",
                          f"{row['cached_ms']:.2f} ({row['cached_ratio']:.2f}x)", f"{row['host_ms']:.2f}", *mem)
    return table


def switch_cost_table(results: list[dict]) -> Table:
    table = new_table("switch: per-token latency of fixed-shape decode steps against adapters landed in the step",
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
    table = new_table("overhead: the engine's time around the model (its step records)",
                   ["shape", "figure", "measured", "detail", "target", ""], left=2)
    for r in results:
        d, b = r["decode"], r["burst"]
        shape = r["shape"] + (f" {r['quantization']}" if r.get("quantization") else "")
        sampled = (f", T {r['temperature']:g}" + (f" top-p {r['top_p']:g}" if r["top_p"] < 1 else "")
                   if r.get("temperature") else "")
        setting = f"{r['running']} requests, {r['num_adapters']} adapters{sampled}"
        table.add_row(shape, f"host share of a decode step\n{setting}",
                      f"{d['host_share']:.1%}", f"host {d['mean_host_ms']:.2f} of {d['mean_time_ms']:.2f} ms mean"
                      f"\np50 {d['p50_host_ms']:.2f} of {d['p50_time_ms']:.2f} ms", f"<= {d['target']:.0%}",
                      verdict(d["target_met"]))
        table.add_row(shape, f"adding {b['requests']} requests at once", f"{b['add_s'] * 1e3:.1f} ms",
                      f"{b['add_us_per_request']:.0f} us each; first step after\n{b['first_step_ms']:.1f} ms "
                      f"({b['first_step_host_ms']:.1f} host, {b['first_step_seqs']} seqs)",
                      f"< {b['target_s'] * 1e3:.0f} ms", verdict(b["target_met"]))
    setting = results[0]["target_setting"] if results else {}
    table.caption = (f"targets judged for {setting.get('shape')}, {setting.get('running')} requests over "
                     f"{setting.get('num_adapters')} adapters (greedy), {setting.get('burst')} at once")
    busy = [f"{r['shape']} {part}: {o:.1f}" for r in results for part in ("decode", "burst")
            if contended(o := r[part]["other_cores"])]
    if busy:
        table.caption += "\nother processes kept cores busy meanwhile (cores): " + ", ".join(busy)
    return table


def stats_cost_table(results: list[dict]) -> Table:
    """Each shape's figures, the cost against the issue's target (judged at one poll a second),
    the A/B; the setting and the profile's leading parts in the caption."""
    table = new_table("stats-cost: what one GET /v1/stats costs the engine thread",
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
                 f"< {r['target']:.0%}", verdict(r["target_met"])),
                ("tokens/s, no polls", f"{ab['tokens_per_s_off']:.1f}", "", ""),
                ("tokens/s, polls", f"{ab['tokens_per_s_on']:.1f}", "", ""),
                ("  ratio", f"{ab['ratio']:.3f}x", "", "")]
        for i, (figure, measured, target, met) in enumerate(rows):
            table.add_row(r["shape"] if i == 0 else "", figure, measured, target, met)
        busy = [o for x in ab["runs"] if contended(o := x["other_cores"])]
        top = ", ".join(f"{function_name(x['function'])} {x['share']:.0%}" for x in r["profile"][:4])
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







GPU_GOALS = {"1 adapter r16 / no adapter": (0.9, ">="), "registered / 8 adapters": (0.9, ">="),
             "mixed ranks / uniform rank": (0.95, ">="), "step / its bound": (1.3, "<="), "host share": (0.1, "<="),
             "async_decode / off": (1.0, ">=")}


def gpu_table(results: list[dict]) -> Table:
    """`bench gpu`: each kernel against the copy bandwidth and the same-size read, then the
    engine's decode throughput and the ratios the GPU issues set goals for."""
    table = new_table("gpu: kernels and decode throughput", ["shape", "figure", "measured", "detail", "goal", ""], left=2)
    for r in results:
        kernels, engine = r["kernels"], r["engine"]
        copy = kernels[0]["copy_GB/s"]
        for k in kernels[1:]:
            lora = k["kernel"].startswith("lora")
            table.add_row(engine["shape"], f"{k['kernel']} ({k['backend']})", f"{k['GB/s']:.0f} GB/s",
                          f"{k['us']:.1f} us, {k['of_read']:.0%} of a read of its bytes, {k['of_copy_bw']:.0%} of "
                          f"copy {copy:.0f} GB/s", ">= 70% of the read" if lora else "",
                          verdict(k["of_read"] >= 0.7) if lora else "")
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
                              verdict(met))
    return table


def store_load_table(results: list[dict]) -> Table:
    """`bench store-load`: CPU per adapter load from the store against the same files as a folder."""
    table = new_table("store-load: CPU of one adapter load, disk -> host -> pool pages",
                   ["shape", "adapter", "from the store", "as a folder", "ratio", "target", ""], left=2)
    for r in results:
        table.add_row(r["shape"], f"rank {r['rank']} on {','.join(t.replace('_proj', '') for t in r['targets'])}\n"
                      f"{r['bytes'] / 2**20:.1f} MiB", f"{r['store_cpu_ms']:.2f} ms", f"{r['folder_cpu_ms']:.2f} ms",
                      f"{r['speedup']:.1f}x less", f"<= {r['target_ms']:.0f} ms", verdict(r["target_met"]))
    return table
