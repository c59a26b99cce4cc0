"""POISE's files: the estimator's one safetensors file (its layout and `save`/`load`: `EstimatorFile`), written
atomically, and the layouts of poise-trl 0.1.

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

from .buffer import ProbeBuffer
from .features import FeatureLayout
from .heads import head_from_config
from .probe import ValueProbe

FORMAT = "poise-estimator/1"
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


def strip_prefix(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The tensors whose key starts with `prefix`, keyed without it."""
    return {key[len(prefix) :]: value for key, value in tensors.items() if key.startswith(prefix)}


def with_scalars(features: dict[str, Any]) -> dict[str, Any]:
    """A feature configuration that records the rollout scalars its rows hold: one written before `probe_scalars`
    (or by a loop that names none) holds the paper's three entropy statistics where its blocks hold "entropy"."""
    if "probe_scalars" in features:
        return features
    return {**features, "probe_scalars": list(FeatureLayout(tuple(features.get("probe_features", ()))).read_scalars)}


def check_feature_config(saved: dict[str, Any], current: dict[str, Any], source: str) -> None:
    """Refuse a state fitted on features this run does not extract, naming each setting that differs (the rollout
    scalars compared as `with_scalars` records them)."""
    saved, current = with_scalars(saved), with_scalars(current)
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


class EstimatorFile:
    """The estimator's persistence (a mixin of `POISEEstimator`, which holds the attributes it reads): its state as
    tensors and JSON, and the one safetensors file. Tensors are keyed `domain.<i>.*` (each domain's learner),
    `bootstrap.<i>.*` (its shrunk-bootstrap pairs) and `<granularity>.*` (a token baseline's learner); the JSON names
    them in order, so names may hold any character; `history.*` is the prompt history's table (history.py). The JSON
    also holds the estimator's spec (specs.py, "spec"), which `POISEEstimator.from_file` builds it from; files
    written without one still load into an estimator built with their settings."""

    def state_dict(self, include_buffer: bool = True) -> dict[str, Any]:
        """{"tensors": CPU tensors, "info": JSON-able dict}: everything `load_state_dict` needs, no pickle."""
        tensors, domains = {}, []
        for i, (name, online) in enumerate(self.probes.items()):
            tensors.update({f"domain.{i}.{k}": v for k, v in online.state_dict(include_buffer).items()})
            domains.append({"name": name, **online.info(include_buffer)})
        pairs = [name for name, ring in self.bootstrap_pairs.items() if len(ring)]
        for i, name in enumerate(pairs):
            tensors.update({f"bootstrap.{i}.{k}": v for k, v in self.bootstrap_pairs[name].state_dict().items()})
        info = {
            "format": FORMAT,
            "num_generations": self.num_generations,
            "feature_config": dict(self.feature_config or {}),
            "bootstrap": self.spec.bootstrap,
            "domains": domains,
            "bootstrap_domains": pairs,
            "probe_steps": self.steps,
            "layer": self.layer,
            "reward_std": self.reward_std.state_dict(),
            "spec": self.spec.to_dict(),
        }
        tokens = self.token_baseline
        if tokens.info() is not None:
            tensors.update({f"{tokens.name}.{k}": v for k, v in tokens.state_dict(include_buffer).items()})
            info[tokens.name] = tokens.info()
        if self.prompt_history is not None:
            tensors.update({f"history.{k}": v for k, v in self.prompt_history.state_dict().items()})
            info["history"] = self.prompt_history.info()
        return {"tensors": tensors, "info": info}

    def load_state_dict(
        self,
        state: dict[str, Any],
        warm_start: bool = False,
        source: str = "the state",
        device: torch.device | str | None = None,
    ) -> None:
        """Restore `state_dict()` exactly; with `warm_start`, only the probes, trusted at once and with fresh step
        counters (a new run starting from a saved probe; the prompt history starts afresh too). Buffers go to
        `device` (where the features will come from). Refuses a state of another feature configuration or prompt
        history setting, and on resume one whose refit settings, bootstrap or history table differ from this
        estimator's."""
        tensors, info = state["tensors"], state["info"]
        check_feature_config(info.get("feature_config") or {}, self.feature_config or {}, source)
        if not warm_start and info.get("bootstrap") not in (None, self.spec.bootstrap):
            raise ValueError(
                f"{source} was written by a run with probe_bootstrap={info['bootstrap']!r}, but this run sets "
                f"probe_bootstrap={self.spec.bootstrap!r}. Resume with the setting the run was started with."
            )
        self.check_history(info.get("history"), warm_start, source)
        probes = {}
        for i, domain in enumerate(info["domains"]):
            name = domain["name"]
            online = self.new_probe(name)  # this run's settings and capacity (the newest rows survive)
            saved = head_from_config(domain["probe"], domain.get("head", ValueProbe.name))
            if warm_start and saved.name != online.probe.name:  # the learner refits the head it predicts with
                raise ValueError(
                    f"The probe in {source} (domain {name!r}) is a {saved.name!r} head, but this run's head is "
                    f"{online.probe.name!r}: a warm start predicts with the loaded fit until its first refit, which "
                    f"uses the same head. Warm-start with the head the file was saved with, or start without it."
                )
            if not warm_start and (saved.name, saved.config()) != (online.probe.name, online.probe.config()):
                raise ValueError(
                    f"The probe in {source} (domain {name!r}) refits with {self.describe_probe(saved)}, but this run "
                    f"sets {self.describe_probe(online.probe)}. Resume with the settings (or probe_preset) the run "
                    "was started with; to change them, start a new run with probe_init_path pointing at this file."
                )
            online.load_state(strip_prefix(tensors, f"domain.{i}."), domain, device, warm_start)
            probes[name] = online
        self.probes = probes
        tokens = self.token_baseline  # a sequence-level run's file has none: a token baseline starts afresh
        tokens.load_state(strip_prefix(tensors, f"{tokens.name}."), info.get(tokens.name, {}), warm_start, device)
        self.layer_index = self.layers.index(int(info["layer"]))
        self.steps = 0 if warm_start else int(info.get("probe_steps", 0))
        if warm_start:
            return
        if "reward_std" in info:
            self.reward_std.load_state_dict(info["reward_std"])
        self.bootstrap_pairs = {}
        for i, name in enumerate(info.get("bootstrap_domains", [])):
            ring = ProbeBuffer(self.capacity(name))
            ring.load_state_dict(strip_prefix(tensors, f"bootstrap.{i}."), device)
            self.bootstrap_pairs[name] = ring
        self.bootstrap_lines = self.fit_bootstrap_lines()
        if self.prompt_history is not None:
            self.prompt_history.load_state_dict(strip_prefix(tensors, "history."), info["history"], device)

    def check_history(self, saved: dict[str, Any] | None, warm_start: bool, source: str) -> None:
        """Refuse a state whose probes read other inputs (history on in one, off in the other: files written before
        the history have none), and on resume a table of another size or decay."""
        history = self.prompt_history is not None
        if (saved is not None) != history:
            raise ValueError(
                f"{source} was written by a run with probe_history={saved is not None}, but this run sets "
                f"probe_history={history}: {'this run' if history else 'the file'}'s probes read the "
                "history columns and the other's do not. Resume or warm-start with the setting the file was written "
                "with."
            )
        if saved is None or warm_start:
            return
        current = self.prompt_history.info()
        if (saved["size"], saved["decay"]) != (current["size"], current["decay"]):
            raise ValueError(
                f"{source} holds a prompt history of probe_history_size={saved['size']}, probe_history_decay="
                f"{saved['decay']}, but this run sets {current['size']} and {current['decay']}. Resume with the "
                "settings the run was started with."
            )

    def save(self, path: str | os.PathLike, include_buffer: bool = True) -> None:
        """One safetensors file (the JSON in its header), written atomically."""
        state = self.state_dict(include_buffer)
        atomic_save(state["tensors"], path, metadata={"poise": json.dumps(state["info"], sort_keys=True)})

    def load(
        self,
        path: str | os.PathLike,
        warm_start: bool = False,
        bootstrap_path: str | os.PathLike | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        """Load a file written by `save`, or poise-trl 0.1's probe file (`path` + '.json' beside it) with, on
        resume, its `poise_bootstrap.safetensors` as `bootstrap_path`."""
        self.load_state_dict(read_state(path, bootstrap_path), warm_start, str(path), device)


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
    probe.load_state_dict(strip_prefix(tensors, "probe."))
    buffer = None
    if info.get("buffer_capacity") is not None:
        buffer = ProbeBuffer(info["buffer_capacity"])
        buffer.load_state_dict(strip_prefix(tensors, "buffer."))
    return probe, buffer, info


def load_probe_set(
    path: str | Path, single_name: str = "default"
) -> tuple[dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]], dict]:
    """Inverse of `save_probe_set`: {name: (tensors, per-probe info)} for `OnlineLearner.load_state`, and the JSON.

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
        out[domain["name"]] = (strip_prefix(tensors, prefix), domain)
    return out, info
