"""Samplers: token ids in, sampled token ids with logprobs and policy version out."""
