from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.llama.hf import ADAPTER


SPEC = decoder_spec("llama", ADAPTER, qk_norm=False, experts="none", other_kind="mixtral (or qwen3_moe)")
