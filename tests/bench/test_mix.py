"""Issue 52's mix workload: each request a mix of 2 distinct of 8 adapters, drawn from the seed;
its companion on single adapters of the summed ranks; lorafleet and PEFT (merged adapters built
per mix, in the replay) serving it; the systems that cannot, skipped; the figures, their table
and `lorafleet bench mix`."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from lorafleet.bench.adapters import build_adapters, warm_up_adapter, workload_adapters
from lorafleet.bench.jobs import Job
from lorafleet.bench.systems import get_system
from lorafleet.bench.workloads import WORKLOADS, BenchRequest, Workload, adapter_name, adapter_ranks, make_requests
from lorafleet.errors import ConfigError
from lorafleet.adapters.mix import Mix

MIX, SINGLE = WORKLOADS["mix"], WORKLOADS["mix-single"]
# mix's draw at micro's scale: few short requests, over 4 small adapters
SMALL = dataclasses.replace(MIX, name="small-mix", num_requests=8, prompt_len=(4, 8), output_len=(3, 5),
                            num_adapters=4, ranks=(4, 8), seed=5)


def job_for(micro_dir, load: Workload, system: str = "lorafleet", **kwargs) -> Job:
    adapters = {n: str(p) for n, p in workload_adapters(micro_dir, load)}
    return Job(system, str(micro_dir), make_requests(load, 512), adapters, threads=1,
               warm_up_adapter=str(warm_up_adapter(micro_dir)), **kwargs)


# -- the workloads ------------------------------------------------------------------------------

def test_mix_draws_the_same_requests_for_the_same_seed_and_others_for_another():
    assert make_requests(MIX, 8192) == make_requests(MIX, 8192)
    other = make_requests(dataclasses.replace(MIX, seed=1), 8192)
    assert [r.mix for r in other] != [r.mix for r in make_requests(MIX, 8192)]


def test_every_mix_request_mixes_2_distinct_of_8_adapters_of_ranks_16_to_64():
    requests = make_requests(MIX, 8192)
    assert len(requests) == 64 and all(r.adapter is None for r in requests)
    assert {len(r.prompt) for r in requests} == {64} and {r.max_tokens for r in requests} == {64}
    names = [adapter_name(i) for i in range(8)]
    for r in requests:
        assert len(r.mix) == 2 and len(set(r.names)) == 2 and set(r.names) <= set(names)
        assert {s for _, s in r.mix} <= {1.0, 0.5}
        assert Mix.of(r.mix).members == r.mix and Mix.of(r.mix).label == r.label  # the engine's own order and name
    assert set(adapter_ranks(MIX)) == {16, 32, 48, 64} and len(adapter_ranks(MIX)) == 8
    assert {n for r in requests for n in r.names} == set(names)
    assert {s for r in requests for _, s in r.mix} == {1.0, 0.5}


def test_mix_single_has_mixs_requests_each_on_one_adapter_of_its_mixs_summed_rank():
    mixes, singles = make_requests(MIX, 8192), make_requests(SINGLE, 8192)
    assert [(r.prompt, r.max_tokens, r.arrival_s) for r in singles] == [(r.prompt, r.max_tokens, r.arrival_s)
                                                                        for r in mixes]
    own, summed = adapter_ranks(MIX), adapter_ranks(SINGLE)
    index = {adapter_name(i): i for i in range(len(summed))}
    pairs = {(m.label, s.adapter) for m, s in zip(mixes, singles)}
    assert len(pairs) == len({m.label for m in mixes}) == len({s.adapter for s in singles}) == len(summed)
    for m, s in zip(mixes, singles):  # one adapter per distinct mix, of the mix's ranks summed
        assert not s.mix and summed[index[s.adapter]] == sum(own[index[n]] for n in m.names)


def test_the_single_adapters_built_hold_the_same_lora_weights_as_their_mixs(micro_dir):
    from safetensors import safe_open

    def elements(folder) -> int:
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            return sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] for k in f.keys())
    load = dataclasses.replace(SINGLE, num_requests=12, num_adapters=4, ranks=(4, 8, 12, 16))
    mixes = make_requests(dataclasses.replace(load, mix_single=False), 512)
    built, own = dict(workload_adapters(micro_dir, load)), dict(workload_adapters(micro_dir, dataclasses.replace(
        load, mix_single=False)))
    assert len(built) == len({r.label for r in mixes}) and len(own) == 4
    for m, s in zip(mixes, make_requests(load, 512)):
        config = json.loads((built[s.adapter] / "adapter_config.json").read_text())
        assert config["r"] == sum(json.loads((own[n] / "adapter_config.json").read_text())["r"] for n in m.names)
        assert elements(built[s.adapter]) == sum(elements(own[n]) for n in m.names)


def test_many_ranks_make_a_short_cache_key(micro_dir):
    [(_, folder)] = build_adapters(micro_dir, 1, ranks=tuple(range(4, 104)))
    assert len(folder.parent.name) < 80


@pytest.mark.parametrize("changes, field", [
    (dict(mix_size=1), "mix_size"), (dict(mix_size=9), "mix_size"), (dict(popularity="zipf"), "uniform"),
    (dict(base_fraction=0.5), "base_fraction"), (dict(mix_scales=()), "mix_scales"),
    (dict(mix_scales=(5.0,)), "mix_scales"), (dict(mix_size=0), "mix_single"),
])
def test_a_bad_mix_workload_is_refused_naming_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        dataclasses.replace(SINGLE, **changes)


def test_a_mix_request_round_trips_through_json_and_names_one_adapter_or_a_mix():
    r = make_requests(MIX, 512)[0]
    assert BenchRequest(**json.loads(json.dumps(dataclasses.asdict(r)))) == r
    assert r.label == "+".join(n if s == 1.0 else f"{n}*{s:g}" for n, s in r.mix)
    assert BenchRequest([3], 1, "a").label == "a" and BenchRequest([3], 1).label is None
    with pytest.raises(ConfigError, match="not both"):
        BenchRequest([3], 1, "a", mix=(("b", 1.0),))


# -- the systems ------------------------------------------------------------------------------

def test_lorafleet_serves_each_request_on_its_mix(micro_dir):
    job = job_for(micro_dir, SMALL)
    result = get_system("lorafleet")(threads=1).run(job)
    assert result.status == "ok", result.reason
    assert result.generated_tokens == sum(r.max_tokens for r in job.requests)
    assert sorted(m["adapter"] for m in result.requests) == sorted(r.label for r in job.requests)
    # a step's distinct adapters are the mixes' adapters, each counted once
    assert max(s["distinct_adapters"] for s in result.steps) == len({n for r in job.requests for n in r.names})


@pytest.mark.parametrize("system", ["peft-groups", "peft-mixed"])
def test_peft_serves_the_mixes_on_merged_adapters_it_builds_in_every_replay(micro_dir, system):
    pytest.importorskip("peft")
    job = job_for(micro_dir, SMALL, system)
    result = get_system(system)(threads=1, batch_size=2).run(job)
    assert result.status == "ok", result.reason
    assert result.generated_tokens == sum(r.max_tokens for r in job.requests)
    assert result.details["merges"] == len({r.label for r in job.requests})  # one per distinct mix
    assert 0 < result.details["merge_s"] < result.seconds  # timed inside the replay


def test_peft_merged_mix_generates_lorafleets_tokens(micro_dir):
    """The baseline serves the same model as lorafleet: PEFT's cat merge of a mix and lorafleet's
    mix of the same adapters give the same greedy tokens."""
    pytest.importorskip("peft")
    import torch

    from lorafleet import Engine, SamplingParams
    from lorafleet.bench.static_batch import PeftGroups

    job = job_for(micro_dir, SMALL, "peft-groups")
    requests = [r for r in job.requests if any(s != 1.0 for _, s in r.mix)][:2]
    assert requests
    peft_system = PeftGroups(threads=1, dtype="float32", device="cpu")
    peft_system.device, peft_system.dtype = peft_system._setup()
    peft_system.prepare(job)
    engine = Engine(str(micro_dir), device="cpu", dtype="float32", pool_bytes=64 << 20)
    try:
        for name, path in job.adapters.items():
            engine.load_adapter(name, path)
        ours = engine.generate([r.prompt for r in requests], SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True),
                               adapters=[Mix.of(r.mix) for r in requests])
    finally:
        engine.close()
    for r, out in zip(requests, ours):
        peft_system.model.set_adapter(peft_system.adapter_for(r))
        with torch.inference_mode():
            ids = peft_system.model.generate(input_ids=torch.tensor([r.prompt]), max_new_tokens=6, min_new_tokens=6,
                                             do_sample=False, pad_token_id=0)
        assert ids[0, len(r.prompt):].tolist() == out.token_ids


def test_a_system_that_cannot_serve_mixes_is_skipped_with_the_reason(micro_dir):
    result = get_system("llama.cpp")(threads=1).run(job_for(micro_dir, SMALL, "llama.cpp"))
    assert result.status == "skipped" and "one adapter per request" in result.reason


def test_the_daemon_system_sends_a_mix_as_the_adapters_field(monkeypatch):
    import asyncio

    from lorafleet.bench import daemon_system, http_replay

    bodies = []

    async def events(http, path, body):
        bodies.append(body)
        yield {"choices": [{"text": "x"}]}
        yield {"usage": {"completion_tokens": 1}}
    monkeypatch.setattr(http_replay, "events", events)
    mix, single = make_requests(MIX, 512)[0], make_requests(SINGLE, 512)[0]
    figures = [asyncio.run(daemon_system._one(r, None, 0.0)) for r in (mix, single)]
    assert bodies[0]["adapters"] == [{"name": n, "scale": s} for n, s in mix.mix] and "model" not in bodies[0]
    assert bodies[1]["model"] == single.adapter and "adapters" not in bodies[1]
    assert [f["adapter"] for f in figures] == [mix.label, single.adapter]


def test_merged_accounting_charges_one_base_copy_per_distinct_mix(micro_dir):
    from lorafleet.bench.jobs import weight_bytes

    job = job_for(micro_dir, SMALL, "merged")
    result = get_system("merged")().run(job)
    assert result.details["memory_bytes"] == weight_bytes(micro_dir) * (1 + len({r.label for r in job.requests}))


# -- the figures and the command -----------------------------------------------------------------

def _row(system, tps, **details):
    return {"model": "micro", "system": system, "status": "ok", "reason": "", "tokens_per_s": tps,
            "latency": {"ttft_s": {"p99": 0.5}}, "details": details}


def _suite_reports():
    return [{"workload": {"name": "mix"}, "results": [
                _row("lorafleet", 900.0), _row("peft-groups", 100.0, merges=40, merge_s=1.5),
                _row("peft-mixed", 300.0, merges=40, merge_s=1.2),
                {**_row("lorafleet-daemon", None), "status": "skipped", "reason": "no mixes"}]},
            {"workload": {"name": "mix-single"}, "results": [_row("lorafleet", 1000.0)]}]


def test_the_mix_figures_are_lorafleets_ratios_against_its_single_adapters_and_peft():
    from lorafleet.bench.report import mix_figures

    f, daemon = mix_figures(_suite_reports())
    assert f["system"] == "lorafleet" and f["over_single"] == pytest.approx(0.9) and f["over_single_met"] is True
    groups, mixed = f["baselines"]
    assert (groups["system"], groups["ratio"], groups["met"], groups["merges"]) == ("peft-groups", 9.0, True, 40)
    assert (mixed["ratio"], mixed["met"]) == (3.0, False)
    assert f["notes"] == [] and mix_figures(_suite_reports()[1:]) == []
    assert daemon["system"] == "lorafleet-daemon" and daemon["tokens_per_s"] is None and daemon["over_single"] is None
    assert daemon["notes"] == ["mix lorafleet-daemon: skipped, no mixes"] and daemon["baselines"][0]["ratio"] is None


def test_the_mix_table_shows_the_ratios_against_the_targets():
    from rich.console import Console

    from lorafleet.bench.report import mix_figures
    from lorafleet.bench.tables import mix_tables

    console = Console(record=True, width=200)
    for table in mix_tables(mix_figures(_suite_reports())[:1]):
        console.print(table)
    text = console.export_text()
    assert "0.90x" in text and ">= 0.8x" in text and "9.00x" in text and "3.00x" in text and ">= 5x" in text
    assert "missed" in text and "40 in 1.50 s" in text


def test_bench_mix_runs_mix_then_mix_single_on_the_lorafleet_systems_only(tmp_path, monkeypatch):
    import lorafleet.bench.runner
    from lorafleet.cli.main import app

    seen = {}

    def suite(shapes, out, **kwargs):
        seen.update(kwargs, shapes=shapes)
        return {"suite": "mix", "reports": [], "across": [], "duration_s": 1.0}
    monkeypatch.setattr(lorafleet.bench.runner, "run_suite", suite)
    result = CliRunner().invoke(app, ["bench", "mix", "--out", str(tmp_path / "r.json"), "--json"])
    assert result.exit_code == 0, result.stderr
    assert seen["shapes"] == ["tiny"] and seen["workloads"] == ("mix", "mix-single")
    assert seen["systems"] == ("lorafleet", "peft-groups", "peft-mixed")
    assert seen["only"] == {"mix-single": ("lorafleet",)} and seen["sweeps"] == {}


@pytest.mark.heavy  # a whole benchmark run end to end
def test_bench_mix_on_micro_reports_both_ratios(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from lorafleet.bench.fixtures import build_base
    from lorafleet.cli.main import app

    build_base("micro", root=tmp_path / "home" / "bench")
    monkeypatch.setenv("LORAFLEET_HOME", str(tmp_path / "home"))
    out = tmp_path / "mix.json"
    result = CliRunner().invoke(app, ["bench", "mix", "--model", "micro", "--threads", "1", "--out", str(out),
                                      "--max-baseline-requests", "16", "--systems",
                                      "lorafleet,lorafleet-daemon,peft-groups,peft-mixed"])
    assert result.exit_code == 0, result.stderr
    suite = json.loads(out.read_text())
    assert [f["system"] for f in suite["mix"]] == ["lorafleet", "lorafleet-daemon"]
    for f in suite["mix"]:  # the daemon through the request body's `adapters`
        assert f["tokens_per_s"] > 0 and f["single_tokens_per_s"] > 0 and f["over_single"] > 0 and not f["notes"]
        assert [b["system"] for b in f["baselines"]] == ["peft-groups", "peft-mixed"]
        for b in f["baselines"]:
            assert b["ratio"] > 0 and b["merges"] > 0 and b["merge_s"] > 0 and "first 16 of 64" in b["capped"]
    assert {r["system"] for r in suite["reports"][1]["results"]} == {"lorafleet", "lorafleet-daemon"}
    assert Counter(a["workload"] for a in suite["across"]) == {"mix": 1}
    assert "mix-single" in result.stdout and ">= 5x" in result.stdout
