"""The 16 emulated experiments: the real study's models and workloads, and their specs.

The workloads mirror the real experiments' inputs (``results/config.yaml`` of each run,
hard-coded below: shared-prefix shape and load stages), but **every stage's duration is
scaled by** ``DURATION_SCALE`` (0.5) to keep the shipped data small; rates and prompt
shapes are unchanged. (So the reasoning runs build a shorter backlog than the real ones:
at seed 0 only Llama-2-7B, bound by its KV cache, loses requests to the 300 s client
timeout and preempts; the other three run saturated without collapsing.)
"""

from __future__ import annotations

from dataclasses import dataclass

from primitives.data.experiments import ExperimentSpec

DURATION_SCALE = 0.5  # every load stage runs for this fraction of its real duration


@dataclass(frozen=True)
class Workload:
    """inference-perf shared-prefix data and constant-rate load stages."""

    name: str
    num_groups: int
    num_prompts_per_group: int
    system_prompt_len: int
    question_len: int
    output_len: int
    stages: tuple[tuple[float, float], ...]  # (rate req/s, duration s) at full length

    def scaled_stages(self, scale: float = DURATION_SCALE) -> tuple[tuple[float, float], ...]:
        return tuple((rate, duration * scale) for rate, duration in self.stages)


WORKLOADS: dict[str, Workload] = {
    "general": Workload("general", 10, 10, 100, 447, 248, ((8.0, 600.0), (20.0, 600.0))),
    "codegen": Workload("codegen", 10, 10, 100, 466, 247, ((5.0, 600.0), (10.0, 600.0))),
    "roleplay": Workload("roleplay", 10, 10, 150, 600, 251, ((6.0, 1200.0),)),
    "reasoning": Workload("reasoning", 10, 10, 100, 934, 1448, ((4.0, 1200.0),)),
}


@dataclass(frozen=True)
class ServedModel:
    trace_name: str  # the name the real step traces use
    hf_name: str
    tp: int


SERVED_MODELS: tuple[ServedModel, ...] = (
    ServedModel("llama-2-7b", "meta-llama/Llama-2-7b-hf", 1),
    ServedModel("llama-2-70b", "meta-llama/Llama-2-70b-hf", 4),
    ServedModel("codellama-34b", "codellama/CodeLlama-34b-Instruct-hf", 2),
    ServedModel("mixtral-8x7b-v0-1", "mistralai/Mixtral-8x7B-v0.1", 2),
)


def experiment_id(model: ServedModel, workload: Workload) -> str:
    return f"synthetic-{model.trace_name}-tp{model.tp}-{workload.name}"


def all_experiments() -> list[tuple[ServedModel, Workload]]:
    return [(m, w) for m in SERVED_MODELS for w in WORKLOADS.values()]


def experiment_spec(model: ServedModel, workload: Workload, duration_scale: float = DURATION_SCALE) -> ExperimentSpec:
    """The simulator's input for one experiment (load stages scaled by DURATION_SCALE)."""
    return ExperimentSpec(
        name=experiment_id(model, workload),
        model=model.hf_name,
        tp=model.tp,
        stages=workload.scaled_stages(duration_scale),
        num_groups=workload.num_groups,
        num_prompts_per_group=workload.num_prompts_per_group,
        system_prompt_len=workload.system_prompt_len,
        question_len=workload.question_len,
        output_len=workload.output_len,
        # the server limits, memory share and client timeout: the real runs' (ExperimentSpec's defaults)
    )
