"""``edge0 info``: what an edge0 checkpoint holds, validated on the way.

Every expert file's header is checked exactly as the runtime checks it, and
the code the checkpoint names goes through the trust check
(:func:`mlx_edge0.trust.inspect_code`) without raising: ``info`` says which
file ``mlx_lm --trust-remote-code`` would execute and why mlx-edge0 would
refuse the checkpoint, so it is also the way to vet a downloaded checkpoint
before running it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from .checkpoint import (
    CONFIG_FILE,
    RESIDENT_FILE,
    Edge0Section,
    expert_file,
    human_bytes,
    read_config,
)
from .integrity import check_generation
from .lora import has_adapters, read_adapters
from .popularity import PROFILE_FILE, describe_k, load_profile
from .prerouter_heads import load_heads
from .store import LayerFile
from .tensorfile import read_header
from .trust import checkpoint_dir, inspect_code

OPTIONAL_FILES = ("prerouter.safetensors", "adapters.safetensors", "adapter_config.json", PROFILE_FILE)


def describe(path: Path | str) -> dict[str, Any]:
    """A JSON-able description of a checkpoint dir (raises on invalid files)."""
    path = checkpoint_dir(path)
    config = read_config(path)
    section = Edge0Section.from_config(config, path / CONFIG_FILE)
    resident = read_header(path / RESIDENT_FILE)
    check_generation(resident.path, resident.metadata, section.generation)
    layers = []
    for layer in section.moe_layers:
        lf = LayerFile(path / expert_file(layer), section.experts, section.alignment, generation=section.generation)
        lf.close()
        layers.append({"layer": layer, "file": expert_file(layer), "bytes": (path / expert_file(layer)).stat().st_size})
    if section.prerouter:
        # validates file, ownership, shapes, K against config.json, source hash
        load_heads(path, section, int(section.prerouter.get("k", 0)))
    profile = load_profile(path, section)  # validates it against this checkpoint
    adapters = None
    if has_adapters(path):
        a = read_adapters(path, k=section.consumer_k)  # validates both files against this checkpoint
        kinds: dict[str, int] = {}
        for kind in a.kinds.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        adapters = {
            "rank": a.config.rank,
            "alpha": a.config.alpha,
            "scale": a.config.scale,
            "k": a.config.k,
            "targets": len(a.config.targets),
            "kinds": kinds,
            "bytes": a.nbytes,
        }
    code = inspect_code(path)
    g = section.experts
    return {
        "path": str(path.resolve()),
        "model_type": config["model_type"],
        "format_version": section.format_version,
        "moe_layers": list(section.moe_layers),
        "num_experts_per_tok": {
            str(i): (
                section.consumer_k
                if section.prerouter and i in section.prerouter["consumers"]
                else section.num_experts_per_tok
            )
            for i in section.moe_layers
        },
        "experts": {
            "num_experts": g.num_experts,
            "hidden_size": g.hidden_size,
            "intermediate_size": g.intermediate_size,
            "bits": g.bits,
            "group_size": g.group_size,
            "scales_dtype": g.scales_dtype,
            "bundle_bytes": g.bundle_bytes,
            "alignment": section.alignment,
        },
        "expert_files": layers,
        "expert_bytes": sum(x["bytes"] for x in layers),
        "resident_bytes": resident.file_size,
        "resident_tensors": len(resident.entries),
        "quantization": {k: v for k, v in (config.get("quantization") or {}).items() if not isinstance(v, dict)},
        "shim": {
            "file": code.model_file,
            "ours": code.shim_ok,
            "runs": _what_runs(code.model_file_path),
            "other_code": list(code.other_code),
            "auto_map": list(code.auto_map),
            "problems": list(code.problems),
        },
        "optional_files": {name: (path / name).exists() for name in OPTIONAL_FILES},
        "prerouter": section.prerouter,
        "adapters": adapters,
        "routing_profile": None
        if profile is None
        else {
            "tokens": profile.tokens,
            "layers": list(profile.layers),
            "k": None if profile.k is None else list(profile.k),
            "source": profile.source,
        },
    }


def _what_runs(model_file: Optional[Path]) -> Optional[str]:
    """The file ``--trust-remote-code`` would execute (symlinks followed, as Python does)."""
    if model_file is None:
        return None
    return str(model_file.resolve()) if model_file.exists() or model_file.is_symlink() else None


def _k_line(k_of: dict[str, int]) -> str:
    ks = sorted(set(k_of.values()))
    if len(ks) == 1:
        return f"{ks[0]} on every MoE layer"
    return ", ".join(f"K={k} on layers {[int(i) for i, v in k_of.items() if v == k]}" for k in ks)


def _heads_line(prerouter) -> str:
    if not prerouter:
        return "no"
    return (
        f"{len(prerouter['owners'])} (owners {prerouter['owners'][0]}-{prerouter['owners'][-1]}, "
        f"consumers {prerouter['consumers'][0]}-{prerouter['consumers'][-1]}, K={prerouter['k']}, "
        f"prerouting decode, per sequence in batches)"
    )


def _adapters_line(adapters) -> str:
    if not adapters:
        return "no"
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(adapters["kinds"].items()))
    return (
        f"r={adapters['rank']} alpha={adapters['alpha']:g} on {adapters['targets']} projections "
        f"({kinds}), K={adapters['k']}, {human_bytes(adapters['bytes'])}, unmerged"
    )


def _profile_line(profile) -> str:
    if not profile:
        return "no (`edge0 profile` counts a text's routings; the hot cache starts from them)"
    k = describe_k(profile["layers"], profile["k"])
    return f"{profile['tokens']} tokens ({profile['source']}), {k}: seeds the hot cache's counts"


def format_description(d: dict[str, Any]) -> str:
    g = d["experts"]
    lines = [
        f"edge0 checkpoint {d['path']}",
        f"  model_type      {d['model_type']} (format v{d['format_version']})",
        f"  MoE layers      {len(d['moe_layers'])}: {d['moe_layers']}",
        f"  experts         {g['num_experts']} x ({g['hidden_size']} -> {g['intermediate_size']}), "
        f"int{g['bits']} group {g['group_size']}, scales {g['scales_dtype']}, "
        f"{human_bytes(g['bundle_bytes'])}/expert",
        f"  K per layer     {_k_line(d['num_experts_per_tok'])}",
        f"  expert files    {human_bytes(d['expert_bytes'])} in {len(d['expert_files'])} files (headers valid)",
        f"  resident        {human_bytes(d['resident_bytes'])} ({d['resident_tensors']} tensors)",
        f"  quantization    {d['quantization']}",
        f"  prerouter heads {_heads_line(d['prerouter'])}",
        f"  LoRA adapters   {_adapters_line(d['adapters'])}",
        f"  routing profile {_profile_line(d['routing_profile'])}",
    ]
    shim = d["shim"]
    if shim["ours"]:
        lines.append(f"  remote code     {shim['file']} is the mlx-edge0 shim (imports mlx_edge0 only)")
    else:
        runs = shim["runs"] or "nothing (no such file)"
        lines.append(f"  WARNING         mlx_lm --trust-remote-code would execute {runs}")
    for problem in shim["problems"]:
        lines.append(f"  WARNING         {problem}")
    if shim["problems"]:
        lines.append("  WARNING         mlx-edge0 (load, generate, serve, ...) refuses this checkpoint")
    return "\n".join(lines)
