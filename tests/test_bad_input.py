"""Bad checkpoints fail at load with a clear error naming the file and problem."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.checkpoint import CheckpointError, ExpertGeometry, expert_file
from mlx_edge0.cli import main
from mlx_edge0.tensorfile import TensorFileError, TensorWriter

LAYER = expert_file(1)


@pytest.fixture
def ckpt(converted, tmp_path) -> Path:
    path = tmp_path / "ckpt"
    shutil.copytree(converted("qwen3_moe").edge0, path)
    return path


def _rewrite_header(path: Path, mutate) -> None:
    """Change a safetensors header in place, keeping its length (space padded)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    mutate(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


def _load_error(path: Path) -> str:
    with pytest.raises((TensorFileError, CheckpointError, ValueError)) as info:
        mlx_edge0.load(path)
    return str(info.value)


def test_truncated_expert_file(ckpt):
    f = ckpt / LAYER
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 5000])
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "truncated" in msg


def test_header_length_beyond_file(ckpt):
    f = ckpt / LAYER
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "header length" in msg


def test_header_offset_past_eof(ckpt):
    def mutate(h):
        h["experts.15.down_proj.biases"]["data_offsets"][1] += 10**9

    _rewrite_header(ckpt / LAYER, mutate)
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "experts.15.down_proj.biases" in msg


def test_overlapping_offsets(ckpt):
    def mutate(h):
        a = h["experts.3.up_proj.weight"]["data_offsets"]
        b = h["experts.3.gate_proj.weight"]["data_offsets"]
        h["experts.3.up_proj.weight"]["data_offsets"], h["experts.3.gate_proj.weight"]["data_offsets"] = (
            [b[0], b[0] + a[1] - a[0]], a,
        )

    _rewrite_header(ckpt / LAYER, mutate)
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and ("overlap" in msg or "span" in msg)


def test_wrong_tensor_shape(ckpt):
    wrong = ExpertGeometry(num_experts=16, hidden_size=128, intermediate_size=128)
    with TensorWriter(ckpt / LAYER, wrong.file_entries(), alignment=4096) as w:
        for name, dtype, shape in wrong.file_entries():
            import numpy as np

            nbytes = int(np.prod(shape)) * {"U32": 4, "BF16": 2, "U8": 1}[dtype]
            w.write(name, bytes(nbytes))
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "the config needs" in msg


def test_missing_expert_file(ckpt):
    (ckpt / LAYER).unlink()
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "missing" in msg


def test_unknown_model_type(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "mixtral"
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = _load_error(ckpt)
    assert "config.json" in msg and "'mixtral' is not supported" in msg


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    msg = _load_error(ckpt)
    assert "config.json" in msg and "not valid JSON" in msg


def test_missing_edge0_section(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    del config["edge0"]
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = _load_error(ckpt)
    assert "config.json" in msg and "not an edge0 checkpoint" in msg


def test_cli_reports_bad_checkpoint_without_traceback(ckpt):
    (ckpt / LAYER).unlink()
    result = CliRunner().invoke(main, ["generate", "--model", str(ckpt), "--max-tokens", "2"])
    assert result.exit_code == 1
    assert "layer_001.safetensors" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["info", str(ckpt)])
    assert result.exit_code == 1 and "layer_001.safetensors" in result.output
