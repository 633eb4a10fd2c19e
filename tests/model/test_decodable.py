"""Generation never draws an id the tokenizer cannot decode (collage_train/model/decodable.py).

A model whose embedding is padded past its tokenizer (``model.vocab_size``) and whose
padded rows win every draw still writes only decodable ids through ``generate`` (the
command and the end-of-run sample share it); and a padded run of every family trains,
exports a reloadable ``hf/``, samples, generates and resumes at ``max_steps`` with exit 0.
"""

from __future__ import annotations

import json

import pytest
import torch
from tiny_config import favouring_padded_rows, train_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from collage_train import generate as generate_command
from collage_train.generate import generate
from collage_train.model.build import FAMILIES
from collage_train.model.decodable import DecodableIds

PADDED = 1024  # the tiny runs' 512-piece tokenizer, padded to twice its size
PRESETS = {"gpt": "model=gpt_tiny", "opt": "model=opt_125m", "llama": "model=llama_tiny"}


@pytest.fixture(scope="module")
def tokenizer(corpus_dir, tmp_path_factory):
    return train_tokenizer(corpus_dir, tmp_path_factory.mktemp("tokenizer") / "tokenizer.model")


def test_the_mask_leaves_the_tokenizers_ids_and_removes_the_padded_ones():
    scores = torch.randn(2, 96, dtype=torch.float64)
    masked = DecodableIds(80)(torch.zeros(2, 1, dtype=torch.long), scores)
    assert torch.equal(masked[:, :80], scores[:, :80])
    assert torch.isneginf(masked[:, 80:]).all()
    assert DecodableIds(96)(None, scores) is scores  # nothing padded: nothing changes


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_generation_never_draws_a_padded_id(family, temperature, tokenizer, monkeypatch):
    model = favouring_padded_rows(family, tokenizer, rows=tokenizer.vocab_size + 64)
    drawn: list[int] = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids: decode(drawn.extend(ids) or ids))
    text = generate(
        model, tokenizer, "def ", max_new_tokens=12, temperature=temperature, top_k=50, seed=0
    )
    assert text.startswith("def ") and drawn
    assert max(drawn) < tokenizer.vocab_size, drawn


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_padded_vocabulary_trains_exports_samples_and_resumes(
    family, in_process, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    length = ["train.max_steps=2", "train.eval_every=2", "train.checkpoint_every=2"]
    padded = [PRESETS[family], f"model.vocab_size={PADDED}", "logging.sample_tokens=24"]
    first = in_process(*padded, *length, run_dir=run_dir)
    assert first.returncode == 0, first.stderr
    assert "warning:" not in first.stdout and "Traceback" not in first.stderr
    sample = json.loads((run_dir / "summary.json").read_text())["sample"]
    assert sample.startswith("def ") and len(sample) > len("def ")

    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    hf_tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf")
    assert exported.config.vocab_size == PADDED and len(hf_tokenizer) == 512
    ids = hf_tokenizer("def f(x):", return_tensors="pt").input_ids
    assert exported(input_ids=ids).logits.shape[-1] == PADDED

    # the command, from the export and from the checkpoint, sampled and greedy
    for path, temperature in [(run_dir, "0.8"), (run_dir / "checkpoints" / "step-2", "0")]:
        capsys.readouterr()
        args = [str(path), "--temperature", temperature, "--max-new-tokens", "24"]
        assert generate_command.main(args) == 0
        assert capsys.readouterr().out.startswith("def ")

    resumed = in_process(*padded, *length, "train.resume=true", run_dir=run_dir)
    assert resumed.returncode == 0, resumed.stderr
    assert "warning:" not in resumed.stdout and "Traceback" not in resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["sample"].startswith("def ")
