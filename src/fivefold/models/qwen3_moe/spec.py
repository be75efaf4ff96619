from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.qwen3_moe.hf import ADAPTER


SPEC = decoder_spec("qwen3_moe", ADAPTER, qk_norm=True, experts="required", other_kind="qwen3")
