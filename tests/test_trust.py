"""The one trust check (``mlx_edge0.trust``) on every entry point: a
checkpoint's ``model_file`` outside the checkpoint, a symlinked shim, a shim
that is not ours, other Python code or bytecode; nothing of it is imported by
mlx-edge0, and the shim binds to the directory it was loaded from."""

from __future__ import annotations

import json
import marshal
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import mlx_edge0
from mlx_edge0.checkpoint import SHIM_FILE, SHIM_SOURCE
from mlx_edge0.cli import main
from mlx_edge0.trust import UntrustedCodeError, check_code, inspect_code

EDGE0 = [sys.executable, "-c", "from mlx_edge0.cli import main; main()"]


def hostile_code(marker: Path) -> str:
    """Python that leaves ``marker`` behind if anything ever imports it."""
    return f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"


@pytest.fixture
def ckpt(converted, tmp_path) -> Path:
    out = tmp_path / "ckpt"
    shutil.copytree(converted("qwen3_moe").edge0, out)
    return out


def set_model_file(ckpt: Path, model_file: str) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    config["model_file"] = model_file
    (ckpt / "config.json").write_text(json.dumps(config))


def test_a_converted_checkpoint_passes(ckpt):
    assert check_code(ckpt) == ckpt
    report = inspect_code(ckpt)
    assert report.shim_ok and report.problems == () and report.model_file_path == ckpt / SHIM_FILE


@pytest.mark.parametrize("where", ["parent", "absolute", "subdir"])
def test_model_file_outside_the_checkpoint_is_never_imported(ckpt, tmp_path, where):
    marker = tmp_path / "ran"
    outside = tmp_path / "x.py"
    outside.write_text(hostile_code(marker))
    name = {"parent": "../x.py", "absolute": str(outside), "subdir": "sub/../../x.py"}[where]
    set_model_file(ckpt, name)
    with pytest.raises(UntrustedCodeError, match=r"config.json: model_file .* is not a file name inside"):
        mlx_edge0.load(ckpt)
    with pytest.raises(UntrustedCodeError):
        mlx_edge0.load_model(ckpt)
    result = subprocess.run(
        [*EDGE0, "generate", "--model", str(ckpt), "-m", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "is not a file name inside the checkpoint" in result.stderr
    assert "Traceback" not in result.stderr
    info = CliRunner().invoke(main, ["info", str(ckpt)])
    assert info.exit_code == 0
    assert f"mlx_lm --trust-remote-code would execute {outside}" in info.output
    assert "refuses this checkpoint" in info.output
    assert not marker.exists()


def test_symlinked_shim_binds_nowhere_else(converted, tmp_path):
    """The shim of checkpoint A is a symlink to B's shim: byte-identical, so
    the old byte comparison passed, and the shim resolved its path into B and
    streamed B's experts. Now every entry point refuses it, stock mlx_lm
    with --trust-remote-code included."""
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(converted("qwen3_moe").edge0, a)
    shutil.copytree(converted("bailing_moe").edge0, b)
    (a / SHIM_FILE).unlink()
    (a / SHIM_FILE).symlink_to(b / SHIM_FILE)
    with pytest.raises(UntrustedCodeError, match=rf"{a / SHIM_FILE}: is a symlink \(to {b / SHIM_FILE}\)"):
        mlx_edge0.load(a)
    info = CliRunner().invoke(main, ["info", str(a)])
    assert f"would execute {b / SHIM_FILE}" in info.output
    stock = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm",
            "generate",
            "--model",
            str(a),
            "--trust-remote-code",
            "--prompt",
            "x",
            "-m",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stock.returncode != 0 and f"{a / SHIM_FILE}: is a symlink" in stock.stderr


def test_stock_mlx_lm_binds_the_shim_to_its_own_directory(ckpt, tmp_path):
    """A copy of a checkpoint (real files) streams its own experts, not the
    original's, under stock mlx_lm --trust-remote-code."""
    from mlx_lm import load as mlx_lm_load

    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    model, _ = mlx_lm_load(str(copy), trust_remote_code=True)
    assert model.edge0_checkpoint_dir == copy


def test_foreign_shim_other_code_and_bytecode(ckpt, tmp_path):
    marker = tmp_path / "ran"
    (ckpt / SHIM_FILE).write_text(hostile_code(marker) + SHIM_SOURCE)
    with pytest.raises(UntrustedCodeError, match="not the mlx-edge0 shim"):
        mlx_edge0.load(ckpt)
    (ckpt / SHIM_FILE).write_text(SHIM_SOURCE)
    # the bytecode Python caches for the shim passes only when it is the shim's code
    cache = ckpt / "__pycache__"
    cache.mkdir()
    pyc = cache / f"edge0_model.{sys.implementation.cache_tag}.pyc"
    header = importlib.util.MAGIC_NUMBER + bytes(12)
    pyc.write_bytes(header + marshal.dumps(compile(SHIM_SOURCE, str(ckpt / SHIM_FILE), "exec", dont_inherit=True)))
    assert check_code(ckpt) == ckpt
    pyc.write_bytes(header + marshal.dumps(compile(hostile_code(marker) + SHIM_SOURCE, "x", "exec")))
    with pytest.raises(UntrustedCodeError, match=r"holds other Python code \['__pycache__/edge0_model"):
        mlx_edge0.load(ckpt)
    pyc.unlink()
    (ckpt / "helper.py").write_text(hostile_code(marker))
    with pytest.raises(UntrustedCodeError, match=r"holds other Python code \['helper.py'\]"):
        mlx_edge0.load(ckpt)
    (ckpt / "helper.py").unlink()
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**tok, "auto_map": {"AutoTokenizer": ["x.X", None]}}))
    with pytest.raises(UntrustedCodeError, match=r"auto_map in \['tokenizer_config.json'\]"):
        mlx_edge0.load(ckpt)
    assert not marker.exists()


def test_every_command_that_loads_refuses_a_foreign_shim(ckpt, tmp_path):
    marker = tmp_path / "ran"
    (ckpt / SHIM_FILE).write_text(hostile_code(marker))
    commands = {
        "generate": ["generate", "--model", str(ckpt), "-m", "2"],
        "serve": ["serve", "--model", str(ckpt), "--port", "1"],
        "heads init": ["heads", "init", str(ckpt)],
        "eval": ["eval", str(ckpt), "--windows", "1", "--max-files", "1"],
    }
    for name, argv in commands.items():
        result = CliRunner().invoke(main, argv)
        assert result.exit_code == 1, (name, result.output)
        assert f"{ckpt / SHIM_FILE}: not the mlx-edge0 shim" in result.output, (name, result.output)
    assert not marker.exists()


def test_missing_or_unreadable_paths_are_named(tmp_path):
    result = CliRunner().invoke(main, ["info", str(tmp_path / "nope")])
    assert result.exit_code == 1 and f"{tmp_path / 'nope'}: no such checkpoint directory" in result.output
    result = CliRunner().invoke(main, ["generate", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1 and "no such checkpoint directory" in result.output


def test_load_expands_the_home_directory(ckpt, monkeypatch):
    monkeypatch.setenv("HOME", str(ckpt.parent))
    model = mlx_edge0.load_model(f"~/{ckpt.name}", cache_gib=0)
    assert model.edge0_checkpoint_dir == ckpt


def drop_file_capabilities() -> None:
    """As root, drop the capabilities that bypass file permissions from the
    bounding set before exec, so the child meets them as anyone would."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


@pytest.mark.skipif(sys.platform != "linux", reason="drops Linux capabilities to make root meet permissions")
@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors", "experts/layer_001.safetensors", "tokenizer.json"]
)
def test_unreadable_file_is_named_without_a_traceback(ckpt, name):
    (ckpt / name).chmod(0)
    for argv in (["generate", "--model", str(ckpt), "-m", "2"], ["info", str(ckpt)]):
        if name == "tokenizer.json" and argv[0] == "info":
            continue  # info reads no tokenizer
        result = subprocess.run(
            [*EDGE0, *argv],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=drop_file_capabilities if os.geteuid() == 0 else None,
        )
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr
        assert str(ckpt / name) in result.stderr and "Permission denied" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-m", "-5"], "--max-tokens must be at least 1, got -5"),
        (["-m", "0"], "--max-tokens must be at least 1, got 0"),
        (["--prompt", ""], "--prompt is empty"),
    ],
)
def test_generate_refuses_bad_lengths(ckpt, argv, message):
    result = CliRunner().invoke(main, ["generate", "--model", str(ckpt), *argv])
    assert result.exit_code == 1 and message in result.output, result.output
