"""The gateway contract on `lorafleet serve --host/--port`: what a LoRA-aware endpoint picker
(Kubernetes Gateway API Inference Extension, llm-d) reads from each lorafleet endpoint.

- /v1/models: OpenAI's model cards, `parent` (the base) on every adapter's.
- /metrics, parsed with prometheus_client's parser while requests run (`--max-num-seqs 1`: one
  adapter's request runs while another's waits), checked name by name against /v1/stats taken
  around the scrape: queues, KV use, running vs waiting adapters, residency per adapter and
  tier, the capacity (`max_lora`) recomputed from the adapters' sizes; an adapter evicted from
  the pool leaves `lora_adapter_loaded{level="gpu"}`, an unloaded one every series.
- The published scoring rules, re-implemented here as a pure function over two live daemons:
  it picks the daemon holding the adapter; once both hold it and the first is busy, the rules
  send the request to the other.
"""

from __future__ import annotations

import signal
import statistics
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.daemons import Daemon, free_port

KEY = "gateway-key"
POOL = "512K"          # 64 pages of 8 KiB: the five fixture adapters (40 pages) and one request's KV
LONG = 480             # tokens: the chat model's context is 512
RANKS = {"attn-r3": 3, "all-r8": 8, "mlp-r24": 24, "rslora-r16": 16, "down-r1": 1}


def start(root, model):
    port = free_port()
    d = Daemon.start(root, "--served-model-name", "base", "--pool-bytes", POOL, "--max-num-seqs", "1",
                     "--host", "127.0.0.1", "--port", str(port), model=model,
                     env={"LORAFLEET_API_KEY": KEY}, wait=False)
    d.port = port
    return d


def tcp(d, **kw) -> httpx.Client:
    """What a gateway holds: the endpoint's ip:port, the key on the /v1 routes."""
    return httpx.Client(base_url=f"http://127.0.0.1:{d.port}", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=kw.pop("timeout", 60.0), **kw)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, chat_model_dir):
    """Two endpoints of one pool, as an InferencePool's pods: same base, same flags, on TCP."""
    p = start(tmp_path_factory.mktemp("gw-p"), chat_model_dir)
    q = start(tmp_path_factory.mktemp("gw-q"), chat_model_dir)
    try:
        p.wait_ready(120)
        q.wait_ready(120)
        yield p, q
    finally:
        for d in (p, q):
            if d.proc.poll() is None:
                d.signal(signal.SIGTERM)
        for d in (p, q):
            try:
                d.wait(30)
            except Exception:
                pass
            d.kill()


def load(d, name, path) -> dict:
    with tcp(d) as c:
        r = c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        return r.raise_for_status().json()


def scrape(d) -> dict:
    """/metrics as a picker scrapes it (no key: it is outside /v1), parsed: name -> samples."""
    with httpx.Client(base_url=f"http://127.0.0.1:{d.port}", timeout=30) as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def busy(d, model: str, n: int) -> list[threading.Thread]:
    """`n` long requests for `model` from threads (with `--max-num-seqs 1`: one runs, the rest wait;
    which one runs does not matter, they are alike: callers wait on stats for what must come first)."""
    def one():
        try:
            with tcp(d, timeout=120) as c:
                c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": LONG,
                                                "ignore_eos": True})
        except httpx.HTTPError:
            pass
    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def view(stats: dict) -> tuple:
    """What /metrics must agree with, from one /v1/stats (KV use aside: it grows every few steps)."""
    e = stats["engine"]
    resident = tuple(sorted((n, a["tier"], a["pinned"]) for n, a in e["adapter_details"].items()
                            if a["tier"] != "disk"))
    return (e["num_running"], e["num_waiting"], tuple(sorted(e["lora"]["running"])),
            tuple(sorted(e["lora"]["waiting"])),
            resident, e["lora_capacity"]["max_adapters"])


def moment(d, until, what: str, timeout: float = 30.0):
    """(stats, metrics) of one moment: /v1/stats before and after the scrape agree on everything
    but KV use, and `until(stats)` holds. Fails past `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = d.stats()
        if until(before):
            metrics = scrape(d)
            after = d.stats()
            if view(before) == view(after):
                return before, after, metrics
        time.sleep(0.005)
    pytest.fail(f"{what}: not seen within {timeout:g}s")


def one(samples, **labels):
    hits = [s for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (labels, samples)
    return hits[0]


def check_against_stats(before: dict, after: dict, m: dict, sizes: dict[str, int]) -> None:
    """Every name, label and meaning of the gateway metrics against the engine's own state."""
    e = before["engine"]
    total = e["pool"]["total_pages"]
    assert one(m["vllm:num_requests_running"], model_name="base").value == e["num_running"]
    assert one(m["vllm:num_requests_waiting"], model_name="base").value == e["num_waiting"]
    kv = one(m["vllm:kv_cache_usage_perc"], model_name="base").value
    low, high = sorted((e["kv_cache_usage"], after["engine"]["kv_cache_usage"]))
    assert low <= kv <= high and 0 <= kv <= 1
    assert e["kv_cache_usage"] == e["pool"]["kv_pages"] / total

    # lora_requests_info: one series, valued with the time; adapters as running / waiting
    (info,) = m["vllm:lora_requests_info"]
    assert abs(info.value - time.time()) < 60
    split = lambda v: {a for a in v.split(",") if a}  # noqa: E731
    assert split(info.labels["running_lora_adapters"]) == set(e["lora"]["running"])
    assert split(info.labels["waiting_lora_adapters"]) == set(e["lora"]["waiting"])

    # max_lora: the pool's pages over the median pages of the resident adapters (recomputed here
    # from the pages each adapter took when it was loaded: the host tier holds no pages)
    resident = {n: a for n, a in e["adapter_details"].items() if a["tier"] in ("device", "host")}
    for n, a in resident.items():
        if a["tier"] == "device":
            assert a["pages"] == sizes[n], (n, a["pages"], sizes[n])
    assert resident, "the test expects resident adapters"
    median = statistics.median(sizes[n] for n in resident)
    expected = int(total // median)
    assert e["lora_capacity"] == {"max_adapters": expected, "median_pages": median,
                                  "sized_adapters": len(resident), "basis": "resident"}
    assert info.labels["max_lora"] == str(expected)
    assert one(m["vllm:max_gpu_lora_adapters"], model_name="base").value == expected

    # residency: one series per resident adapter, value 1, level gpu (the pool) or cpu (host tier)
    series = {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"], s.labels["rank"])
              for s in m["vllm:lora_adapter_loaded"]}
    assert all(s.value == 1 and s.labels["model_name"] == "base" for s in m["vllm:lora_adapter_loaded"])
    assert len(series) == len(m["vllm:lora_adapter_loaded"])
    want = {(n, {"device": "gpu", "host": "cpu"}[a["tier"]], "true" if a["pinned"] else "false",
             str(max(a["ranks"].values()))) for n, a in resident.items()}
    assert series == want
    for n, _, _, rank in series:
        base_name = n.split(".")[0]
        if base_name in RANKS:
            assert rank == str(RANKS[base_name])
    gpu = sum(a["tier"] == "device" for a in resident.values())
    assert gpu == e["adapters"]["tiers"]["device"]
    assert one(m["vllm:num_gpu_loaded_lora_adapters"], model_name="base").value == gpu


def test_capacity_before_any_adapter_is_resident(pair, adapter_dirs):
    """No adapter: max_lora is max_num_seqs; one registered only (its size read from its file's
    header): the pool over its pages; the residency gauges exist from the start, at 0."""
    _, q = pair

    def capacity():
        m = scrape(q)
        assert m["vllm:lora_adapter_loaded"] == [] and one(m["vllm:num_gpu_loaded_lora_adapters"]).value == 0
        assert one(m["vllm:max_gpu_lora_adapters"]).value == int(m["vllm:lora_requests_info"][0].labels["max_lora"])
        return q.stats()["engine"]["lora_capacity"], int(one(m["vllm:max_gpu_lora_adapters"]).value)

    assert capacity() == ({"max_adapters": 1, "median_pages": None, "sized_adapters": 0, "basis": "max_num_seqs"}, 1)
    with tcp(q) as c:
        c.post("/v1/load_lora_adapter", json={"lora_name": "lazy", "lora_path": str(adapter_dirs["mlp-r24"]),
                                              "lazy": True}).raise_for_status()
        assert capacity() == ({"max_adapters": 64 // 14, "median_pages": 14, "sized_adapters": 1,
                               "basis": "registered"}, 64 // 14)
        c.post("/v1/unload_lora_adapter", json={"lora_name": "lazy"}).raise_for_status()


def test_models_list_the_base_and_adapters_with_openai_fields_and_parent(pair, adapter_dirs):
    p, _ = pair
    load(p, "attn-r3", adapter_dirs["attn-r3"])
    with tcp(p) as c:
        body = c.get("/v1/models").raise_for_status().json()
        one_card = c.get("/v1/models/attn-r3").raise_for_status().json()
    assert body["object"] == "list"
    cards = {m["id"]: m for m in body["data"]}
    for card in cards.values():
        assert card["object"] == "model" and isinstance(card["created"], int) and card["owned_by"] == "lorafleet"
    assert body["data"][0]["id"] == "base" and cards["base"]["parent"] is None
    assert cards["attn-r3"]["parent"] == "base" and cards["attn-r3"]["root"] == str(adapter_dirs["attn-r3"])
    assert one_card["id"] == "attn-r3" and one_card["parent"] == "base"


def test_metrics_under_load_match_the_engine_and_eviction_leaves_the_gpu_level(pair, adapter_dirs):
    p, _ = pair
    sizes = {}
    for name, path in adapter_dirs.items():  # 40 pages of 64: all in the pool at first
        info = load(p, name, path)["adapter"]
        assert info["tier"] == "device"
        sizes[name] = info["pages"]

    # all-r8 runs, attn-r3 only waits (one sequence per step)
    threads = busy(p, "all-r8", 2)
    p.wait_stats(lambda s: "all-r8" in s["engine"]["lora"]["running"], "all-r8 running", 30, 0.005)
    threads += busy(p, "attn-r3", 1)
    before, after, m = moment(p, lambda s: "attn-r3" in s["engine"]["lora"]["waiting"]
                              and "attn-r3" not in s["engine"]["lora"]["running"]
                              and "all-r8" in s["engine"]["lora"]["running"], "attn-r3 waiting behind all-r8")
    info = m["vllm:lora_requests_info"][0].labels
    assert "attn-r3" in info["waiting_lora_adapters"].split(",")
    assert "attn-r3" not in info["running_lora_adapters"].split(",")
    assert info["running_lora_adapters"] == "all-r8"
    assert one(m["vllm:lora_adapter_loaded"], adapter_name="all-r8").labels["pinned"] == "true"
    assert m["vllm:num_requests_waiting"][0].value >= 1 and m["vllm:kv_cache_usage_perc"][0].value > 0
    check_against_stats(before, after, m, sizes)
    for t in threads:
        t.join(120)
    p.wait_idle(30)

    # eviction: copies of the large adapters need the pool's pages; idle adapters go back to the host tier
    with tcp(p) as c:
        c.post("/reset_prefix_cache").raise_for_status()
    on_gpu = {s.labels["adapter_name"] for s in scrape(p)["vllm:lora_adapter_loaded"] if s.labels["level"] == "gpu"}
    evicted, copies = set(), [(f"{n}.copy{i}", n) for i in (1, 2) for n in ("rslora-r16", "mlp-r24", "all-r8")]
    while not evicted:  # at most 76 pages more, into 64: the adapters idle longest must go
        assert copies, "loading copies of the large adapters evicted none of the others"
        copy, name = copies.pop(0)
        sizes[copy] = load(p, copy, adapter_dirs[name])["adapter"]["pages"]
        tiers = {n: a["tier"] for n, a in p.stats()["engine"]["adapter_details"].items()}
        evicted = {n for n in on_gpu if tiers.get(n) == "host"}
    before, after, m = moment(p, lambda s: True, "an idle moment")
    for name in evicted:
        levels = {s.labels["level"] for s in m["vllm:lora_adapter_loaded"] if s.labels["adapter_name"] == name}
        assert levels == {"cpu"}, (name, levels)
    check_against_stats(before, after, m, sizes)

    # unloaded: no series at all, on either level
    gone, last = sorted(evicted)[0], copy  # one on the host tier, one in the pool
    assert before["engine"]["adapter_details"][last]["tier"] == "device"
    gpu_before = one(m["vllm:num_gpu_loaded_lora_adapters"]).value
    with tcp(p) as c:
        for name in (gone, last):
            c.post("/v1/unload_lora_adapter", json={"lora_name": name}).raise_for_status()
    m = scrape(p)
    names = {s.labels["adapter_name"] for s in m["vllm:lora_adapter_loaded"]}
    assert gone not in names and last not in names
    assert one(m["vllm:num_gpu_loaded_lora_adapters"]).value == gpu_before - 1


# -- the endpoint picker's rules, re-implemented -----------------------------------------------
# What a picker reads from one endpoint's /metrics, as llm-d-router's core metrics extractor
# does: of `vllm:lora_requests_info` the series with the largest value (its time), the adapter
# lists split on commas; `vllm:max_gpu_lora_adapters`, when present, over the `max_lora` label;
# of `vllm:lora_adapter_loaded` the series above 0, gpu over cpu.

def endpoint_state(m: dict) -> dict:
    info = max(m.get("vllm:lora_requests_info", []), key=lambda s: s.value, default=None)
    split = lambda v: {a.strip() for a in v.split(",") if a.strip()}  # noqa: E731
    state = {"waiting_queue": m["vllm:num_requests_waiting"][0].value, "kv": m["vllm:kv_cache_usage_perc"][0].value,
             "active": split(info.labels["running_lora_adapters"]) if info else set(),
             "waiting": split(info.labels["waiting_lora_adapters"]) if info else set(),
             "max_active": int(info.labels["max_lora"]) if info else 0, "loaded": {}, "gpu_loaded": 0}
    if m.get("vllm:max_gpu_lora_adapters"):
        state["max_active"] = int(m["vllm:max_gpu_lora_adapters"][0].value)
    for s in m.get("vllm:lora_adapter_loaded", []):
        if s.value > 0:
            name, level = s.labels["adapter_name"], s.labels["level"]
            if state["loaded"].get(name, ("cpu",))[0] != "gpu":
                state["loaded"][name] = (level, s.labels["pinned"] == "true")
    if m.get("vllm:num_gpu_loaded_lora_adapters"):
        state["gpu_loaded"] = int(m["vllm:num_gpu_loaded_lora_adapters"][0].value)
    return state


# the scorers' weights: the EndpointPickerConfig of docs/scale-out.md
WEIGHTS = {"lora-load-state": 2.0, "lora-affinity": 1.0, "queue": 1.0, "kv-cache-utilization": 1.0}


def score(endpoints: dict[str, dict], adapter: str) -> tuple[str, dict[str, dict[str, float]]]:
    """The endpoint a max-score picker takes for a request naming `adapter`, and each scorer's
    scores. The rules, as llm-d-router's scorers (pkg/epp/framework/plugins/scheduling/scorer)
    and the model server protocol (GIE docs/proposals/003-model-server-protocol) publish them:
    - lora-affinity: 1.0 where the adapter is running (active); 0.8 where fewer adapters are
      running plus waiting than max_lora (room to load it); 0.6 where it only waits; else 0.
    - lora-load-state (the residency gauges): 1.0 where it is at level gpu, 0.7 at cpu, 0.6
      not resident with a free slot (gpu-loaded below the capacity), 0.3 slots full but an
      unpinned gpu resident with nothing running, else 0; tiers scaled by 1 - 0.06 and a
      headroom bonus of 0.03 x the share of free slots. (Its placement bonus, a rendezvous hash
      of the adapter over the endpoints' ids, and its load-time pricing, off by default, are
      left out: neither applies where one endpoint holds the adapter at level gpu.)
    - queue: waiting requests min-max normalised over the endpoints, shortest 1 (all equal: 1).
    - kv-cache-utilization: 1 - the KV use.
    The picker sums the weighted scores and takes the largest."""
    queues = [e["waiting_queue"] for e in endpoints.values()]
    lo, hi = min(queues), max(queues)
    scores = {}
    for name, e in endpoints.items():
        if adapter in e["active"]:
            affinity = 1.0
        elif len(e["active"]) + len(e["waiting"]) < e["max_active"]:
            affinity = 0.8
        elif adapter in e["waiting"]:
            affinity = 0.6
        else:
            affinity = 0.0
        level = e["loaded"].get(adapter, (None,))[0]
        idle_resident = any(lvl == "gpu" and not pinned and n not in e["active"]
                            for n, (lvl, pinned) in e["loaded"].items())
        tier = (1.0 if level == "gpu" else 0.7 if level == "cpu" else 0.6 if e["gpu_loaded"] < e["max_active"]
                else 0.3 if idle_resident else 0.0)
        free = max(e["max_active"] - e["gpu_loaded"], 0)
        headroom = 0.03 * free / e["max_active"] if e["max_active"] > 0 else 0.0
        scores[name] = {"lora-affinity": affinity, "lora-load-state": tier * (1 - 0.06) + headroom,
                        "queue": 1.0 if hi == lo else (hi - e["waiting_queue"]) / (hi - lo),
                        "kv-cache-utilization": 1 - e["kv"]}
    total = {n: sum(WEIGHTS[k] * v for k, v in s.items()) for n, s in scores.items()}
    return max(total, key=total.get), scores


def test_the_published_scoring_rules_prefer_the_endpoint_holding_the_adapter(pair, adapter_dirs):
    p, q = pair
    adapter = "gw-x"
    load(p, adapter, adapter_dirs["down-r1"])
    load(q, "all-r8", adapter_dirs["all-r8"])  # q holds another adapter only
    with tcp(p) as c:
        c.post("/reset_prefix_cache").raise_for_status()
    p.wait_idle(30)
    q.wait_idle(30)

    endpoints = {"p": endpoint_state(scrape(p)), "q": endpoint_state(scrape(q))}
    assert endpoints["p"]["loaded"][adapter][0] == "gpu" and adapter not in endpoints["q"]["loaded"]
    chosen, scores = score(endpoints, adapter)
    assert chosen == "p", scores
    # the request-activity scorer alone cannot tell them apart (nothing runs): residency decides
    assert scores["p"]["lora-affinity"] == scores["q"]["lora-affinity"] == 0.8
    assert scores["p"]["lora-load-state"] > scores["q"]["lora-load-state"]

    # both hold it; p is busy with it (one running, two waiting): the queue and KV terms win over
    # the affinity to p's running adapter, and the request goes to q
    load(q, adapter, adapter_dirs["down-r1"])
    deadline, threads, seen = time.monotonic() + 60, [], None
    while seen is None:
        assert time.monotonic() < deadline, "p was never seen busy with the adapter"
        if not any(t.is_alive() for t in threads):
            threads = busy(p, adapter, 3)
        m = scrape(p)
        state = endpoint_state(m)
        if adapter in state["active"] and state["waiting_queue"] >= 1:
            seen = {"p": state, "q": endpoint_state(scrape(q))}
        time.sleep(0.005)
    chosen, scores = score(seen, adapter)
    assert seen["q"]["loaded"][adapter][0] == "gpu" and seen["q"]["waiting_queue"] == 0
    assert scores["p"]["lora-affinity"] == 1.0 and scores["q"]["lora-affinity"] == 0.8
    assert scores["p"]["queue"] == 0.0 and scores["q"]["queue"] == 1.0
    assert chosen == "q", scores
    for t in threads:
        t.join(120)
