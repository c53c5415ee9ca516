"""Logits into tokens: sampling, logits processors, structured output, prompt logprobs, speculative
decoding.
"""
