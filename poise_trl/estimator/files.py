"""POISE's files: the estimator's learned state as tensors and JSON and back (`state_to_dict`, `state_from_dict`:
functions of the `state.EstimatorState` and the estimator's settings), its one safetensors file, written atomically,
and the layouts of poise-trl 0.1.

Nothing is pickled: safetensors cannot execute code, so a downloaded probe file is safe to read. The 0.1 layouts
(`save_probe_file`: one probe; `save_probe_set`: named probes, e.g. one per domain; each with a `.json` beside it;
and a checkpoint's `poise_bootstrap.safetensors`) still load, through `read_state`.
"""

import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..features.features import FeatureLayout
from ..heads.heads import head_from_config
from ..heads.interface import ValueHead
from ..heads.probe import ValueProbe, strip_prefix
from .baselines import RunningStd
from .batch import DEFAULT_DOMAIN
from .buffer import ProbeBuffer
from .history import PromptHistory
from .specs import BufferSpec, EstimatorSpec, HistorySpec, config_field
from .state import EstimatorState, bootstrap_lines, new_learner

FORMAT = "poise-estimator/1"


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


def state_to_dict(
    state: EstimatorState,
    num_generations: int,
    spec: EstimatorSpec,
    feature_config: dict[str, Any] | None,
    include_buffer: bool = True,
    preset: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An estimator's learned `state` and its settings as {"tensors": CPU tensors, "info": JSON-able dict}, no
    pickle. Tensors are keyed `domain.<i>.*` (each domain's learner), `bootstrap.<i>.*` (its shrunk-bootstrap pairs),
    `<granularity>.*` (a token baseline's learner) and `history.*` (the prompt history's table, history.py); the JSON
    names them in order, so names may hold any character, and holds the spec (specs.py, "spec"), which
    `POISEEstimator.from_file` builds the estimator from, and where the settings came from ("preset": the config's
    probe_preset and the settings changed from it; never checked)."""
    tensors, domains = {}, []
    for i, (name, online) in enumerate(state.probes.items()):
        tensors.update({f"domain.{i}.{k}": v for k, v in online.state_dict(include_buffer).items()})
        domains.append({"name": name, **online.info(include_buffer)})
    pairs = [name for name, ring in state.bootstrap_pairs.items() if len(ring)]
    for i, name in enumerate(pairs):
        tensors.update({f"bootstrap.{i}.{k}": v for k, v in state.bootstrap_pairs[name].state_dict().items()})
    info = {
        "format": FORMAT,
        "num_generations": num_generations,
        "feature_config": dict(feature_config or {}),
        "bootstrap": spec.bootstrap,
        "domains": domains,
        "bootstrap_domains": pairs,
        "probe_steps": state.steps,
        "layer": spec.layers.ids[state.layer_index],
        "reward_std": state.reward_std.state_dict(),
        "spec": spec.to_dict(),
    }
    if preset is not None:
        info["preset"] = dict(preset)
    tokens = state.token_baseline
    if tokens.info() is not None:
        tensors.update({f"{tokens.name}.{k}": v for k, v in tokens.state_dict(include_buffer).items()})
        info[tokens.name] = tokens.info()
    if state.prompt_history is not None:
        tensors.update({f"history.{k}": v for k, v in state.prompt_history.state_dict().items()})
        info["history"] = state.prompt_history.info()
    return {"tensors": tensors, "info": info}


def describe_head(head: ValueHead) -> str:
    """A head's refit settings, as error messages name them when the caller gives no words of its own."""
    return f"head {head.name!r} {json.dumps(head.config())}"


def state_from_dict(
    saved: dict[str, Any],
    spec: EstimatorSpec,
    feature_config: dict[str, Any] | None,
    current: EstimatorState,
    warm_start: bool = False,
    source: str = "the state",
    device: torch.device | str | None = None,
    describe: Callable[[ValueHead], str] | None = None,
    *,
    num_generations: int,
) -> EstimatorState:
    """The learned state `state_to_dict` wrote, for an estimator of `spec` and `feature_config` whose state is now
    `current`: exactly, or with `warm_start` only the probes (trusted at once, fresh step counters; the rest stays
    `current`'s: a new run starting from a saved probe). Buffers go to `device` (where the features will come from);
    each learner takes `spec`'s head settings and capacity (whole groups of `num_generations` where the spec keeps
    them; the newest rows survive). Refuses a state of another feature configuration or prompt history setting, and
    on resume one whose refit settings, bootstrap, schedule (`RESUMED`) or history table differ, naming a head's
    settings with `describe` (default: `describe_head`)."""
    describe = describe or describe_head
    tensors, info = saved["tensors"], saved["info"]
    check_feature_config(info.get("feature_config") or {}, feature_config or {}, source)
    if not warm_start:
        check_schedule(info.get("spec"), spec, source)
    if not warm_start and info.get("bootstrap") not in (None, spec.bootstrap):
        raise ValueError(
            f"{source} was written by a run with probe_bootstrap={info['bootstrap']!r}, but this run sets "
            f"probe_bootstrap={spec.bootstrap!r}. Resume with the setting the run was started with."
        )
    check_history(info.get("history"), spec.history, warm_start, source)
    probes = {}
    for i, domain in enumerate(info["domains"]):
        name = domain["name"]
        online = new_learner(spec, name, num_generations)  # this run's settings and capacity (the newest rows survive)
        saved_head = head_from_config(domain["probe"], domain.get("head", ValueProbe.name))
        if warm_start and saved_head.name != online.probe.name:  # the learner refits the head it predicts with
            raise ValueError(
                f"The probe in {source} (domain {name!r}) is a {saved_head.name!r} head, but this run's head is "
                f"{online.probe.name!r}: a warm start predicts with the loaded fit until its first refit, which "
                f"uses the same head. Warm-start with the head the file was saved with, or start without it."
            )
        if not warm_start and (saved_head.name, saved_head.config()) != (online.probe.name, online.probe.config()):
            raise ValueError(
                f"The probe in {source} (domain {name!r}) refits with {describe(saved_head)}, but this run "
                f"sets {describe(online.probe)}. Resume with the settings (or probe_preset) the run "
                "was started with; to change them, start a new run with probe_init_path pointing at this file."
            )
        probes[name] = online.loaded(strip_prefix(tensors, f"domain.{i}."), domain, device, warm_start)
    tokens = current.token_baseline  # a sequence-level run's file has none: a token baseline starts afresh
    tokens = tokens.loaded(strip_prefix(tensors, f"{tokens.name}."), info.get(tokens.name, {}), warm_start, device)
    layer_index = spec.layers.ids.index(int(info["layer"]))
    if warm_start:
        return replace(current, probes=probes, token_baseline=tokens, layer_index=layer_index, steps=0)
    reward_std = current.reward_std
    if "reward_std" in info:
        reward_std = RunningStd()
        reward_std.load_state_dict(info["reward_std"])
    pairs = {}
    for i, name in enumerate(info.get("bootstrap_domains", [])):
        pairs[name] = ProbeBuffer(spec.buffer.capacity(name))
        pairs[name].load_state_dict(strip_prefix(tensors, f"bootstrap.{i}."), device)
    history = None
    if spec.history is not None:
        history = PromptHistory(spec.history.size, spec.history.decay)
        history.load_state_dict(strip_prefix(tensors, "history."), info["history"], device)
    return EstimatorState(
        probes=probes,
        bootstrap_pairs=pairs,
        bootstrap_lines=bootstrap_lines(spec.bootstrap, pairs),
        reward_std=reward_std,
        steps=int(info.get("probe_steps", 0)),
        layer_index=layer_index,
        prompt_history=history,
        token_baseline=tokens,
    )


RESUMED = (
    (BufferSpec, "schedule"),
    (BufferSpec, "warmup_steps"),
    (BufferSpec, "domain_warmup_steps"),
    (BufferSpec, "whole_groups"),
    (BufferSpec, "routing"),
    (BufferSpec, "same_domain_groups"),
    (EstimatorSpec, "reward_range"),
)
"""The settings a run must resume with (besides the head's, the bootstrap and the history's, checked on their own):
what decides when a probe is fitted and trusted, what its buffers keep and which batches it accepts."""


def check_schedule(saved: dict[str, Any] | None, spec: EstimatorSpec, source: str) -> None:
    """Refuse to resume a state saved with other `RESUMED` settings, naming each (a spec saved before a setting
    existed ran its default; a file written before the spec was saved says nothing, and is taken)."""
    if saved is None:
        return

    def written(part: type, key: str) -> Any:
        holder = saved.get("buffer") or {} if part is BufferSpec else saved
        value = holder.get(key, part.__dataclass_fields__[key].default)
        return tuple(value) if isinstance(value, list) else value  # JSON's lists, the spec's tuples

    def held(part: type, key: str) -> Any:
        return getattr(spec.buffer if part is BufferSpec else spec, key)

    changed = [
        (config_field(part, key), written(part, key), held(part, key))
        for part, key in RESUMED
        if written(part, key) != held(part, key)
    ]
    if changed:
        raise ValueError(
            f"{source} was written by a run with "
            + ", ".join(f"{name}={old!r}" for name, old, _ in changed)
            + ", but this run sets "
            + ", ".join(f"{name}={new!r}" for name, _, new in changed)
            + ". Resume with the settings (or probe_preset) the run was started with; to change them, start a new "
            "run with probe_init_path pointing at this file."
        )


def check_history(saved: dict[str, Any] | None, history: HistorySpec | None, warm_start: bool, source: str) -> None:
    """Refuse a state whose probes read other inputs than `history`'s (history on in one, off in the other: files
    written before the history have none), and on resume a table of another size or decay."""
    if (saved is not None) != (history is not None):
        raise ValueError(
            f"{source} was written by a run with probe_history={saved is not None}, but this run sets "
            f"probe_history={history is not None}: {'this run' if history else 'the file'}'s probes read the "
            "history columns and the other's do not. Resume or warm-start with the setting the file was written "
            "with."
        )
    if saved is None or warm_start:
        return
    if (saved["size"], saved["decay"]) != (history.size, float(history.decay)):
        raise ValueError(
            f"{source} holds a prompt history of probe_history_size={saved['size']}, probe_history_decay="
            f"{saved['decay']}, but this run sets {history.size} and {float(history.decay)}. Resume with the "
            "settings the run was started with."
        )


def save_state(path: str | os.PathLike, saved: dict[str, Any]) -> None:
    """One safetensors file of a `state_to_dict` (the JSON in its header), written atomically."""
    atomic_save(saved["tensors"], path, metadata={"poise": json.dumps(saved["info"], sort_keys=True)})


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
    """Inverse of `save_probe_set`: {name: (tensors, per-probe info)} for `OnlineLearner.loaded`, and the JSON.

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
