from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.qwen3.hf import ADAPTER


SPEC = decoder_spec("qwen3", ADAPTER, qk_norm=True, experts="none", other_kind="qwen3_moe")
