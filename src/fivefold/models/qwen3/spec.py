from fivefold.config import ConfigError
from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.qwen3.hf import ADAPTER


def check(cfg) -> None:
    if cfg.moe.n_experts > 0:
        raise ConfigError(f"model.family=qwen3 is dense but model.moe.n_experts={cfg.moe.n_experts}; "
                          "use model.family=qwen3_moe for an MoE model")


SPEC = decoder_spec("qwen3", ADAPTER, qk_norm=True, check=check)
