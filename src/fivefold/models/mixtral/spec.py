from fivefold.config import ConfigError
from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.mixtral.hf import ADAPTER


def check(cfg) -> None:
    if cfg.moe.n_experts == 0:
        raise ConfigError("model.family=mixtral needs model.moe.n_experts > 0; use model.family=llama "
                          "for a dense model")


SPEC = decoder_spec("mixtral", ADAPTER, qk_norm=False, check=check)
