from fivefold.models.decoder_stats import decoder_stats


def stats(cfg):
    return decoder_stats(cfg, qk_norm=True)
