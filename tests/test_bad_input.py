"""Bad checkpoints fail at load with a clear error naming the file and problem."""

from __future__ import annotations

import json
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
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
            [b[0], b[0] + a[1] - a[0]],
            a,
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


def test_truncated_resident_file(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5000])
    msg = _load_error(ckpt)
    assert "model.safetensors" in msg and "truncated" in msg


def test_wrong_dtype_in_header(ckpt):
    def mutate(h):
        h["experts.4.up_proj.scales"]["dtype"] = "F16"  # same bytes, other meaning

    _rewrite_header(ckpt / LAYER, mutate)
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "'experts.4.up_proj.scales' is F16" in msg


@pytest.mark.parametrize("key,value", [("bits", 8), ("group_size", 32), ("scales_dtype", "F16")])
def test_expert_quantization_params_that_do_not_match_the_files(ckpt, key, value):
    """Shapes pin (bits, group size, scales dtype) exactly, so a config that
    describes the experts differently is refused before any expert is read."""
    config = json.loads((ckpt / "config.json").read_text())
    config["edge0"]["experts"][key] = value
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = _load_error(ckpt)
    assert "layer_001.safetensors" in msg and "the config needs" in msg


def test_resident_quantization_params_come_from_the_tensors(ckpt):
    """mlx-lm infers each resident layer's bits and group size from its
    tensors, so wrong top-level values in config.json change nothing."""
    tokens = mx.array([[5, 17, 99, 3, 250]])
    want = mlx_edge0.load_model(ckpt, cache_gib=0)(tokens)
    config = json.loads((ckpt / "config.json").read_text())
    for section in ("quantization", "quantization_config"):
        config[section].update(bits=8, group_size=32)
    (ckpt / "config.json").write_text(json.dumps(config))
    assert mx.array_equal(mlx_edge0.load_model(ckpt, cache_gib=0)(tokens), want).item()


def test_moe_layers_that_do_not_match_the_model(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    config["edge0"]["moe_layers"] = config["edge0"]["moe_layers"][:-1]
    (ckpt / "config.json").write_text(json.dumps(config))
    msg = _load_error(ckpt)
    assert "config.json" in msg and "do not match the MoE layers" in msg


# ------------------------------------------------------------------ convert

CONVERT = """
import resource, signal, sys
from mlx_edge0.conversions import ConversionError, ConvertOptions, convert
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
try:
    convert(sys.argv[1], sys.argv[2], ConvertOptions(show_progress=False))
except ConversionError as e:
    print(e)
    sys.exit(3)
"""


def test_disk_full_during_convert(converted, tmp_path):
    """The OS refuses a write mid-file (RLIMIT_FSIZE: the same failed write()
    a full disk gives, without needing one): a clear error, no OUT, no temp dir."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", CONVERT, str(converted("qwen3_moe").source), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert f"{out}: conversion failed while writing" in proc.stdout and "File too large" in proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_killed_convert_leaves_no_out(converted, tmp_path):
    """SIGKILL (or power loss) cannot be cleaned up after: OUT never appears
    half-written; only the hidden temp dir remains (it names the dead pid),
    and the next convert to OUT removes it."""
    out = tmp_path / "out"
    script = (
        "import os, signal, sys\n"
        "from mlx_edge0.conversions import converter as m\n"
        "real = m._write_layer\n"
        "def dying(*a, **k):\n"
        "    real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "m._write_layer = dying\n"
        "m.convert(sys.argv[1], sys.argv[2], m.ConvertOptions(show_progress=False))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(converted("qwen3_moe").source), str(out)], capture_output=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out.edge0-tmp-")
    from mlx_edge0.conversions import ConvertOptions, convert

    convert(converted("qwen3_moe").source, out, ConvertOptions(show_progress=False))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
