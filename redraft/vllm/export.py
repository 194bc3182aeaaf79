"""A redraft target as the Hugging Face folder vLLM loads (``redraft-vllm export-target``).

vLLM reads a hub id or a local HF folder. redraft's targets also come from GGUF files (the
embedded default among them) and PEFT adapters; this writes any of them as a plain folder:
``config.json`` + ``model.safetensors`` (unquantized, in ``dtype``) + the tokenizer files.
"""

from __future__ import annotations

from pathlib import Path

from redraft.errors import ConfigError


def export_target(spec: str, out_dir, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Write target ``spec`` (any :func:`redraft.models.load_target` spec) to ``out_dir``.

    A GGUF file loads dequantized; its weights are saved unquantized, so the folder holds no
    quantization config. Returns ``out_dir``.

    Raises:
        ConfigError: ``out_dir`` holds a model already (pass ``overwrite=True``).
        TargetLoadError: the target does not load (the message says why).
    """
    from redraft.models import load_target

    out = Path(out_dir)
    if (out / "config.json").exists() and not overwrite:
        raise ConfigError(
            f"{out} already holds a model (config.json); pass --overwrite or another --out."
        )
    target = load_target(spec, dtype=dtype, device="cpu")
    model = target.model
    # GGUF weights are dequantized when loaded: what is saved is a plain model
    model.hf_quantizer = None
    model.is_quantized = False
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out
