"""A simulated vLLM V1 server under the inference-perf load generator, one concept a file."""
