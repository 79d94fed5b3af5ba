"""Built-in deployment descriptions, so that the default run needs no files.

These are the architecture hyper-parameters of the four public models (the fields of
their HuggingFace ``config.json`` that the physics uses) and the H100 SXM datasheet
figures. They are facts about the models and the GPU, not measurements.
"""

from __future__ import annotations

BUILTIN_MODEL_CONFIGS: dict[str, dict] = {
    "meta-llama/Llama-2-7b-hf": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    },
    "meta-llama/Llama-2-70b-hf": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    },
    "codellama/CodeLlama-34b-Instruct-hf": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 22016,
        "num_hidden_layers": 48,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
}

BUILTIN_GPUS: dict[str, dict] = {
    "H100 SXM": {
        "name": "H100 SXM",
        "compute": {"bf16_tensor_core": 1979, "fp16_tensor_core": 1979, "with_sparsity": True},
        "memory": {"capacity_gb": 80, "bandwidth_tb_s": 3.35},
        "interconnect": {"nvlink_bandwidth_gb_s": 900},
    },
}
DEFAULT_GPU = "H100 SXM"
