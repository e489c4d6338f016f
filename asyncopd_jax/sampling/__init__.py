"""Jitted KV-cache sampling with exact behaviour log-probs and Monte-Carlo candidates."""

from asyncopd_jax.sampling.distribution import SamplingParams, sampling_logprobs
from asyncopd_jax.sampling.sampler import DecodeState, Sampler, WeightSource, left_pad

__all__ = ["DecodeState", "Sampler", "SamplingParams", "WeightSource", "left_pad", "sampling_logprobs"]
