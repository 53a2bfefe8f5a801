"""The shipped fleet is in real formats: transformers loads the base and its tokenizer (with the
chat template), peft loads every adapter, and their greedy answers and log-probabilities equal
lorafleet's on a sample of held-out texts. (Whether the answers are right is test_fleet.py's.)"""

from __future__ import annotations

import pytest
import torch

from lorafleet import SamplingParams
from lorafleet.demo import BASE_DIR, FLEET_DIR
from lorafleet.demo.evaluate import fleet_engine
from lorafleet.demo.skills import SKILLS, held_out_texts, user_turn

SAMPLE = held_out_texts(200)[:6]


@pytest.fixture(scope="module")
def engine():
    eng = fleet_engine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(BASE_DIR)
    # a fresh base per adapter: PEFT's unload() puts a saved module's trained copy in the base (upper's LM head)
    return tok, lambda: transformers.AutoModelForCausalLM.from_pretrained(BASE_DIR, dtype=torch.float32).eval()


@pytest.mark.parametrize("skill", [None, *SKILLS], ids=lambda s: s or "base")
def test_transformers_and_peft_answer_like_lorafleet(engine, hf, skill):
    import peft

    tok, load_base = hf
    model = peft.PeftModel.from_pretrained(load_base(), FLEET_DIR / skill).eval() if skill else load_base()
    for text in SAMPLE:
        messages = [{"role": "user", "content": user_turn(skill, text)}]
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False).input_ids
        assert ids == engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        with torch.no_grad():
            ref = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        ref_ids = ref.sequences[0, len(ids):].tolist()
        ref_lp = [torch.log_softmax(lg[0].float(), -1)[t].item() for lg, t in zip(ref.logits, ref_ids)]
        ours = engine.generate([ids], SamplingParams(max_tokens=40, temperature=0.0, logprobs=0), [skill])[0]
        assert ours.token_ids == ref_ids, f"{skill}({text!r})"
        assert tok.decode(ref_ids, skip_special_tokens=True) == ours.text
        lp = [d[t] for d, t in zip(ours.logprobs, ours.token_ids)]
        assert max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-4
