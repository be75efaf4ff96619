"""The planner's statistics of the gpt_oss family (pure arithmetic, no torch): the decoder's, which
count the attention biases and sinks, the router and expert biases, and the sliding-window layers'
attention FLOPs over at most `sliding_window` keys (models/decoder_stats.py)."""

from fivefold.models.decoder_stats import decoder_stats


def stats(cfg):
    return decoder_stats(cfg)
