from fivefold.config import ConfigError
from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.qwen3_moe.hf import ADAPTER


def check(cfg) -> None:
    if cfg.moe.n_experts == 0:
        raise ConfigError("model.family=qwen3_moe needs model.moe.n_experts > 0; use model.family=qwen3 "
                          "for a dense model")


SPEC = decoder_spec("qwen3_moe", ADAPTER, qk_norm=True, check=check)
