"""Speculative decoding without a draft model: proposals from the request's own tokens (n-gram
prompt lookup, suffix matching), verified by the target model k tokens at a time."""
