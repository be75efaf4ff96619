"""fivefold: train language models with 5D parallelism, and plan the layout first."""

__version__ = "0.1.0"


def load_pretrained(path):
    """The single-device model of a Hugging Face checkpoint folder or a fivefold checkpoint, read
    tensor by tensor into a meta-device model (peak memory: the model plus one tensor). A LoRA
    checkpoint, or a PEFT adapter folder, gives the adapted model: its base (the model.init_from
    folder or the seed; the folder adapter_config.json names) with the adapters beside their layers."""
    from pathlib import Path

    if (Path(path) / "adapter_config.json").is_file():
        from fivefold.models.hf.peft_names import load_peft_folder

        return load_peft_folder(path)
    if (Path(path) / "state.json").is_file() or (Path(path) / "latest").is_file():
        from fivefold.tools.convert import checkpoint_to_model  # a step_N folder or a checkpoint root

        return checkpoint_to_model(path)
    from fivefold.models.hf.interop import load_pretrained as _load

    return _load(path)
