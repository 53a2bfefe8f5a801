"""The baselines: Hugging Face `generate` in static batches, as a user would serve without
lorafleet. One replay loop, three ways to run a batch:

  transformers  the base model alone (adapters ignored): the bound LoRA serving could reach
  peft-groups   PEFT, one adapter per batch (`set_adapter`; base requests under
                `disable_adapter()`), batches formed within an adapter's waiting requests
  peft-mixed    PEFT's mixed-adapter batch (`generate(..., adapter_names=...)`)

The replay: when a batch ends, the next is formed from the requests that have arrived by then
(up to `batch_size`; the loop sleeps until the next arrival when none has). A static batch runs
until its longest member is done, so every row computes that many tokens; only the tokens each
request asked for count as `generated_tokens` (all of them are in `details["computed_tokens"]`).
A stopping criterion timestamps every generated token, which gives each request's TTFT (first
token time minus its arrival) and TPOT. Adapters are loaded into PEFT before the clock starts.

Mixes: PEFT serves a request that mixes adapters on a merged adapter built for its mix, as a
user of PEFT would: `add_weighted_adapter(..., combination_type="cat")` (the same delta as
lorafleet's mix: the adapters' rank rows stacked, each B times its scale), once per distinct mix,
when a batch first needs it, the clock running, so the throughput pays the merges. Each replay
starts without them (dropped before the clock): every replay meets its mixes for the first time,
as the lorafleet systems meet their prompts. `transformers` ignores mixes as it ignores adapters.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from pathlib import Path

from lorafleet.bench.jobs import WARM_UP_PROMPT, Job, Replayed, System, sync
from lorafleet.bench.workloads import BenchRequest


class StaticBatchSystem(System):
    needs: tuple[str, ...] = ("transformers",)
    grouped = False  # a batch holds requests of one adapter (or one mix) only

    def __init__(self, *args, batch_size: int = 16, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size

    def skip_reason(self, job: Job) -> str | None:
        import importlib.util

        missing = [m for m in self.needs if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not installed (pip install 'lorafleet[bench]', or from a clone pip install -e '.[bench]')"
        return None

    def generate(self, batch: list[BenchRequest]) -> list[float]:
        """Run one static batch; return the perf_counter time of each generated token."""
        raise NotImplementedError

    def warm_up(self, job: Job) -> dict:
        """One small request on the first adapter (or mix) the requests use, one on the base."""
        t0 = time.perf_counter()
        first = next((r for r in self.served(job) if r.label is not None), None)
        warm = [BenchRequest(WARM_UP_PROMPT, 2, first.adapter, mix=first.mix)] if first else []
        for r in [*warm, BenchRequest(WARM_UP_PROMPT, 2)]:
            self.generate([r])
        return {"requests": len(warm) + 1, "seconds": time.perf_counter() - t0}

    def replay(self, job: Job) -> Replayed:
        requests = self.served(job)
        sync(self.device)
        start = time.perf_counter()
        waiting: list[BenchRequest]
        pending, waiting, metrics, computed = deque(requests), [], [], 0
        while pending or waiting:
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                waiting.append(pending.popleft())
            if not waiting:
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            batch = self._pick(waiting)
            began = time.perf_counter() - start
            times = [t - start for t in self.generate(batch)]
            computed += len(times) * len(batch)
            for r in batch:
                n = r.max_tokens
                metrics.append({"arrival_s": r.arrival_s, "ttft_s": times[0] - r.arrival_s,
                                "tpot_s": (times[n - 1] - times[0]) / (n - 1) if n > 1 else None,
                                "queue_s": began - r.arrival_s, "adapter_wait_s": 0.0,
                                "tokens": n, "adapter": r.label})
        sync(self.device)
        seconds = time.perf_counter() - start
        return Replayed(seconds, sum(r.max_tokens for r in requests), metrics,
                        details={"batch_size": self.batch_size, "computed_tokens": computed})

    def _pick(self, waiting: list[BenchRequest]) -> list[BenchRequest]:
        """The next batch, oldest first; removed from `waiting`."""
        if self.grouped:
            chosen = [r for r in waiting if r.label == waiting[0].label][:self.batch_size]
        else:
            chosen = waiting[:self.batch_size]
        ids = {id(r) for r in chosen}
        waiting[:] = [r for r in waiting if id(r) not in ids]
        return chosen

    # -- shared by the transformers-based systems -------------------------------------------
    def _load_base(self, model_dir: Path):
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kw: self.dtype})
        self.pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        return model.to(self.device).eval()

    def _generate(self, model, batch: list[BenchRequest], **kwargs) -> list[float]:
        import torch
        import transformers

        class Stamp(transformers.StoppingCriteria):
            """Never stops a row; notes when each token was generated."""
            def __init__(self):
                self.times = []

            def __call__(self, input_ids, scores, **kw):
                if input_ids.is_cuda:  # the time the token exists, not the time it was queued
                    torch.cuda.synchronize(input_ids.device)
                self.times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        new = max(r.max_tokens for r in batch)
        width = max(len(r.prompt) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):  # left padding
            ids[row, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt):] = 1
        stamp = Stamp()
        with torch.inference_mode():
            model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                           max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=self.pad,
                           stopping_criteria=transformers.StoppingCriteriaList([stamp]), **kwargs)
        sync(self.device)
        return stamp.times


class TransformersGenerate(StaticBatchSystem):
    """`model.generate` on the base model; the requests' adapters are ignored."""

    name = "transformers"
    mixes = True  # ignored, as adapters are

    def prepare(self, job: Job) -> dict:
        import transformers

        requests = self.served(job)
        self.model = self._load_base(Path(job.model_dir))
        ignored = sum(r.label is not None for r in requests)
        return {"transformers": transformers.__version__,
                **({"adapters": f"ignored for {ignored} requests: the base model only"} if ignored else {})}

    def generate(self, batch: list[BenchRequest]) -> list[float]:
        return self._generate(self.model, batch)


class _Peft(StaticBatchSystem):
    needs = ("transformers", "peft")
    mixes = True  # on a merged adapter per mix, built in the replay

    def skip_reason(self, job: Job) -> str | None:
        if not any(r.label for r in job.requests):
            return "the workload has no adapters"
        return super().skip_reason(job)

    def prepare(self, job: Job) -> dict:
        import peft

        names = list(dict.fromkeys(n for r in self.served(job) for n in r.names))
        t0 = time.perf_counter()
        model = peft.PeftModel.from_pretrained(self._load_base(Path(job.model_dir)), job.adapters[names[0]],
                                               adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(job.adapters[name], adapter_name=name)
        self.model = model.eval()
        self.merged: dict[str, str] = {}  # mix label -> its merged adapter's name in PEFT
        self.merge_s = 0.0
        return {"peft": peft.__version__, "adapters_loaded": len(names),
                "adapter_load_s": time.perf_counter() - t0}

    def adapter_for(self, r: BenchRequest) -> str | None:
        """The PEFT adapter that serves `r`: its own, or its mix's merged one (built now, timed,
        the first time a batch needs it); None for the base."""
        if not r.mix:
            return r.adapter
        assert r.label is not None  # a mix's label
        name = self.merged.get(r.label)
        if name is None:
            t0 = time.perf_counter()
            name = f"mix-{len(self.merged)}"  # a label's '.' cannot name a PEFT adapter (a module key)
            self.model.add_weighted_adapter([n for n, _ in r.mix], [s for _, s in r.mix], name,
                                            combination_type="cat")
            self.merge_s += time.perf_counter() - t0
            self.merged[r.label] = name
        return name

    def replay(self, job: Job) -> Replayed:
        with warnings.catch_warnings():  # PEFT names the adapter it makes active instead: each batch sets its own
            warnings.simplefilter("ignore", UserWarning)
            for name in self.merged.values():  # before the clock: this replay builds its own
                self.model.delete_adapter(name)
        self.merged, self.merge_s = {}, 0.0
        replayed = super().replay(job)
        if self.merged:
            replayed.details.update(merges=len(self.merged), merge_s=self.merge_s)
        return replayed


class PeftGroups(_Peft):
    """PEFT with `set_adapter` per batch; each batch holds one adapter's requests."""

    name = "peft-groups"
    grouped = True

    def generate(self, batch: list[BenchRequest]) -> list[float]:
        adapter = self.adapter_for(batch[0])
        if adapter is None:
            with self.model.disable_adapter():
                return self._generate(self.model, batch)
        self.model.set_adapter(adapter)
        return self._generate(self.model, batch)


class PeftMixed(_Peft):
    """PEFT's mixed-adapter batch: any adapters in one batch (`adapter_names`)."""

    name = "peft-mixed"

    def generate(self, batch: list[BenchRequest]) -> list[float]:
        return self._generate(self.model, batch, adapter_names=[self.adapter_for(r) or "__base__" for r in batch])
