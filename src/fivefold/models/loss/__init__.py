"""The language-model loss: cross-entropy chunked over tokens (cross_entropy.py), fused with the
output layer so no micro-batch's logits exist (linear_cross_entropy.py), and the weight of the
micro-batch being run for the losses a model adds beside it (weight.py)."""
