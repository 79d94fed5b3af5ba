"""Deployments: a model architecture, a GPU datasheet and a tensor-parallel degree.

Everything the physics primitives need about a deployment is derived here, once,
as named constants (``Deployment.constants``); the Python evaluator and the Go
generator both read those constants.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from . import checks
from .builtin import BUILTIN_GPUS, BUILTIN_MODEL_CONFIGS, DEFAULT_GPU
from .deployment_formulas import evaluate_constants
from .errors import InputError
from .files import read_mapping
from .kernels import KernelTables, builtin_kernel_dir, kernel_tables, measured_kernels

KV_BLOCK_TOKENS = 16
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of GPU memory it may use
GIB = 1 << 30
# Memory a vLLM worker keeps out of the KV cache besides the weights (activation
# peak, CUDA graphs, NCCL buffers). Measured from the real traces: with 0.9 of an
# 80 GiB H100, Llama-2-70B TP4 reports 31,356 KV blocks and CodeLlama-34B TP2
# 26,602, which leaves 1.7 GB per GPU in both cases.
NON_KV_RESERVE_BYTES = 1.7e9

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "half": 2, "float32": 4, "float": 4, "float8": 1}
_KNOWN_ARCHITECTURES = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
}
_MOE_ARCHITECTURES = {"MixtralForCausalLM"}
_REQUIRED_MODEL_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts of a decoder-only transformer (from ``config.json``)."""

    name: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    n_experts: int = 1  # 1 for dense models
    experts_per_tok: int = 1
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 1

    @property
    def attention_params_per_layer(self) -> int:
        q_o = 2 * self.hidden_size * self.n_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.n_kv_heads * self.head_dim
        return q_o + k_v

    @property
    def expert_params(self) -> int:
        """Parameters of one gated MLP (one expert for MoE)."""
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def mlp_params_per_layer(self) -> int:
        router = self.hidden_size * self.n_experts if self.is_moe else 0
        return self.n_experts * self.expert_params + router

    @property
    def embedding_params(self) -> int:
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        norms = (2 * self.n_layers + 1) * self.hidden_size
        per_layer = self.attention_params_per_layer + self.mlp_params_per_layer
        return self.n_layers * per_layer + self.embedding_params + norms

    @property
    def active_matmul_params(self) -> float:
        """Parameters one token multiplies through in the layers (top-k experts for MoE)."""
        mlp = self.experts_per_tok * self.expert_params + (self.hidden_size * self.n_experts if self.is_moe else 0)
        return float(self.n_layers * (self.attention_params_per_layer + mlp))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer, over all GPUs."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """The datasheet figures the physics uses, in SI units."""

    name: str
    dense_flops_per_s: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    memory_bytes: float
    kernel_dir: str | None = None  # measured kernel tables (``primitives.kernels``); None: none measured


@dataclass(frozen=True)
class Deployment:
    model: ModelSpec
    gpu: GpuSpec
    tp: int

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.model.name, self.tp, self.gpu.name)

    @property
    def weight_bytes_per_gpu(self) -> float:
        return self.constants["weight_bytes_per_gpu"]

    @property
    def kv_bytes_per_token_per_gpu(self) -> float:
        return self.constants["kv_bytes_per_token_per_gpu"]

    @property
    def kernels(self) -> KernelTables:
        """The step-cost lookups built from the GPU's measured kernels, for this model and TP."""
        if self.gpu.kernel_dir is None:
            raise InputError(
                "--kernels",
                None,
                f"no measured kernel tables for the GPU {self.gpu.name!r} (built in: the H100 SXM's); give its"
                " tables' folder, laid out like H100's, or name the datasheet's GPU (its field 'name')",
            )
        return kernel_tables(self.gpu.kernel_dir, self.model, self.tp)

    def kv_capacity_blocks(self, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
        """KV-cache blocks of 16 tokens that fit per GPU (the Go export's ``KVBlocks`` too)."""
        free = gpu_memory_utilization * self.gpu.memory_bytes - self.weight_bytes_per_gpu - NON_KV_RESERVE_BYTES
        return int(max(free, 0.0) // (self.kv_bytes_per_token_per_gpu * KV_BLOCK_TOKENS))

    def kv_capacity_tokens(self, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> int:
        """KV-cache tokens that fit per GPU, rounded down to whole 16-token blocks."""
        return self.kv_capacity_blocks(gpu_memory_utilization) * KV_BLOCK_TOKENS

    @property
    def facts(self) -> dict[str, float | int]:
        """The model, GPU and TP facts the constants are computed from (``deployment_formulas``)."""
        m, g = self.model, self.gpu
        return {
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "n_layers": m.n_layers,
            "n_heads": m.n_heads,
            "n_kv_heads": m.n_kv_heads,
            "head_dim": m.head_dim,
            "vocab_size": m.vocab_size,
            "n_experts": m.n_experts,
            "experts_per_tok": m.experts_per_tok,
            "dtype_bytes": m.dtype_bytes,
            "tied_embeddings": int(m.tie_word_embeddings),
            "dense_flops_per_s": g.dense_flops_per_s,
            "hbm_bytes_per_s": g.hbm_bytes_per_s,
            "nvlink_bytes_per_s": g.nvlink_bytes_per_s,
            "tp_degree": self.tp,
        }

    @property
    def constants(self) -> dict[str, float]:
        """Named deployment constants, the only way primitives see a deployment
        (defined once, as sympy, in ``primitives.deployment_formulas``)."""
        return evaluate_constants(self.facts)


# ---------------------------------------------------------------------------
# Parsing


def _need(cfg: dict, key: str, path: object) -> int:
    if cfg.get(key) is None:
        raise InputError(path, key, "a required field is missing (expected a positive integer)")
    return _optional(cfg, key, path, 0)


def _optional(cfg: dict, key: str, path: object, default: int) -> int:
    """An optional positive integer field: absent or null gives DEFAULT, never 0 or a negative."""
    if cfg.get(key) is None:
        return default
    return int(checks.number(cfg[key], path, key, integer=True, upper=checks.MAX_MODEL_DIM))


def model_from_config(cfg: dict, name: str, path: object = "<built-in>") -> ModelSpec:
    """Build a ModelSpec from a HuggingFace ``config.json`` mapping (every field checked)."""
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise InputError(path, "architectures", f"expected a list such as ['LlamaForCausalLM'], got {archs!r}")
    arch = archs[0] if archs else None
    if arch not in _KNOWN_ARCHITECTURES:
        raise InputError(
            path, "architectures", f"unknown architecture {arch!r}; expected one of {sorted(_KNOWN_ARCHITECTURES)}"
        )
    size = {key: _need(cfg, key, path) for key in _REQUIRED_MODEL_FIELDS}
    n_heads = size["num_attention_heads"]
    n_kv = _optional(cfg, "num_key_value_heads", path, n_heads)  # absent: plain multi-head attention
    if n_heads % n_kv:
        raise InputError(
            path, "num_key_value_heads", f"{n_kv} does not divide num_attention_heads {n_heads}; expected a divisor"
        )
    if cfg.get("head_dim") is None and size["hidden_size"] % n_heads:
        raise InputError(
            path, "hidden_size", f"{size['hidden_size']} is not a multiple of num_attention_heads {n_heads}"
        )
    head_dim = _optional(cfg, "head_dim", path, size["hidden_size"] // n_heads)
    if arch in _MOE_ARCHITECTURES:  # its routing must be spelled out: a default of 1 expert would price it dense
        n_experts, experts_per_tok = _need(cfg, "num_local_experts", path), _need(cfg, "num_experts_per_tok", path)
    else:
        n_experts = _optional(cfg, "num_local_experts", path, 1)
        experts_per_tok = _optional(cfg, "num_experts_per_tok", path, 1) if n_experts > 1 else 1
    if experts_per_tok > n_experts:
        raise InputError(path, "num_experts_per_tok", f"{experts_per_tok} exceeds num_local_experts {n_experts}")
    dtype = cfg.get("torch_dtype")
    dtype = "bfloat16" if dtype is None else dtype
    if not isinstance(dtype, str) or dtype not in _DTYPE_BYTES:
        raise InputError(path, "torch_dtype", f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPE_BYTES)}")
    tie = cfg.get("tie_word_embeddings")
    return ModelSpec(
        name=name,
        architecture=arch,
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        n_layers=size["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=size["vocab_size"],
        n_experts=n_experts,
        experts_per_tok=experts_per_tok,
        dtype_bytes=_DTYPE_BYTES[dtype],
        tie_word_embeddings=False if tie is None else checks.boolean(tie, path, "tie_word_embeddings"),
    )


# Datasheet figures beyond these are typos, not GPUs (an H100: 1979 TFLOP/s, 3.35 TB/s, 80 GB)
_DATASHEET_UPPER = {"tensor_core": 1e6, "bandwidth_tb_s": 1e3, "nvlink_bandwidth_gb_s": 1e6, "capacity_gb": 1e5}


def gpu_from_datasheet(sheet: dict, path: object = "<built-in>") -> GpuSpec:
    """Build a GpuSpec from a datasheet JSON like ``hardware/h100-sxm.json`` (finite, positive figures)."""

    def get(section: str, key: str) -> float:
        block = sheet.get(section)
        if not isinstance(block, dict) or block.get(key) is None:
            raise InputError(path, f"{section}.{key}", "a required datasheet field is missing")
        upper = next(v for k, v in _DATASHEET_UPPER.items() if key.endswith(k))
        return float(checks.number(block[key], path, f"{section}.{key}", upper=upper))

    compute = sheet.get("compute") if isinstance(sheet.get("compute"), dict) else {}
    key = "bf16_tensor_core" if "bf16_tensor_core" in compute else "fp16_tensor_core"
    tflops = get("compute", key)
    if checks.boolean(compute.get("with_sparsity", False), path, "compute.with_sparsity"):
        tflops /= 2.0  # datasheets list the 2:4-sparsity figure; dense is half
    raw_name = sheet.get("name")
    name = Path(str(path)).stem if raw_name is None else checks.text(raw_name, path, "name", "a GPU name")
    return GpuSpec(
        name=name,
        dense_flops_per_s=tflops * 1e12,
        hbm_bytes_per_s=get("memory", "bandwidth_tb_s") * 1e12,
        nvlink_bytes_per_s=get("interconnect", "nvlink_bandwidth_gb_s") * 1e9,
        memory_bytes=get("memory", "capacity_gb") * GIB,  # an "80 GB" H100 holds 80 GiB
        kernel_dir=builtin_kernel_dir(name),
    )


# ---------------------------------------------------------------------------
# Name resolution: trace names (``llama-2-70b``), HF ids and folder names.


def canonical_model_key(name: str, versioned: bool = True) -> str:
    """Reduce any spelling of a model name to a comparison key.

    ``meta-llama/Llama-2-70b-hf``, ``Llama-2-70b-hf``, ``llama-2-70b`` and
    ``llama-2-70b-hf`` all become ``llama270b``; ``mixtral-8x7b-v0-1`` and
    ``Mixtral-8x7B-v0.1`` both become ``mixtral8x7bv01``, and ``mixtral8x7b`` without
    VERSIONED (a trace may name the model without its version).
    """
    base = name.strip().rstrip("/").split("/")[-1].lower()
    base = re.sub(r"-(hf|instruct)(?=$|-)", "", base)
    base = re.sub(r"-(hf|instruct)(?=$|-)", "", base)
    if not versioned:
        base = re.sub(r"[-_.]v\d+(?:[-_.]\d+)*$", "", base)
    return re.sub(r"[^a-z0-9]", "", base)


@dataclass
class ModelCatalog:
    """Model configs by name: the built-ins, or HF ``config.json`` folders."""

    configs: dict[str, tuple[dict, str]] = field(default_factory=dict)  # key -> (config, source)
    names: dict[str, str] = field(default_factory=dict)  # key -> display name

    @classmethod
    def builtin(cls) -> "ModelCatalog":
        cat = cls()
        for name, cfg in BUILTIN_MODEL_CONFIGS.items():
            cat.add(name, cfg, "<built-in>")
        return cat

    @classmethod
    def from_dir(cls, directory: Path) -> "ModelCatalog":
        """Every ``*/config.json`` below DIR (or DIR/config.json itself)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise InputError(directory, None, "expected a directory of HuggingFace config.json folders")
        cat = cls()
        files = sorted(directory.glob("**/config.json"))
        if not files:
            raise InputError(directory, "config.json", "no */config.json found below this directory")
        for f in files:
            name = f.parent.name if f.parent != directory else directory.name
            cat.add(name, read_mapping(f, "json"), str(f))
        return cat

    def add(self, name: str, cfg: dict, source: str) -> None:
        key = canonical_model_key(name)
        if key in self.configs:  # two folders for one model: neither may silently win
            raise InputError(source, "model", f"names the same model as {self.configs[key][1]}; keep one of them")
        self.configs[key] = (cfg, source)
        self.names[key] = name.split("/")[-1]

    def key_of(self, name: str) -> str:
        """NAME's key in ``configs``; a name without a version stands for the one model it can
        be (a trace's ``mixtral-8x7b``), for none where it could be two."""
        key = canonical_model_key(name)
        if key in self.configs:
            return key
        same = []
        if canonical_model_key(name, versioned=False) == key:
            same = [k for k, n in self.names.items() if canonical_model_key(n, versioned=False) == key]
            if len(same) == 1:
                return same[0]
        known = ", ".join(sorted(self.names.values()))
        which = f" it could be {' or '.join(sorted(self.names[k] for k in same))}: name the version;" if same else ""
        raise InputError(name, "model", f"no config for model {name!r};{which} known models: {known}")

    def model(self, name: str) -> ModelSpec:
        key = self.key_of(name)
        cfg, source = self.configs[key]
        return model_from_config(cfg, self.names[key], source)


# TP degrees an exported model covers for every catalog model (golden tests, embedded kernel tables)
CATALOG_TPS = (1, 2, 4, 8)


@dataclass
class DeploymentResolver:
    """Turns (model name, TP, GPU name) found in data into Deployments."""

    catalog: ModelCatalog = field(default_factory=ModelCatalog.builtin)
    gpus: dict[str, GpuSpec] = field(default_factory=dict)
    default_gpu: str = DEFAULT_GPU

    def __post_init__(self) -> None:
        if not self.gpus:
            self.gpus = {n: gpu_from_datasheet(s) for n, s in BUILTIN_GPUS.items()}

    @classmethod
    def from_options(
        cls, model_configs: Path | None = None, gpu_datasheet: Path | None = None, kernels: Path | None = None
    ) -> "DeploymentResolver":
        catalog = ModelCatalog.from_dir(model_configs) if model_configs else ModelCatalog.builtin()
        resolver = cls(catalog=catalog)
        if gpu_datasheet:
            gpu = gpu_from_datasheet(read_mapping(gpu_datasheet, "json"), gpu_datasheet)
            resolver.gpus[gpu.name] = gpu
            resolver.default_gpu = gpu.name
        if kernels:
            measured_kernels(str(Path(kernels).resolve()))  # a bad folder fails here, in one line
            default = resolver.gpus[resolver.default_gpu]
            resolver.gpus[default.name] = replace(default, kernel_dir=str(Path(kernels).resolve()))
        return resolver

    def gpu(self, name: str | None) -> GpuSpec:
        if not name:
            return self.gpus[self.default_gpu]
        for known, spec in self.gpus.items():
            if re.sub(r"[^a-z0-9]", "", known.lower()) == re.sub(r"[^a-z0-9]", "", str(name).lower()):
                return spec
        raise InputError(name, "gpu", f"no datasheet for GPU {name!r}; known: {sorted(self.gpus)}")

    def resolve(self, model: str, tp: int, gpu: str | None = None) -> Deployment:
        """The deployment; field ``model`` or ``tp`` errors leave the caller to name its file."""
        spec = self.catalog.model(model)
        checks.tp_fits_heads(spec.name, spec.n_heads, spec.n_kv_heads, int(tp))
        return _cached_deployment(spec, self.gpu(gpu), int(tp))

    def resolve_in(self, source: object, what: str, model: str, tp: int, gpu: str | None = None) -> Deployment:
        """``resolve`` for the deployment SOURCE (a trace, an exp-config.yaml) asks for: an unknown
        model or a TP that does not fit it names SOURCE and WHAT (its experiment)."""
        try:
            return self.resolve(model, tp, gpu)
        except InputError as exc:
            if exc.field not in ("model", "tp"):  # a bad config.json or datasheet names its own file
                raise
            raise InputError(source, exc.field, f"{what}: {exc.expected}") from None

    def catalog_deployments(self, primary: Deployment) -> list[Deployment]:
        """Every catalog model at every TP of ``CATALOG_TPS`` that divides its heads, on the
        primary deployment's GPU; the primary first. These are the deployments an exported
        model is built for (the Go export embeds their kernel tables)."""
        out = [primary]
        for name in sorted(self.catalog.names.values()):
            spec = self.catalog.model(name)
            for tp in CATALOG_TPS:
                if spec.n_heads % tp == 0 and spec.n_kv_heads % tp == 0:  # before resolve, which refuses it
                    d = self.resolve(name, tp, primary.gpu.name)
                    if d.key != primary.key:
                        out.append(d)
        return out

    def with_catalog(self, deployments: list[Deployment]) -> list[Deployment]:
        """DEPLOYMENTS, then every catalog deployment on each of their GPUs that is not among
        them: where the search holds a candidate to physics (its probes), since the Go export
        ships it for all of them, not only for the deployments of its data."""
        out, keys = list(deployments), {d.key for d in deployments}
        primaries = {}  # one per GPU: the catalog on it is the same from any of its deployments
        for d in deployments:
            primaries.setdefault(d.gpu.name, d)
        for primary in primaries.values():
            for d in self.catalog_deployments(primary)[1:]:
                if d.key not in keys:
                    out.append(d)
                    keys.add(d.key)
        return out

    def resolve_experiment(self, spec) -> Deployment:
        """The deployment of an ``ExperimentSpec``; errors name its ``exp-config.yaml``."""
        source = Path(spec.path) / "exp-config.yaml" if spec.path else spec.name
        return self.resolve_in(source, f"experiment {spec.name!r}", spec.model, spec.tp)


@lru_cache(maxsize=None)
def _cached_deployment(model: ModelSpec, gpu: GpuSpec, tp: int) -> Deployment:
    return Deployment(model=model, gpu=gpu, tp=tp)


def default_resolver() -> DeploymentResolver:
    return DeploymentResolver()
