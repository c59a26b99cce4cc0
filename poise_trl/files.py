"""POISE's files: the estimator's one safetensors file, written atomically, and the layouts of poise-trl 0.1.

Nothing is pickled: safetensors cannot execute code, so a downloaded probe file is safe to read. The 0.1 layouts
(`save_probe_file`: one probe; `save_probe_set`: named probes, e.g. one per domain; each with a `.json` beside it;
and a checkpoint's `poise_bootstrap.safetensors`) still load, through `read_state`.
"""

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .probe import ProbeBuffer, ValueProbe

DEFAULT_DOMAIN = "default"  # the one probe's name when rows carry no domain


def atomic_save(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file through a temporary file in the same folder and `os.replace`: a reader (or a resume
    after a crash) sees the old file or the complete new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        with open(temporary, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _strip(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with `prefix`, keyed without it."""
    return {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}


def check_feature_config(saved: dict[str, Any], current: dict[str, Any], source: str) -> None:
    """Refuse a state fitted on features this run does not extract, naming each setting that differs."""
    if saved != current:
        changed = ", ".join(
            f"{key}={current.get(key)!r} (saved: {saved.get(key)!r})"
            for key in sorted(set(saved) | set(current))
            if saved.get(key) != current.get(key)
        )
        raise ValueError(
            f"The probe in {source} was fitted on features {saved}, but this run extracts other features: this run "
            f"sets {changed}. Resume with the settings and model the file was written with, or start a fresh run."
        )


def read_state(path: str | os.PathLike, bootstrap_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """A saved estimator state as {"tensors", "info"}: the one-file format, or poise-trl 0.1's two files."""
    path = Path(path)
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    if "poise" in metadata:
        return {"tensors": load_file(str(path)), "info": json.loads(metadata["poise"])}
    states, info = load_probe_set(path, single_name=DEFAULT_DOMAIN)
    features = dict(info.get("feature_config") or {})
    if "probe_layer_candidates" not in features and isinstance(features.get("probe_layer"), int):
        features["probe_layer_candidates"] = [features["probe_layer"]]  # one fixed-layer probe (save_probe_file)
        info.setdefault("layer", features["probe_layer"])
    if features:
        features.setdefault("probe_partner_reward", False)  # files written before the partner-aware probe
        features["probe_domain_column"] = info.get("probe_domain_column")
    tensors, domains = {}, []
    for i, (name, (domain_tensors, domain)) in enumerate(states.items()):
        tensors.update({f"domain.{i}.{k}": v for k, v in domain_tensors.items()})
        domains.append({**domain, "name": name})
    converted = {**info, "feature_config": features or None, "domains": domains, "bootstrap": None}
    converted["bootstrap_domains"] = []
    if bootstrap_path is not None and Path(bootstrap_path).exists():
        with safe_open(str(bootstrap_path), framework="pt") as f:
            names = json.loads(f.metadata()["domains"])
        pairs = load_file(str(bootstrap_path))
        converted["bootstrap_domains"] = names
        tensors.update({f"bootstrap.{k}": v for k, v in pairs.items()})
    return {"tensors": tensors, "info": converted}


def save_probe_file(
    path: str | Path, probe: ValueProbe, buffer: ProbeBuffer | None = None, metadata: dict[str, Any] | None = None
) -> None:
    """Write `path` (safetensors: probe and buffer tensors) and `path` + '.json' (config). Nothing is pickled."""
    path = Path(path)
    tensors = {f"probe.{k}": v for k, v in probe.state_dict().items()}
    if buffer is not None:
        tensors.update({f"buffer.{k}": v for k, v in buffer.state_dict().items()})
    save_file(tensors, str(path))
    info = {"probe": probe.config(), "buffer_capacity": None if buffer is None else buffer.capacity}
    info.update(metadata or {})
    path.with_suffix(path.suffix + ".json").write_text(json.dumps(info, indent=2, sort_keys=True))


def load_probe_file(path: str | Path) -> tuple[ValueProbe, ProbeBuffer | None, dict[str, Any]]:
    """Inverse of `save_probe_file`; safetensors cannot execute code, so a downloaded file is safe to read."""
    path = Path(path)
    info = json.loads(path.with_suffix(path.suffix + ".json").read_text())
    tensors = load_file(str(path))
    probe = ValueProbe.from_config(info["probe"])
    probe.load_state_dict(_strip(tensors, "probe."))
    buffer = None
    if info.get("buffer_capacity") is not None:
        buffer = ProbeBuffer(info["buffer_capacity"])
        buffer.load_state_dict(_strip(tensors, "buffer."))
    return probe, buffer, info


def load_probe_set(
    path: str | Path, single_name: str = "default"
) -> tuple[dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]], dict]:
    """Inverse of `save_probe_set`: {name: (tensors, per-probe info)} for `OnlineProbe.load_state`, and the JSON.

    A single probe written by `save_probe_file` reads as one set member named `single_name`, with its buffer's
    (N, D) features as the one slice of (N, 1, D).
    """
    path = Path(path)
    info = json.loads(path.with_suffix(path.suffix + ".json").read_text())
    tensors = load_file(str(path))
    if "domains" not in info:  # save_probe_file's layout
        if "probe" not in info:
            raise ValueError(f"{path} holds neither a probe set (`save_probe_set`) nor a probe (`save_probe_file`).")
        state = {k: v.unsqueeze(1) if k == "buffer.features" else v for k, v in tensors.items()}
        steps = int(info.get("probe_steps", 0))
        member = {
            "probe": info["probe"],
            "steps": steps,
            "layer_index": 0,
            "warm_started": False,
            "refit_from_step": 0,
        }
        return {single_name: (state, member)}, info
    out = {}
    for i, domain in enumerate(info["domains"]):
        prefix = f"domain.{i}."
        out[domain["name"]] = (_strip(tensors, prefix), domain)
    return out, info
