"""The models this server answers to: one engine, one served name (``--served-model-name``,
else the model argument), as ``vllm serve`` has without LoRA adapters."""

from __future__ import annotations

from http import HTTPStatus

from vllm.entrypoints.openai.errors import APIError
from vllm.entrypoints.openai.protocol import ModelCard, ModelList, now


class OpenAIServingModels:
    def __init__(self, served_model_name: str, model_path: str, max_model_len: int):
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.max_model_len = max_model_len
        self.created = now()

    def check_model(self, requested: str | None) -> str:
        """The served name for a request's ``model`` field; None (vLLM accepts a request
        without one) means the served model. Another name is a 404, in vLLM's words."""
        if requested is None or requested == self.served_model_name:
            return self.served_model_name
        raise APIError(
            f"The model `{requested}` does not exist.", HTTPStatus.NOT_FOUND, param="model"
        )

    def show_available_models(self) -> ModelList:
        card = ModelCard(
            id=self.served_model_name,
            created=self.created,
            root=self.model_path,
            max_model_len=self.max_model_len,
        )
        return ModelList(data=[card])
