"""Step rows ready for scoring: primitive columns, cycle-time targets, temporal split."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from primitives.compute import constant_columns, features_from_requests, kernel_binding, primitive_columns
from primitives.data.traces import StepData
from primitives.deployment import Deployment, DeploymentResolver
from primitives.errors import InputError
from primitives.registry import AGGREGATE_FEATURES, supported_primitives


@dataclass
class StepTable:
    """Rows with a cycle-time target (or every sampled step: ``build_step_table``'s
    ``every_step``), and every supported primitive as a column."""

    columns: dict[str, np.ndarray]
    cycle_time_us: np.ndarray
    experiment: np.ndarray  # int code per row
    experiment_names: list[str]
    is_train: np.ndarray  # False for the temporal validation holdout
    primitive_names: list[str]
    deployments: list[Deployment]
    experiment_deployment: list[int]  # deployment index per experiment code
    fingerprint: str
    kv_sharing: dict[str, float] | None = None  # experiment -> factor applied to the trace's KV

    @property
    def n(self) -> int:
        return len(self.cycle_time_us)

    def subset(self, mask: np.ndarray) -> "StepTable":
        return StepTable(
            columns={k: v[mask] for k, v in self.columns.items()},
            cycle_time_us=self.cycle_time_us[mask],
            experiment=self.experiment[mask],
            experiment_names=self.experiment_names,
            is_train=self.is_train[mask],
            primitive_names=self.primitive_names,
            deployments=self.deployments,
            experiment_deployment=self.experiment_deployment,
            fingerprint=self.fingerprint,
            kv_sharing=self.kv_sharing,
        )


def temporal_split(experiment: np.ndarray, order: np.ndarray, validation_fraction: float) -> np.ndarray:
    """True for training rows: the first (1 - fraction) of each experiment in time."""
    is_train = np.ones(len(experiment), dtype=bool)
    for e in np.unique(experiment):
        idx = np.flatnonzero(experiment == e)
        idx = idx[np.argsort(order[idx], kind="stable")]
        n_val = int(round(validation_fraction * len(idx)))
        if n_val:
            is_train[idx[len(idx) - n_val :]] = False
    return is_train


def build_step_table(
    data: StepData,
    resolver: DeploymentResolver,
    primitive_names: list[str] | None = None,
    validation_fraction: float = 0.2,
    kv_sharing: dict[str, float] | None = None,
    every_step: bool = False,
) -> StepTable:
    """Primitive columns of every step with a cycle-time target (``every_step``: of every
    sampled step, in the data's order, the cycle time NaN where the next step was not sampled).

    ``kv_sharing`` (experiment -> factor, ``fitness.kv_sharing``) scales the block-counted KV
    of those experiments' aggregate rows to the per-request sum the primitives mean.
    """
    if every_step and validation_fraction:
        raise ValueError("every_step: a table of every step has no targets to split; give validation_fraction=0")
    steps = data.steps
    available = data.available_features
    supported = supported_primitives(available)
    names = supported if primitive_names is None else list(primitive_names)
    unsupported = [n for n in names if n not in supported]
    if unsupported:
        raise InputError(
            ", ".join(data.sources),
            unsupported[0],
            "this primitive needs per-request detail that the trace lacks (aggregates only)",
        )

    # features of every sampled step (per-request detail where present)
    n_steps = len(steps)
    feats = {f: steps[f].to_numpy(dtype=np.float64) for f in AGGREGATE_FEATURES}
    if data.requests is not None:
        r = data.requests
        feats = features_from_requests(
            r["step_row"].to_numpy(),
            r["progress"].to_numpy(),
            r["new_tokens"].to_numpy(),
            r["input_len"].to_numpy(),
            r["output_len"].to_numpy(),
            n_steps,
        )

    if data.requests is None and kv_sharing:
        factor = steps["experiment"].map(kv_sharing).fillna(1.0).to_numpy(dtype=np.float64)
        feats["kv_tokens"] = feats["kv_tokens"] * factor

    cycle_us = steps["cycle_time_us"].to_numpy()
    target_rows = np.arange(len(steps)) if every_step else np.flatnonzero(np.isfinite(cycle_us))
    exp_names = sorted(steps["experiment"].unique())
    exp_code_all = steps["experiment"].map({e: i for i, e in enumerate(exp_names)}).to_numpy()

    deployments: list[Deployment] = []
    exp_dep: list[int] = []
    for e in exp_names:
        first = steps.loc[steps["experiment"] == e].iloc[0]
        dep = resolver.resolve_in(
            ", ".join(data.sources), f"experiment {e!r}", first["model"], int(first["tp"]), first["gpu"] or None
        )
        if dep not in deployments:
            deployments.append(dep)
        exp_dep.append(deployments.index(dep))

    exp_code = exp_code_all[target_rows]
    row_dep = np.asarray(exp_dep, dtype=np.int64)[exp_code]
    consts = constant_columns(deployments, row_dep)
    cols = primitive_columns(
        {k: v[target_rows] for k, v in feats.items()}, consts, names, kernel_binding(names, deployments, row_dep)
    )
    is_train = temporal_split(exp_code, steps["step_id"].to_numpy()[target_rows], validation_fraction)
    return StepTable(
        columns=cols,
        cycle_time_us=cycle_us[target_rows],
        experiment=exp_code,
        experiment_names=exp_names,
        is_train=is_train,
        primitive_names=names,
        deployments=deployments,
        experiment_deployment=exp_dep,
        fingerprint=data.fingerprint(),
        kv_sharing=dict(kv_sharing or {}),
    )
