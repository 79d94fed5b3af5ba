"""A reference emulator of vLLM on H100: the hidden physics behind the embedded default data.

The project ships a synthetic step-trace dataset (``primitives/data/embedded``) so that a
search runs without the withheld real traces. This package makes it:

* ``workloads``: the 16 experiments of the real study, 4 models (Llama-2-7B TP1,
  Llama-2-70B TP4, CodeLlama-34B TP2, Mixtral-8x7B TP2) x 4 workloads (general, codegen,
  roleplay, reasoning), with their load stages and server limits;
* ``physics``: the step time, a hidden physics model of the emulator's *own*, written
  independently of the project's primitives;
* ``server``: the emulated vLLM server, that physics plus seeded lognormal noise as a
  latency model of the project's own closed-loop simulation (``fitness.sim``: the
  inference-perf load generator and the vLLM V1 scheduler with chunked prefill, prefix
  caching and preemption);
* ``experiment``: one experiment simulated, 10 % of its steps sampled into the real
  traces' flat rows plus per-request detail;
* ``generate``: every experiment, written as Parquet with ``metadata.json``;
* ``cli``: ``python -m fitness.emulator``.

Regenerate with ``python -m fitness.emulator --out primitives/data/embedded --seed 0``
(deterministic: the same seed gives identical rows).
"""
