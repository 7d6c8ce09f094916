"""Build a model from an HF model directory (config.json + safetensors) or random weights.

model = get_model("path/to/model")                      # config.json + *.safetensors
model = get_model("path/to/model", load_format="dummy") # its config, random weights
model = get_model(Mamba2ModelConfig(), load_format="dummy", dtype="bfloat16",
                  device="cuda")                         # any config, no disk at all
"""

from vllm.model_executor.model_loader.loader import LOAD_FORMATS, get_model, resolve_dtype

__all__ = ["LOAD_FORMATS", "get_model", "resolve_dtype"]
