"""Bad input gets a LorafleetError whose message names the problem."""

from __future__ import annotations

import json
import shutil

import pytest

from lorafleet import Engine, SamplingParams
from lorafleet.errors import (InvalidRequestError, LorafleetError, ModelLoadError,
                              UnsupportedModelError)


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path / "m")
    edit_config(folder, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        Engine(folder)


def test_unsupported_rope_scaling_is_named(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path / "m")
    edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        Engine(folder)


def test_missing_config_and_missing_weights(llama_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        Engine(tmp_path)
    folder = copy_model(llama_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        Engine(folder)


def test_pickle_only_weights_are_refused(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        Engine(folder)


def test_truncated_weights_file_is_named(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        Engine(folder)


def test_weights_that_disagree_with_the_config_are_named(llama_dir, tmp_path):
    folder = copy_model(llama_dir, tmp_path / "m")
    edit_config(folder, intermediate_size=96)
    with pytest.raises(ModelLoadError, match="gate_proj.weight.*shape"):
        Engine(folder)
    edit_config(folder, intermediate_size=128, num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="layers.2"):
        Engine(folder)


def test_sharded_checkpoints_load(llama_dir, tmp_path):
    from tests.fixtures import load_hf
    folder = tmp_path / "sharded"
    load_hf(llama_dir).save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").exists()
    ids = list(range(3, 20))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    assert (Engine(folder).generate([ids], params)[0].token_ids
            == Engine(llama_dir).generate([ids], params)[0].token_ids)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llama_dir):
    engine = Engine(llama_dir, pool_bytes=4 << 20, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="prompt has 64 tokens.*64"):
        engine.add_request(list(range(3, 67)))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request([])
    with pytest.raises(InvalidRequestError, match=r"\[0, 160\)"):
        engine.add_request([5, 999])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("text needs a tokenizer")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([5], request_id="x")
        engine.add_request([6], request_id="x")
    engine.abort("x")
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("kwargs, named", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"),
    (dict(logprobs=100), "logprobs"),
    (dict(seed="abc"), "seed"),
    (dict(stop=[""]), "stop"),
])
def test_bad_sampling_values_are_named(kwargs, named):
    with pytest.raises(InvalidRequestError, match=named):
        SamplingParams(**kwargs)


def test_errors_are_lorafleet_errors_with_http_status():
    assert issubclass(InvalidRequestError, LorafleetError)
    assert InvalidRequestError.http_status == 400
