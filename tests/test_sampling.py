"""Sampling settings travel with a checkpoint (generation_config.json); the flags win."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlx_edge0.cli import main
from mlx_edge0.default_model import default_checkpoint
from mlx_edge0.sampling import Sampling, read_sampling


def test_the_default_model_ships_its_sampling_settings():
    sampling, source = read_sampling(default_checkpoint())
    assert source == default_checkpoint() / "generation_config.json"
    assert sampling == Sampling(temp=0.4, top_p=0.8, repetition_penalty=1.2, repetition_context_size=64)
    assert len(sampling.logits_processors()) == 1
    assert sampling.describe() == "temp 0.4, top_p 0.8, repetition_penalty 1.2, repetition_context_size 64"


def test_generation_config_is_read_as_hugging_face_means_it(tmp_path):
    assert read_sampling(tmp_path) == (Sampling(), None)
    assert Sampling().describe() == "greedy" and Sampling().logits_processors() == []
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps({"temperature": 0.7, "top_k": 20, "eos_token_id": 2}))
    assert read_sampling(tmp_path)[0] == Sampling(top_k=20)  # no do_sample: greedy
    path.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 20}))
    sampling = read_sampling(tmp_path)[0]
    assert sampling == Sampling(temp=0.7, top_k=20)
    assert sampling.override(temp=0.0, top_k=None) == Sampling(temp=0.0, top_k=20)


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"do_sample": true, "temperature": -1}', r"generation_config.json: temp must be >= 0 \(0 = greedy\), got -1"),
        ('{"top_k": 2.5}', "generation_config.json: top_k must be an integer >= 0, got 2.5"),
        ('{"repetition_penalty": "high"}', "generation_config.json: repetition_penalty must be > 0"),
        ("[1]", "generation_config.json: expected a JSON object, got list"),
        ("{", "generation_config.json: cannot be read as JSON"),
    ],
)
def test_a_bad_generation_config_names_the_file_and_field(tmp_path, content, message):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=message):
        read_sampling(tmp_path)


def test_default_generate_is_deterministic_and_flags_override_the_file():
    runner = CliRunner()
    first = runner.invoke(main, ["generate", "--max-tokens", "24"])
    assert first.exit_code == 0, first.output
    assert (
        "sampling: temp 0.4, top_p 0.8, repetition_penalty 1.2, repetition_context_size 64, seed 0 "
        "(from generation_config.json; flags override)"
    ) in first.output
    text = first.output.split("\nprompt: ")[0]  # what follows are timings
    again = runner.invoke(main, ["generate", "--max-tokens", "24", "--seed", "0"])
    assert again.output.split("\nprompt: ")[0] == text
    greedy = runner.invoke(
        main, ["generate", "--max-tokens", "24", "--temp", "0", "--top-p", "0", "--repetition-penalty", "1"]
    )
    assert "sampling: repetition_context_size 64, seed 0" in greedy.output
    assert greedy.output.split("\nprompt: ")[0] != text
    r = runner.invoke(main, ["generate", "--max-tokens", "4", "--top-p", "1.5"])
    assert r.exit_code == 1 and "top_p must be in [0, 1], got 1.5" in r.output
