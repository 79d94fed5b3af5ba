"""The emulated server: the hidden physics as a latency model of ``fitness.sim.engine``.

The step time is the hidden physics' cycle time times lognormal noise; the non-step terms are
the ones ``fitness.sim.latency_model`` defines for every latency model, at the emulated
server's values (``SERVER_OVERHEADS``).
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from fitness.emulator.physics import EmulatorPhysics, HiddenPhysics
from fitness.sim.latency_model import NonStepTerms
from primitives.deployment import Deployment

# The emulated server's non-step latencies (µs); PostDecodeFixedOverhead stays at 0 (BLIS
# only: the simulated server does not apply it).
SERVER_OVERHEADS = NonStepTerms(
    queueing_base_us=2500.0,  # HTTP + tokenisation, arrival -> scheduler queue
    queueing_per_input_token_us=1.0,
    output_token_processing_us=300.0,  # detokenise + SSE, engine -> client
    scheduling_processing_us=0.0,  # already inside the cycle (CPU path and gap)
    preemption_processing_us=150.0,  # freeing blocks, requeueing, per preemption
)


class EmulatedVLLM(NonStepTerms):
    """A ``fitness.sim.latency_model.LatencyModel``: hidden physics plus seeded noise.

    ``step_time_us`` draws one lognormal factor per call from its own generator, so a
    run is deterministic for a seed (the simulator calls it once per step, in order).
    """

    def __init__(
        self,
        deployment: Deployment,
        physics: EmulatorPhysics | None = None,
        overheads: NonStepTerms | None = None,
        seed: int | np.random.SeedSequence = 0,
    ):
        super().__init__(**asdict(overheads or SERVER_OVERHEADS))
        self.hidden = HiddenPhysics(deployment, physics)
        self.physics = self.hidden.physics
        self._rng = np.random.default_rng(seed)
        self._indptr = np.zeros(2, dtype=np.int64)

    def noiseless_step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        self._indptr[1] = len(new_tokens)
        return float(self.hidden.cycle_time_us_csr(self._indptr, progress, new_tokens, input_len, output_len)[0])

    def step_time_us(self, progress, new_tokens, input_len, output_len) -> float:
        base = self.noiseless_step_time_us(progress, new_tokens, input_len, output_len)
        sigma = self.physics.noise_sigma
        return base * float(np.exp(sigma * self._rng.standard_normal())) if sigma > 0 else base


__all__ = ["SERVER_OVERHEADS", "EmulatedVLLM"]
