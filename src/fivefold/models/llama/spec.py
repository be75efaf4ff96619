from fivefold.config import ConfigError
from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.llama.hf import ADAPTER


def check(cfg) -> None:
    if cfg.moe.n_experts > 0:
        raise ConfigError(f"model.family=llama is dense but model.moe.n_experts={cfg.moe.n_experts}; "
                          "use model.family=mixtral (or qwen3_moe) for an MoE model")


SPEC = decoder_spec("llama", ADAPTER, qk_norm=False, check=check)
