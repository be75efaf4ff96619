from fivefold.models.decoder_spec import decoder_spec
from fivefold.models.mixtral.hf import ADAPTER


SPEC = decoder_spec("mixtral", ADAPTER, qk_norm=False, experts="required", other_kind="llama")
